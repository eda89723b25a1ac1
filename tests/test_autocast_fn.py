"""autocast as a function transformation: dtypes in the jaxpr and the HLO, gradients, training."""

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_scaler
from jmp_scaler.precision._autocast import DEFAULT_RULES, autocast, full_precision
from tests import _xla

F16 = "p=f32,c=f16,o=f32"
F16_DT, F32_DT = jnp.dtype("float16"), jnp.dtype("float32")
_RNG = np.random.default_rng(0)
X = jnp.asarray(_RNG.normal(size=(8, 16)), jnp.float32)
IMAGES = jnp.asarray(_RNG.normal(size=(4, 6, 6, 3)), jnp.float32)
TOKENS = jnp.asarray(_RNG.normal(size=(4, 5, 8)), jnp.float32)
LABELS = jnp.asarray(_RNG.integers(0, 4, size=8), jnp.int32)
MLP_PARAMS = [
  jnp.asarray(_RNG.normal(size=s) / np.sqrt(s[0]), jnp.float32) for s in ((16, 32), (32, 4))
]
# Faster XLA compilation for the programs the tests run (dtypes are under test, not LLVM).
FAST = _xla.compile_options()
fast_jit = functools.partial(jax.jit, compiler_options=FAST)
LOG_OPS = ("exp", "log", "log1p", "reduce_sum", "reduce_max", "integer_pow", "logistic")


# ------------------------------------------------------------------ inspection


