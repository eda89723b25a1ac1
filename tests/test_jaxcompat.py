"""jmp_scaler/jaxcompat: the JAX internals read in one place, on whichever JAX is installed."""

import types

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _primitives as P
from jmp_scaler.jaxcompat import _source as S
from jmp_scaler.jaxcompat._errors import JaxInternalsError
from tests.test_autocast_fn import eqns

ROW = jnp.arange(3.0)


def _eqn(fn, *args, name):
  return next(e for e in eqns(jax.make_jaxpr(fn)(*args)) if e.primitive.name == name)


def test_scan_parameters_read_alike_on_every_supported_jax():
  fn = lambda c, xs: lax.scan(lambda c, x: (c * x + ROW, (c, x.sum())), c, xs, reverse=True)
  p = P.scan(_eqn(fn, jnp.ones(3), jnp.ones((4, 3)), name="scan"))
  assert (p.num_consts, p.num_carry, p.length, p.reverse) == (1, 1, 4, True)
  # The body is closed and evaluates as the scan's step: (*consts, *carry, *x).
  out = J.run_closed(p.body)(ROW, jnp.ones(3), jnp.full(3, 2.0))
  assert [o.tolist() for o in out] == [[2.0, 3.0, 4.0], [1.0, 1.0, 1.0], 6.0]


def test_closed_keeps_the_constants_a_jaxpr_carries():
  closed = jax.make_jaxpr(lambda x: x + ROW)(jnp.ones(3))
  assert J.closed(closed).consts and J.closed(closed) is closed  # never detached
  again = J.closed(closed.jaxpr, closed.consts)
  assert J.run_closed(again)(jnp.ones(3))[0].tolist() == [1.0, 2.0, 3.0]


def test_custom_vjp_residuals_count_the_constants():
  @jax.custom_vjp
  def f(x):
    return jnp.sin(x) * ROW

  f.defvjp(lambda x: (f(x), x), lambda x, g: (g * jnp.cos(x) * ROW,))
  p = P.custom_vjp(_eqn(f, jnp.ones(3), name="custom_vjp_call"))
  assert p.num_consts == 1
  x = jnp.full(3, 0.5)
  outs = J.run_closed(p.fwd([True]))(x)
  res, prim = p.residuals(outs, [ROW, x])
  assert res[0] is x and jnp.allclose(prim[0], jnp.sin(x) * ROW)


def test_a_missing_parameter_names_the_jax_version_and_the_parameter():
  fake = types.SimpleNamespace(primitive=types.SimpleNamespace(name="scan"),
                               params={"jaxpr": None, "length": 1})  # fmt: skip
  with pytest.raises(JaxInternalsError, match=rf"of the scan equation in jax {jax.__version__}"):
    P.scan(fake)
  fake.primitive.name = "while"
  with pytest.raises(JaxInternalsError, match="'cond_jaxpr' of the while equation"):
    P.while_loop(fake)


def test_the_user_frame_skips_the_excluded_packages():
  def users_function(x):
    return jnp.exp(x)  # the line the frame names

  eqn = _eqn(users_function, jnp.ones(2), name="exp")
  frame = S.user_frames(eqn, [jax])[0]
  assert frame.function.endswith("users_function") and frame.file == __file__
  assert "jnp.exp" in open(frame.file).read().splitlines()[frame.line - 1]
  assert S.summary_location(eqn) == (frame.file, frame.line)


def test_inline_body_opens_every_call_and_nothing_else():
  @jax.custom_jvp
  def cj(x):
    return jnp.sin(x)

  cj.defjvp(lambda p, t: (cj(p[0]), t[0]))
  fns = {"jit": jax.jit(jnp.exp), "remat2": jax.checkpoint(jnp.exp), "custom_jvp_call": cj}
  for name, fn in fns.items():
    eqn = _eqn(fn, ROW, name=name)
    body = P.inline_body(eqn)
    assert [o.tolist() for o in J.run_closed(body)(ROW)] == [fn(ROW).tolist()], name
  assert P.inline_body(_eqn(jnp.exp, ROW, name="exp")) is None


def test_float32_params_widen_the_dtypes_and_reduce_precision():
  cast = _eqn(lambda x: x.astype(jnp.float16), ROW, name="convert_element_type")
  assert P.float32_params(cast)["new_dtype"] == jnp.float32
  dot = _eqn(lambda a: lax.dot(a, a, preferred_element_type=jnp.bfloat16),
             ROW.astype(jnp.bfloat16), name="dot_general")  # fmt: skip
  assert P.float32_params(dot)["preferred_element_type"] == jnp.float32
  rp = _eqn(lambda x: lax.reduce_precision(x, 5, 10), ROW, name="reduce_precision")
  params = P.float32_params(rp)
  assert (params["exponent_bits"], params["mantissa_bits"]) == (8, 23)
  widened = J.bind(rp, [jnp.asarray([1e5, 1.0 + 2.0**-20])], params)[0]
  assert widened.tolist() == [1e5, 1.0 + 2.0**-20]  # float32 keeps both; float16 would not
  assert P.float32_params(cast) is not cast.params and cast.params["new_dtype"] == jnp.float16


def test_user_frames_name_stack_and_function_name():
  def users_function(x):
    with jax.named_scope("my_scope"):
      return jnp.exp(x)  # the line

  def caller(x):
    return users_function(x)

  jaxpr = jax.make_jaxpr(caller)(ROW)
  eqn = jaxpr.eqns[0]
  found = S.user_frames(eqn, [jax])
  assert [f.function.rpartition(".")[2] for f in found[:2]] == ["users_function", "caller"]
  assert "my_scope" in S.name_stack(eqn)
  assert J.function_name(jaxpr) == "caller"


def test_is_collective_names_the_communicating_primitives():
  mesh = jax.make_mesh((1,), ("d",))
  spec = jax.sharding.PartitionSpec()
  fn = jax.shard_map(lambda x: lax.psum(jnp.exp(x), "d"), mesh=mesh, in_specs=spec,
                     out_specs=spec, check_vma=False)  # fmt: skip
  body = J.closed(_eqn(fn, ROW, name="shard_map").params["jaxpr"]).jaxpr
  assert {e.primitive.name: P.is_collective(e) for e in body.eqns} == {"exp": False,
                                                                       "psum": True}  # fmt: skip