def eqns(jaxpr):
  """Every equation of a (closed) jaxpr, sub-jaxprs included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jaxprs_in_params(eqn.params):
      yield from eqns(sub)


def in_dtypes(fn, *args, names=("dot_general", "conv_general_dilated") + LOG_OPS):
  """{primitive name: set of floating input dtypes} over the whole jaxpr of ``fn``."""
  out = {}
  for eqn in eqns(jax.make_jaxpr(fn)(*args)):
    if eqn.primitive.name in names:
      ds = {str(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
      out.setdefault(eqn.primitive.name, set()).update(ds)
  return out


_HLO = re.compile(
  r"= stablehlo\.(dot_general|convolution|exponential|log|log_plus_one|reduce)\b.* : "
  r"\(?tensor<(?:[\d?]+x)*(\w+)>"
)


def hlo_dtypes(fn, *args):
  """{HLO op: set of first-operand element types} in ``fn``'s lowered StableHLO.

  The lowered (not the CPU-compiled) module: XLA:CPU computes a float16 dot in
  float32 between two converts; what autocast decides is in the lowered text.
  """
  out = {}
  for m in _HLO.finditer(jax.jit(fn).lower(*args).as_text()):
    out.setdefault(m.group(1), set()).add(m.group(2))
  return out


# ------------------------------------------------------------------ models


def mlp(params, x):
  """A raw-jnp MLP in plain float32 code: no precision annotation anywhere."""
  for w in params[:-1]:
    x = jax.nn.gelu(x @ w)
  return jax.nn.log_softmax(x @ params[-1])


def mlp_hand(params, x):
  """The same MLP with the casts autocast makes, written by hand."""
  h16 = lambda a: a.astype(jnp.float16)
  for w in params[:-1]:
    x = jax.nn.gelu((h16(x) @ h16(w)).astype(jnp.float32))
  return jax.nn.log_softmax((h16(x) @ h16(params[-1])).astype(jnp.float32))


def loss_of(fn):
  return lambda p, x: -jnp.mean(jnp.take_along_axis(fn(p, x), LABELS[:, None], 1))


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x))
    return nn.Dense(4)(nn.relu(x).mean((1, 2)))


class Block(nnx.Module):
  def __init__(self, rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 8, 8, decode=False, rngs=rngs)
    self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    h = self.ln1(x)
    x = x + self.attn(h, h)
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


# ------------------------------------------------------------------ dtypes


def test_raw_mlp_dots_in_float16_and_exp_log_reductions_in_float32():
  f = autocast(mlp, F16)
  got = in_dtypes(f, MLP_PARAMS, X)
  assert got["dot_general"] == {"float16"}
  for name in ("exp", "log", "reduce_sum", "reduce_max", "integer_pow"):
    assert got[name] == {"float32"}, name
  hlo = hlo_dtypes(f, MLP_PARAMS, X)
  assert hlo["dot_general"] == {"f16"} and hlo["exponential"] == {"f32"}
  assert hlo["log"] == {"f32"} and hlo["reduce"] == {"f32"}
  # Backward: the matmuls of the gradient in float16 too, the rest in float32.
  grad = jax.grad(loss_of(f))
  assert in_dtypes(grad, MLP_PARAMS, X)["dot_general"] == {"float16"}
  assert hlo_dtypes(grad, MLP_PARAMS, X)["dot_general"] == {"f16"}
  out, grads = fast_jit(lambda p, x: (f(p, x), grad(p, x)))(MLP_PARAMS, X)  # one program
  assert out.dtype == F32_DT  # output dtype of the policy
  assert {g.dtype for g in grads} == {F32_DT}  # master weights' dtype
  # The untransformed function has no float16 anywhere.
  assert in_dtypes(mlp, MLP_PARAMS, X)["dot_general"] == {"float32"}


def test_grad_equals_the_hand_annotated_mixed_precision_grad():
  vg = lambda fn: jax.value_and_grad(loss_of(fn))
  auto, hand, full = fast_jit(lambda p, x: (vg(autocast(mlp, F16))(p, x), vg(mlp_hand)(p, x),
                                            vg(mlp)(p, x)))(MLP_PARAMS, X)  # one program
  for a, h, f in zip(
    jax.tree.leaves(auto), jax.tree.leaves(hand), jax.tree.leaves(full), strict=True
  ):
    np.testing.assert_allclose(a, h, rtol=1e-6, atol=1e-7)
    assert not np.allclose(a, f, rtol=1e-6, atol=1e-7)  # float16 really was used


@functools.cache
def _cnn_variables():
  """CNN().init(key(0), IMAGES) as one program (eagerly, one compile per op)."""
  return fast_jit(lambda: CNN().init(jax.random.key(0), IMAGES, train=False))()


def test_linen_cnn_with_batchnorm_through_model_apply():
  model = CNN()
  variables = _cnn_variables()
  apply = autocast(model.apply, F16)
  fwd = lambda v, x: apply(v, x, train=True, mutable=["batch_stats"])
  got = in_dtypes(fwd, variables, IMAGES)
  assert got["conv_general_dilated"] == {"float16"} and got["dot_general"] == {"float16"}
  assert got["reduce_sum"] == {"float32"}  # batch statistics
  assert hlo_dtypes(fwd, variables, IMAGES)["convolution"] == {"f16"}

  def loss(params):
    logits, new = fwd({**variables, "params": params}, IMAGES)
    return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS[:4]).mean(), (logits, new)

  grads, (out, new) = fast_jit(jax.grad(loss, has_aux=True))(variables["params"])
  assert out.dtype == F32_DT
  assert {x.dtype for x in jax.tree.leaves(new)} == {F32_DT}
  assert {x.dtype for x in jax.tree.leaves(variables)} == {F32_DT}  # stored as they were
  assert {g.dtype for g in jax.tree.leaves(grads)} == {F32_DT}
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_nnx_block_through_split_merge():
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Block(nnx.Rngs(0))))
  state = fast_jit(lambda: nnx.split(Block(nnx.Rngs(0)))[1])()  # one program, not one per op
  fwd = autocast(lambda s, x: nnx.merge(graphdef, s)(x), F16)
  got = in_dtypes(fwd, state, TOKENS)
  assert got["dot_general"] == {"float16"}  # projections, q.k, weights.v, MLP
  assert got["exp"] == {"float32"} and got["reduce_sum"] == {"float32"}  # softmax, norms
  out, ref = fast_jit(lambda s, x: (fwd(s, x), nnx.merge(graphdef, s)(x)))(state, TOKENS)
  assert out.dtype == F32_DT
  np.testing.assert_allclose(out, ref, atol=3e-2)


def test_scan_with_remat_body():
  def rnn(w, xs):
    cell = jax.checkpoint(lambda h, x: jnp.tanh(h @ w + x))
    h, hs = lax.scan(lambda h, x: (cell(h, x), jnp.exp(h).sum()), jnp.zeros(16), xs)
    return h.sum() + hs.sum()

  w = MLP_PARAMS[0][:, :16]
  f = autocast(rnn, F16)
  names = [e.primitive.name for e in eqns(jax.make_jaxpr(f)(w, X))]
  assert "scan" in names and ("remat2" in names or "checkpoint" in names)
  assert in_dtypes(f, w, X)["dot_general"] == {"float16"}
  assert in_dtypes(f, w, X)["exp"] == {"float32"}
  g, ref = fast_jit(lambda w, x: (jax.grad(f)(w, x), jax.grad(rnn)(w, x)))(w, X)
  assert g.dtype == F32_DT
  np.testing.assert_allclose(g, ref, rtol=5e-2, atol=5e-2)
  assert in_dtypes(jax.grad(f), w, X)["dot_general"] == {"float16"}


@jax.custom_vjp
def clip_gradient(x):
  return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


def test_custom_vjp_and_custom_jvp_keep_their_derivative_rules():
  def f(w, x):
    h = clip_gradient(x @ w)  # forward identity, backward clipped
    return (jax.nn.relu(h) * 100.0).sum() + jax.nn.softmax(h).max() + jax.nn.gelu(h).sum()

  w = MLP_PARAMS[0]
  names = [e.primitive.name for e in eqns(jax.make_jaxpr(autocast(f, F16))(w, X))]
  assert "custom_vjp_call" in names and "custom_jvp_call" in names
  relu0 = jax.grad(autocast(lambda x: jax.nn.relu(x @ jnp.zeros((1, 1))).sum(), F16))
  g, ref, at0 = fast_jit(lambda w, x: (  # one program
      jax.grad(autocast(f, F16), argnums=1)(w, x), jax.grad(f, argnums=1)(w, x),
      relu0(jnp.ones((1, 1)))))(w, X)  # fmt: skip
  # Clipped in the backward: |d/dh| <= 0.01, so |d/dx| <= 0.01 * sum |w|.
  assert np.all(np.abs(g) <= 0.01 * np.abs(w).sum(1) * 1.01)
  np.testing.assert_allclose(g, ref, rtol=2e-2, atol=2e-3)
  # relu's own rule: derivative 0 at 0, as jax.nn.relu defines it.
  assert float(at0[0, 0]) == 0.0


def test_while_cond_vmap_and_closed_over_constants():
  table = jnp.asarray(_RNG.normal(size=(16, 16)) / 4, jnp.float32)  # closed over

  def f(x, n):
    y = lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ table)), (0, x))
    return lax.cond(y[1].sum() > 0, lambda v: jnp.exp(v), lambda v: v * 2.0, y[1])

  g = autocast(f, F16)
  got = in_dtypes(g, X, jnp.int32(3))
  assert got["dot_general"] == {"float16"} and got["exp"] == {"float32"}
  rows = (0, 1, 5)

  @fast_jit  # every case in one program (eagerly, a dozen compiles)
  def run(x, n3, n2):
    batched = jax.vmap(g, in_axes=(0, None))(x[:, None], n2)  # one cond per row
    return g(x, n3), f(x, n3), batched, [g(x[i : i + 1], n2) for i in rows]

  auto, plain, batched, each = run(X, jnp.int32(3), jnp.int32(2))
  np.testing.assert_allclose(auto, plain, rtol=2e-2, atol=2e-2)
  for i, one in zip(rows, each, strict=True):
    np.testing.assert_allclose(batched[i], one, rtol=1e-3, atol=1e-3)
  assert auto.dtype == F32_DT  # g under jax.jit


def test_shard_map_inside_and_outside():
  mesh = jax.make_mesh((1,), ("d",))
  body = lambda w, x: lax.psum(jnp.exp(x @ w), "d")
  sm = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
  x = jax.device_put(X, NamedSharding(mesh, P("d")))
  w = MLP_PARAMS[0]
  got = in_dtypes(autocast(sm, F16), w, x)
  assert got["dot_general"] == {"float16"} and got["exp"] == {"float32"}
  np.testing.assert_allclose(*fast_jit(lambda w, x: (autocast(sm, F16)(w, x), sm(w, x)))(w, x),
                             rtol=2e-2)  # fmt: skip
  outer = jax.shard_map(autocast(body, F16), mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
  assert in_dtypes(outer, w, x)["dot_general"] == {"float16"}


def test_grad_with_custom_jvp_inside_shard_map_with_check_vma():
  """The data-parallel step of issue 22: jax.grad of an autocast loss with relu, psum-ed."""
  mesh = jax.make_mesh((1,), ("b",))
  w = jax.device_put(MLP_PARAMS[0][:, :4], NamedSharding(mesh, P()))
  x = jax.device_put(X, NamedSharding(mesh, P("b")))

  def step(fn):
    body = lambda w, x: lax.psum(jax.grad(fn)(w, x), "b")
    return fast_jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("b")), out_specs=P()))

  loss = lambda w, x: jax.nn.relu(x @ w).sum()
  got, ref = step(autocast(loss, F16))(w, x), step(loss)(w, x)
  assert got.dtype == F32_DT
  np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2)


def test_a_bias_is_added_in_the_matmul_dtype_and_its_gradient_summed_wide_rounded_once():
  """torch's addmm and cuBLAS's bias gradient: the head's bias add is float16 though only the
  float32 loss reads it, and the bias's gradient is the float16 cotangents summed in float32
  (also across a shard_map's devices) and rounded once to float16. 4097 rows of cotangent 1:
  float32 throughout gives 4097, float16 accumulation stalls at 2048, torch's gives 4096."""
  rows = 4097
  x, w = jnp.zeros((rows, 4), jnp.float32), jnp.zeros((4, 2), jnp.float32)
  b = jnp.zeros((2,), jnp.float32)
  loss = lambda b, w, x: jnp.sum(nn.Dense(2).apply({"params": {"kernel": w, "bias": b}}, x))
  auto = autocast(loss, F16)
  adds = [e for e in eqns(jax.make_jaxpr(auto)(b, w, x)) if e.primitive.name == "add"]
  assert [{str(v.aval.dtype) for v in e.invars} for e in adds] == [{"float16"}]
  assert fast_jit(jax.grad(loss))(b, w, x).tolist() == [4097.0, 4097.0]
  assert fast_jit(jax.grad(auto))(b, w, x).tolist() == [4096.0, 4096.0]
  given = autocast(loss, F16, rules={"add": "float32"})  # a rule for add is kept, bias or not
  adds = [e for e in eqns(jax.make_jaxpr(given)(b, w, x)) if e.primitive.name == "add"]
  assert [{str(v.aval.dtype) for v in e.invars} for e in adds] == [{"float32"}]
  assert fast_jit(jax.grad(given))(b, w, x).tolist() == [4097.0, 4097.0]
  mesh = jax.make_mesh((1,), ("b",))
  sm = jax.shard_map(lambda b, w, x: lax.psum(jax.grad(auto)(b, w, x), "b"), mesh=mesh,
                     in_specs=(P(), P(), P("b")), out_specs=P())  # fmt: skip
  x = jax.device_put(x, NamedSharding(mesh, P("b")))
  assert fast_jit(sm)(b, w, x).tolist() == [4096.0, 4096.0]
  psums = [e for e in eqns(jax.make_jaxpr(sm)(b, w, x)) if e.primitive.name.startswith("psum")]
  assert psums and all(str(e.invars[0].aval.dtype) == "float32" for e in psums)


def result_dtype(region):
  """The dtype of a region's first result before the policy's output cast to float32."""
  out = region.jaxpr.outvars[0]
  last = next((e for e in region.jaxpr.eqns if out in e.outvars), None)
  if last is not None and last.primitive.name == "convert_element_type" and out.aval.dtype == (
      jnp.float32) and jnp.issubdtype(last.invars[0].aval.dtype, jnp.floating):
    return last.invars[0].aval.dtype
  return out.aval.dtype


def region_of(fn, *args):
  return jax.make_jaxpr(fn)(*args).eqns[0].params["jaxpr"]


X16 = X.astype(jnp.float16)
CASTS = {  # the function, the dtype of its result under autocast (before the output cast)
  "round trip (jnp.sum)": (lambda x: jnp.sum(x**2), X16, "float32"),
  "round trip by hand": (lambda x: (x.astype(jnp.float32) * 2).astype(jnp.float16) + 1, X16,
                         "float32"),
  "dtype=float16 of a float32 op": (lambda x: jnp.sum(x, dtype=jnp.float16), X16, "float32"),
  "dtype=float32": (lambda x: jnp.sum(x, dtype=jnp.float32), X16, "float32"),
  "cumsum (jnp does not upcast)": (jnp.cumsum, X16, "float32"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASTS))
def test_what_the_casts_already_in_the_function_mean(name):
  fn, x, dtype = CASTS[name]
  assert str(result_dtype(region_of(autocast(fn, F16), x))) == dtype


def test_casts_as_written_keep_their_values_and_rules_can_keep_a_half_reduction():
  # A deliberate rounding is kept; hand-annotated Dense layers keep their float16 kernels and
  # biases, and the activation between them; the last bias add, which feeds only the output
  # cast to float32, stays in the matmul's dtype too (torch's addmm).
  rounding = autocast(lambda x: x - x.astype(jnp.float16).astype(jnp.float32), F16)
  model = nn.Sequential([nn.Dense(4, dtype=jnp.float16), nn.relu, nn.Dense(4, dtype=jnp.float16)])
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), X))
  adds = [e for e in eqns(jax.make_jaxpr(autocast(model.apply, F16))(variables, X))
          if e.primitive.name in ("add", "dot_general")]  # fmt: skip
  assert [{str(v.aval.dtype) for v in e.invars} for e in adds] == [
      {"float16"}, {"float16"}, {"float16"}, {"float16"}]  # fmt: skip
  keep = autocast(lambda x: jnp.sum(x, dtype=jnp.float16), F16, rules={"reduce_sum": "promote"})
  assert str(result_dtype(region_of(keep, X16))) == "float16"
  # Constants: a Python number is rounded to float16 when traced; a float32 one is exact.
  rounded = [e for e in eqns(jax.make_jaxpr(autocast(lambda x: x**1.7, F16))(X16))
             if e.primitive.name == "pow"]  # fmt: skip
  assert float(rounded[0].invars[1].val) == 1.7001953125
  x = jnp.asarray([3.0, 50.0], jnp.float16)
  power = autocast(lambda x: x ** jnp.float32(1.7), F16)
  err, exact = fast_jit(lambda x: (rounding(jnp.float32(0.1)), power(x)))(x)
  assert float(err) != 0.0
  np.testing.assert_allclose(exact, np.asarray(x, np.float64) ** 1.7, rtol=2e-6)


def test_float64_is_never_narrowed_outputs_included():
  with jax.enable_x64(True):
    x64 = jnp.ones((2, 2), jnp.float64)
    out = jax.eval_shape(autocast(lambda x: (x @ x, jnp.exp(x) * 2), F16), x64)
    assert [o.dtype for o in out] == [jnp.float64, jnp.float64]
    assert in_dtypes(autocast(lambda x: x @ x, F16), x64)["dot_general"] == {"float64"}


def test_int_bool_and_key_values_are_never_cast():
  def f(x, i, b, key):
    noise = jax.random.normal(key, x.shape)
    return x @ x.T + noise[:, :8].sum(), i * 2, ~b, key, jnp.argmax(x, 1)

  every = {name: "compute" for name in ("mul", "not", "random_bits", "argmax", "add")}
  g = autocast(f, F16, rules=every)
  key = jax.random.key(0)
  out = g(X, jnp.arange(3), jnp.array([True, False]), key)
  assert out[0].dtype == F32_DT and out[1].dtype == jnp.int32 and out[2].dtype == jnp.bool_
  assert out[3].dtype == key.dtype and out[4].dtype == jnp.int32
  assert jnp.array_equal(jax.random.key_data(out[3]), jax.random.key_data(key))
  for eqn in eqns(jax.make_jaxpr(g)(X, jnp.arange(3), jnp.array([True]), key)):
    if eqn.primitive.name == "convert_element_type":  # only float <-> float casts
      assert jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)
      assert jnp.issubdtype(eqn.params["new_dtype"], jnp.floating)


def test_regions_full_precision_and_nested_policies_visible_in_the_jaxpr():
  def f(w, x):
    a = full_precision(lambda w, x: x @ w)(w, x)
    b = autocast(lambda w, x: x @ w, "p=f32,c=bf16,o=f32")(w, x)
    return a + b + x @ w

  closed = jax.make_jaxpr(autocast(f, F16))(MLP_PARAMS[0], X)
  jits = {e.params["name"]: e for e in eqns(closed) if e.primitive.name == "jit"}
  assert set(jits) == {
      "jmp_autocast[p=f32,c=f16,o=f32](f)", "jmp_full_precision(<lambda>)",
      "jmp_autocast[p=f32,c=bf16,o=f32](<lambda>)",
  }  # fmt: skip
  dots = lambda e: {
      str(v.aval.dtype) for q in eqns(e.params["jaxpr"]) if q.primitive.name == "dot_general"
      for v in q.invars
  }  # fmt: skip
  assert dots(jits["jmp_full_precision(<lambda>)"]) == {"float32"}
  assert dots(jits["jmp_autocast[p=f32,c=bf16,o=f32](<lambda>)"]) == {"bfloat16"}
  assert dots(jits["jmp_autocast[p=f32,c=f16,o=f32](f)"]) == {"float16", "float32", "bfloat16"}
  # A full-precision region given float16 values computes in float32.
  up = full_precision(lambda x: x * 1.0)(X.astype(jnp.float16))
  assert up.dtype == F32_DT


def test_rule_overrides_and_validation():
  f32_dots = autocast(mlp, F16, rules={"dot_general": "float32"})
  assert in_dtypes(f32_dots, MLP_PARAMS, X)["dot_general"] == {"float32"}
  # tanh between two matmuls: in float16 by default (a unary op follows its input) ...
  tanh_32 = autocast(lambda x: jnp.tanh(x @ x.T) @ x, F16, rules={lax.tanh_p: "float32"})
  assert in_dtypes(tanh_32, X, names=("tanh",)) == {"tanh": {"float32"}}
  assert in_dtypes(autocast(lambda x: jnp.tanh(x @ x.T) @ x, F16), X, names=("tanh",)) == {
    "tanh": {"float16"}
  }
  # ... in float32 when only float32 uses follow (here the output cast), unless a rule is given.
  assert in_dtypes(autocast(lambda x: jnp.tanh(x @ x.T), F16), X, names=("tanh",)) == {
    "tanh": {"float32"}
  }
  given = autocast(lambda x: jnp.tanh(x @ x.T), F16, rules={"tanh": "promote"})
  assert in_dtypes(given, X, names=("tanh",)) == {"tanh": {"float16"}}
  assert DEFAULT_RULES["dot_general"] == "compute" and DEFAULT_RULES["exp"] == "float32"
  with pytest.raises(ValueError, match="rules"):
    autocast(mlp, F16, rules={"exp": "float8"})
  with pytest.raises(ValueError, match=r"unknown primitive 'tanhh'; did you mean 'tanh'"):
    autocast(mlp, F16, rules={"tanhh": "float32"})
  # A primitive of one's own is accepted as the object, and its rule applies.
  double_p = jax.extend.core.Primitive("jmp_test_double")
  double_p.def_abstract_eval(lambda x: x)
  own = autocast(lambda x: double_p.bind(x), F16, rules={double_p: "float32"})
  assert in_dtypes(own, X.astype(jnp.float16), names=("jmp_test_double",)) == {
    "jmp_test_double": {"float32"}
  }
  with pytest.raises(ValueError, match="rules"):
    autocast(mlp, F16, rules=[("exp", "float32")])
  with pytest.raises(ValueError, match="policy"):
    autocast(mlp, "p=f99")
  with pytest.raises(ValueError, match="policy"):
    autocast(mlp)
  with pytest.raises(ValueError, match="fun"):
    autocast(3, F16)
  with pytest.raises(ValueError, match="fun"):
    full_precision("mlp")


def test_decorator_forms_static_leaves_and_one_trace_per_signature():
  traces = []

  @autocast(policy=F16)
  def f(x, scale=1.0, *, name="x"):
    traces.append(name)
    return jnp.exp(x @ x.T) * scale

  @autocast(F16)
  def g(x):
    return x @ x.T

  for _ in range(3):
    f(X, 2.0, name="a")
  assert traces == ["a"]  # Python numbers and strings are static: one trace
  f(X, 3.0, name="a")
  assert len(traces) == 2
  assert g(X).dtype == F32_DT and f.__name__ == "f"


def test_the_jit_boundary_holds():
  """Traced outside any context, after the definition: still float16."""
  model = CNN()
  variables = _cnn_variables()
  step = jax.jit(autocast(functools.partial(model.apply, train=False), F16))
  # No context manager anywhere; the first call (the trace) happens here.
  hlo = hlo_dtypes(step, variables, IMAGES)
  assert hlo["convolution"] == {"f16"} and hlo["dot_general"] == {"f16"}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert step(variables, IMAGES).dtype == F32_DT


# ------------------------------------------------------------------ training


def _digits():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  perm = np.random.default_rng(0).permutation(len(y))
  x, y = np.asarray(x[perm] / 16.0, np.float32), np.asarray(y[perm], np.int32)  # numpy
  return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def _train(*forwards):
  """Each forward trained from the same init on the same batches, side by side in one compiled
  program (the 150 steps a scan): [(test accuracy, final state)] in the order given."""
  (xtr, ytr), (xte, yte) = _digits()
  sizes = [(64, 128), (128, 128), (128, 10)]
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.adam(3e-3))

  def step(state, x, y):
    scale = jmp_scaler.get_scale(state.opt_state)

    def loss(p):
      logits = state.apply_fn(p, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * scale

    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  @fast_jit
  def run(xtr, ytr, xte):
    keys = jax.random.split(jax.random.key(1), len(sizes))
    params = [jax.random.normal(k, s) / np.sqrt(s[0]) for k, s in zip(keys, sizes, strict=True)]
    states = [jmp_scaler.TrainState.create(apply_fn=f, params=params, tx=tx) for f in forwards]

    def body(states, i):
      j = (i * 200) % 1400
      x, y = lax.dynamic_slice_in_dim(xtr, j, 200), lax.dynamic_slice_in_dim(ytr, j, 200)
      return [step(state, x, y) for state in states], None

    states, _ = lax.scan(body, states, jnp.arange(150))
    return states, [jnp.argmax(f(s.params, xte), -1) for f, s in zip(forwards, states, strict=True)]

  states, preds = run(xtr, ytr, xte)
  return [(float((np.asarray(p) == yte).mean()), s) for p, s in zip(preds, states, strict=True)]


def test_digits_trains_in_float16_under_autocast_to_float32_accuracy():
  def forward(params, x):  # plain float32 code
    for w in params[:-1]:
      x = jax.nn.relu(x @ w)
    return x @ params[-1]

  (acc32, _), (acc16, state) = _train(forward, autocast(forward, F16))
  assert acc32 > 0.93
  assert abs(acc16 - acc32) <= 0.02, (acc16, acc32)
  assert {p.dtype for p in state.params} == {F32_DT}  # float32 master weights
  assert in_dtypes(state.apply_fn, state.params, jnp.ones((2, 64)))["dot_general"] == {"float16"}
