"""jmp_scaler.find_nonfinite: the first operation that makes an inf or a NaN (issue 30).

Each test builds a function whose first non-finite value is made by a known operation on a
known line, and asserts the phase, the primitive, the line (read back from this file), the
float32 verdict and where the operation sits (loop iteration, branch, device, autocast).
"""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_scaler

F16, F32 = jnp.float16, jnp.float32
HERE = pathlib.Path(__file__).resolve()
LINES = HERE.read_text().splitlines()
POLICY = "p=f32,c=f16,o=f32"


def line_of(report) -> str:
  """The text of the line ``report.source`` names (it must be in this file)."""
  path, _, rest = report.source.partition(" (")[0].rpartition(":")
  assert pathlib.Path(path).resolve() == HERE, report.source
  return LINES[int(rest) - 1]


def find(fn, *args, **kwargs):
  report = jmp_scaler.find_nonfinite(fn, *args, **kwargs)
  assert report is not None
  str(report)  # always printable
  return report


# ---------------------------------------------------------------- the cases


def matmul16(w, x):
  h = x.astype(F16) @ w.astype(F16)  # the float16 matmul
  return jnp.sum(h.astype(F32))


def test_a_float16_matmul_past_65504_is_float16s_fault():
  w, x = jnp.full((4, 4), 300.0), jnp.full((2, 4), 100.0)  # 4 * 300 * 100 = 120000
  r = find(matmul16, w, x)
  assert (r.phase, r.primitive, r.finite_in_float32) == ("forward", "dot_general", True)
  assert "the float16 matmul" in line_of(r) and r.source.endswith("(matmul16)")
  assert [i.dtype for i in r.inputs] == ["float16", "float16"]
  assert [i.max_abs for i in r.inputs] == [100.0, 300.0]
  assert r.outputs[0].inf == 8 and r.first_index == (0, 0)
  assert r.float32_max_abs == 120000.0
  text = str(r)
  assert "forward pass" in text and "a float16 range problem" in text
  assert "compute this dot_general in float32" in text


def log_of(x):
  return jnp.sum(jnp.log(x - 2.0))  # the log


def test_a_log_of_a_negative_number_fails_in_float32_too():
  r = find(log_of, jnp.ones(3))
  assert (r.phase, r.primitive, r.finite_in_float32) == ("forward", "log", False)
  assert "the log" in line_of(r)
  assert r.outputs[0].nan == 3 and r.outputs[0].inf == 0
  assert "float32 fails too: a bug in the model or the data: log of a negative number" in str(r)


def squares(w, x):
  h = x.astype(F16) @ w.astype(F16)  # h: 32 everywhere
  return jnp.mean(h.astype(F32) ** 2)


def test_a_backward_that_overflows_only_at_scale_2_16():
  w, x = jnp.full((64, 64), 0.5), jnp.ones((8, 64))
  assert jmp_scaler.find_nonfinite(squares, w, x) is None  # the forward is finite
  assert jmp_scaler.find_nonfinite(squares, w, x, scale=2.0**15) is None
  r = find(squares, w, x, scale=2.0**16)
  assert (r.phase, r.primitive, r.finite_in_float32) == ("backward", "dot_general", True)
  assert "h: 32 everywhere" in line_of(r)  # the forward matmul this gradient transposes
  assert r.scale == 2.0**16 and r.float32_max_abs == 65536.0
  assert "a scale of at most 32768 (2^15) keeps it finite" in r.advice


def root(x):
  return jnp.sum(jnp.sqrt(x))  # sqrt at 0: its derivative is inf


def test_a_derivative_computed_in_the_forward_part_is_a_backward_origin():
  # jax.grad computes 0.5 / sqrt(x) beside the forward pass: it is still the gradient's.
  r = find(root, jnp.array([0.0, 4.0]), scale=2.0)
  assert (r.phase, r.finite_in_float32) == ("backward", False)
  assert "sqrt at 0" in line_of(r) and r.first_index == (0,)
  assert "double-where" in r.advice


def test_bfloat16_overflows_where_float32_does():
  fn = lambda x: jnp.sum(x.astype(jnp.bfloat16) ** 2)  # noqa: E731
  r = find(fn, jnp.array([1.0, 1e20]))
  assert (r.primitive, r.finite_in_float32) == ("integer_pow", False)
  assert r.inputs[0].dtype == "bfloat16" and "not bfloat16's range" in r.advice
  assert "the result passes float32's range too" in r.advice


class MLP(nn.Module):
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dtype=self.dtype)(x))
    return nn.Dense(4, dtype=self.dtype)(x)  # the second layer


def _mlp_variables(x):
  variables = MLP().init(jax.random.key(0), x)
  return jax.tree.map(lambda a: a * 300.0, variables)  # large weights: the second layer overflows


def test_a_flax_module_overflow_is_reported_at_the_users_module_line():
  x = jnp.full((2, 8), 100.0)
  r = find(MLP(F16).apply, _mlp_variables(x), x)
  assert (r.phase, r.primitive, r.finite_in_float32) == ("forward", "dot_general", True)
  assert "the second layer" in line_of(r) and r.source.endswith("(MLP.__call__)")
  assert r.autocast is None and r.where == ()


def test_the_same_overflow_under_autocast_names_the_rule_and_the_region():
  x = jnp.full((2, 8), 100.0)
  variables = _mlp_variables(x)
  r = find(jmp_scaler.autocast(MLP().apply, POLICY), variables, x)  # a float32 model
  assert (r.phase, r.primitive, r.finite_in_float32) == ("forward", "dot_general", True)
  assert "the second layer" in line_of(r)
  assert r.autocast == POLICY and r.where == (f"jit jmp_autocast[{POLICY}](apply)",)
  assert "rules={'dot_general': 'float32'}" in r.advice and "full_precision" in r.advice
  # The advice holds: the rule it names keeps the matmul finite.
  fixed = jmp_scaler.autocast(MLP().apply, POLICY, rules={"dot_general": "float32"})
  assert jmp_scaler.find_nonfinite(fixed, variables, x) is None


def test_a_clean_function_gives_none_forward_and_backward():
  w, x = jnp.full((4, 4), 0.5), jnp.ones((2, 4))
  assert jmp_scaler.find_nonfinite(matmul16, w, x) is None
  assert jmp_scaler.find_nonfinite(matmul16, w, x, scale=2.0**10) is None


# ---------------------------------------------------------------- what it sees through


def masked_exp(x):
  return jnp.sum(jnp.where(x > 50.0, 0.0, jnp.exp(x)))  # exp(200) is masked away


def test_an_inf_masked_before_the_output_is_still_found():
  x = jnp.array([1.0, 200.0])
  assert np.isfinite(masked_exp(x))  # the result is finite...
  r = find(masked_exp, x)  # ...but exp overflowed on the way
  assert (r.primitive, r.finite_in_float32, r.first_index) == ("exp", False, (1,))
  assert "exp(200) is masked away" in line_of(r)
  assert "the result passes float32's range too" in r.advice


def test_an_intentional_minus_inf_is_not_an_origin():
  fn = lambda x: jnp.max(jnp.where(x > 0, x, -jnp.inf))  # noqa: E731
  assert jmp_scaler.find_nonfinite(fn, jnp.array([1.0, -1.0])) is None


def grows(x):
  def body(c, _):
    return c * jnp.float16(10.0), c  # the scan body
  c, _ = lax.scan(body, x, None, length=8)
  return c.astype(F32)


def test_a_scan_names_the_first_iteration_that_overflows():
  r = find(grows, jnp.ones(2, F16))  # 1, 10, ..., 1e4, then 1e5 > 65504 at iteration 4
  assert (r.primitive, r.finite_in_float32) == ("mul", True)
  assert "the scan body" in line_of(r) and r.where == ("scan iteration 4 of 8",)
  assert r.inputs[0].max_abs == 10000.0


def test_a_reversed_scan_counts_iterations_as_it_runs_them():
  def fn(xs):
    return lax.scan(lambda c, x: (c + jnp.exp(x), None), 0.0, xs, reverse=True)[0]  # reversed

  r = find(fn, jnp.array([100.0, 1.0, 100.0, 1.0]))  # runs index 3, then 2: exp(100) overflows
  assert r.primitive == "exp" and r.where == ("scan iteration 2 of 4, reversed",)


def branches(x, flag):
  return lax.cond(flag, lambda v: v * 1000.0, lambda v: v, x.astype(F16))  # the cond


def test_a_cond_names_the_branch_it_took():
  x = jnp.full(3, 100.0)
  assert jmp_scaler.find_nonfinite(branches, x, jnp.bool_(False)) is None
  r = find(branches, x, jnp.bool_(True))
  assert (r.primitive, r.where, r.finite_in_float32) == ("mul", ("cond branch 1",), True)
  assert "the cond" in line_of(r)


def test_a_while_loop_names_its_iteration():
  def fn(x, n):
    return lax.fori_loop(0, n, lambda i, v: v * 16.0, x)  # the loop body

  r = find(fn, jnp.ones(2, F16), jnp.int32(10))  # 16^4 = 65536: iteration 3 overflows
  assert (r.primitive, r.where, r.finite_in_float32) == ("mul", ("while_loop iteration 3",), True)
  assert "the loop body" in line_of(r)


@jax.custom_vjp
def amplify(x):
  return x


def _amplify_bwd(_, g):
  return ((g.astype(F16) * 8.0).astype(F32),)  # the custom backward rule


amplify.defvjp(lambda x: (x, None), _amplify_bwd)


def test_custom_vjp_forward_and_backward_are_opened():
  loss = lambda x: jnp.sum(amplify(jnp.exp(x)))  # noqa: E731 - exp inside the custom function
  r = find(loss, jnp.array([1.0, 100.0]))
  assert r.primitive == "exp" and r.phase == "forward"
  x = jnp.ones(2)
  assert jmp_scaler.find_nonfinite(loss, x, scale=2.0**12) is None  # 8 * 4096 fits
  r = find(loss, x, scale=2.0**13)
  assert (r.phase, r.primitive, r.finite_in_float32) == ("backward", "mul", True)
  # JAX gives the rule's operations the traceback of the call they differentiate.
  assert "amplify(jnp.exp(x))" in line_of(r)
  assert r.inputs[0].dtype == "float16" and r.inputs[0].max_abs == 2.0**13
  assert "2^12" in r.advice


def test_remat_and_jit_bodies_are_opened():
  @jax.jit
  def inner(x):
    return jax.checkpoint(lambda v: jnp.exp(v))(x)  # exp under remat

  r = find(lambda x: jnp.sum(inner(x)), jnp.array([1.0, 100.0]))
  assert r.primitive == "exp" and "exp under remat" in line_of(r)
  assert r.where[0] == "jit inner" and r.where[1].startswith(("remat", "checkpoint"))


def test_shard_map_names_the_device():
  mesh = jax.make_mesh((1,), ("d",))
  body = lambda x: lax.psum(jnp.sum(jnp.exp(x)), "d")  # noqa: E731 - exp on each shard
  fn = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P())
  x = jax.device_put(jnp.array([1.0, 100.0]), NamedSharding(mesh, P("d")))
  r = find(fn, x)
  assert r.primitive == "exp" and r.where == ("shard_map device 0 of 1",)
  assert "exp on each shard" in line_of(r)


# ---------------------------------------------------------------- NNX, equinox, losses


class Scaled(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 16, dtype=F16, rngs=rngs)

  def __call__(self, x):
    return self.linear(x) * 1000.0  # the module's multiply


def test_an_nnx_module_call_and_its_parameters_gradient():
  model = Scaled(nnx.Rngs(0))
  r = find(model, jnp.full((2, 8), 100.0))
  assert (r.primitive, r.finite_in_float32) == ("mul", True)
  assert "the module's multiply" in line_of(r) and r.source.endswith("(Scaled.__call__)")

  def loss(model, x):
    return jnp.mean(model.linear(x).astype(F32))  # the NNX loss

  x = jnp.full((8, 8), 8.0)  # d kernel = x^T (scale / 128): 8 * 8 * scale / 128
  assert jmp_scaler.find_nonfinite(loss, model, x, scale=2.0**16) is None
  r = find(loss, model, x, scale=2.0**17)
  assert (r.phase, r.primitive) == ("backward", "dot_general") and "the NNX loss" in line_of(r)


def test_an_equinox_module_as_the_differentiated_argument():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.Linear(8, 4, dtype=F16, key=jax.random.key(0))

  def loss(model, x):
    return jnp.mean(jax.vmap(model)(x).astype(F32))  # the equinox loss

  x = jnp.full((8, 8), 8.0, F16)  # d weight = 8 * 8 * scale / 32
  assert jmp_scaler.find_nonfinite(loss, model, x, scale=2.0**14) is None
  r = find(loss, model, x, scale=2.0**15)
  assert (r.phase, r.primitive, r.finite_in_float32) == ("backward", "dot_general", True)
  assert "the equinox loss" in line_of(r)


def test_a_float16_loss_times_the_scale_is_named_as_such():
  loss = lambda x: jnp.sum(x.astype(F16))  # noqa: E731
  r = find(loss, jnp.ones(4), scale=2.0**16)
  assert (r.phase, r.primitive) == ("backward", "convert_element_type")
  assert r.source == "the loss's cast to float32 before find_nonfinite's scale multiply"
  assert "Keep the loss in float32" in r.advice


def test_static_arguments_and_keywords():
  def fn(x, power, *, mode):
    y = x**power
    return jnp.log(y) if mode == "log" else y.astype(F16)  # the static branch

  x = jnp.full(2, 300.0)
  r = find(fn, x, 2, mode="cast")  # 90000 > 65504
  assert (r.primitive, r.finite_in_float32) == ("convert_element_type", True)
  assert "the cast to float16" in r.advice and "rescale it before the cast" in r.advice
  assert jmp_scaler.find_nonfinite(fn, x, 2, mode="log") is None


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan"), True, np.True_,
                                   "big", jnp.ones(2), 1e39, 1e-39])  # fmt: skip
def test_a_bad_scale_is_refused_at_the_call(scale):
  # 1e39 is inf in float32, 1e-39 subnormal: as dynamic_scale refuses them.
  with pytest.raises(ValueError, match=r"^scale must (be|lie)"):
    jmp_scaler.find_nonfinite(log_of, jnp.ones(3), scale=scale)


def test_bad_functions_and_inputs_are_refused_clearly():
  with pytest.raises(ValueError, match="fn must be callable, got 3"):
    jmp_scaler.find_nonfinite(3, jnp.ones(2))
  with pytest.raises(ValueError, match="fn must return a floating scalar loss"):
    jmp_scaler.find_nonfinite(lambda x: x * 2, jnp.ones(2), scale=2.0)
  with pytest.raises(ValueError, match="call it outside jax.jit"):
    jax.jit(lambda x: jmp_scaler.find_nonfinite(log_of, x))(jnp.ones(3))
  with pytest.raises(ValueError, match=r"in the inputs already \(args\[1\]\['x'\]\)"):
    jmp_scaler.find_nonfinite(lambda w, b: w * b["x"], jnp.ones(2),
                              {"x": jnp.array([1.0, jnp.nan])})  # fmt: skip


# ------------------------------------------------------------ inside a library's jit (issue 37)


def distance(w, w0):
  return jnp.linalg.norm(w - w0)  # the norm call


def test_the_gradient_of_a_norm_at_zero_names_the_users_call_of_the_norm():
  r = find(distance, jnp.ones(3), jnp.ones(3), scale=2.0)  # d|w - w0| at 0: 0.5 / sqrt(0)
  assert (r.phase, r.primitive, r.finite_in_float32) == ("backward", "div", False)
  assert "the norm call" in line_of(r) and r.source.endswith("(distance)")
  assert r.where == ("jit norm",)  # the library function, by its name
  assert "division by zero" in r.advice and "double-where" in r.advice


def test_a_forward_overflow_inside_a_jitted_library_function_names_the_users_line():
  r = find(lambda x: jnp.linalg.norm(x.astype(F16)), jnp.full(4, 300.0))  # 300^2 > 65504
  assert (r.phase, r.primitive, r.finite_in_float32) == ("forward", "mul", True)  # x * x
  assert "300^2 > 65504" in line_of(r) and r.where == ("jit norm",)


# ---------------------------------------------------------- the function in float32 (issue 37)


def adam_update(params, grads, opt_state):
  updates, _ = optax.adam(1e-3).update(grads, opt_state, params)  # optax's own adam
  return optax.apply_updates(params, updates)


def test_optax_adam_on_float16_parameters_blames_its_eps_not_the_data():
  params = {"w": jnp.ones(4, F16)}
  grads = {"w": jnp.array([0.0, 1e-3, 0.0, 1.0], F16)}  # a zero gradient: 0 / (sqrt(0) + eps)
  opt_state = optax.adam(1e-3).init(params)  # float16 moments, as optax#1784 reports
  r = find(adam_update, params, grads, opt_state)
  assert (r.phase, r.primitive, r.finite_in_float32) == ("forward", "div", False)
  assert "optax's own adam" in line_of(r)
  assert r.fn_finite_in_float32 is True  # float32 moments and eps: the update is 0
  assert "the constant 1e-08 is 0 in float16" in r.upstream
  assert "Fix the data" not in r.advice and "jmp_scaler.adam" in r.advice
  text = " ".join(str(r).split())
  assert "upstream add at" in text and "the whole function run in float32 is" in text
  # The advice holds: jmp_scaler.adam keeps the moments and the update in float32.
  tx = jmp_scaler.adam(1e-3)
  updates, _ = tx.update(grads, tx.init(params), params)
  assert np.isfinite(np.asarray(updates["w"], np.float32)).all()


def xent16(logits, label):
  p = jax.nn.softmax(logits.astype(F16))  # the float16 softmax
  return -jnp.log(p[label]).astype(F32)


def test_a_float16_softmax_that_underflows_into_log_is_float16s_fault():
  logits = jnp.array([0.0, 20.0])  # exp(-20) = 2e-9 < 6e-8: 0 in float16
  r = find(xent16, logits, 0)
  assert (r.primitive, r.finite_in_float32, r.fn_finite_in_float32) == ("log", False, True)
  # jax.nn.softmax's exp, or (jax >= 0.12.1) the softmax itself, one custom_jvp function
  assert r.upstream.startswith(("exp at ", "_softmax (a custom_jvp function) at "))
  assert "underflows to 0 in float16" in r.upstream
  assert "the float16 softmax" in LINES[int(r.upstream.split(":")[1].split()[0]) - 1]
  assert "jax.nn.log_softmax(logits.astype(jnp.float32))" in r.advice
  fixed = lambda z, y: -jax.nn.log_softmax(z.astype(F32))[y]  # noqa: E731 - the advice
  assert jmp_scaler.find_nonfinite(fixed, logits, 0) is None


def test_a_float16_matmul_that_underflows_under_autocast_names_the_matmul():
  def fn(w, x):
    return jnp.sum(jnp.log(x @ w))  # the log of an autocast matmul

  w, x = jnp.full((2, 2), 1e-4), jnp.full((3, 2), 1e-4)  # 2e-8: 0 in float16
  r = find(jmp_scaler.autocast(fn, POLICY), w, x)
  assert (r.primitive, r.finite_in_float32, r.fn_finite_in_float32) == ("log", False, True)
  assert r.upstream.startswith("dot_general at ") and "underflows to 0 in float16" in r.upstream
  assert "rules={'dot_general': 'float32'}" in r.advice


def test_a_function_that_fails_in_float32_too_says_so_at_both_levels():
  assert find(log_of, jnp.ones(3)).fn_finite_in_float32 is False  # float32 throughout
  r = find(lambda x: jnp.sum(jnp.log(x.astype(F16) - 2.0)), jnp.ones(3))  # widened: still < 0
  assert (r.finite_in_float32, r.fn_finite_in_float32, r.upstream) == (False, False, "")
  assert "nor is the whole function run in float32" in str(r)
  assert "Fix the data" in r.advice


def test_the_float32_run_widens_loops_too():
  def fn(x):
    def body(c, _):
      return c * jnp.float16(0.01), None  # the decaying carry

    c, _ = lax.scan(body, x.astype(F16), None, length=5)  # 1e-10: 0 in float16
    return jnp.sum(jnp.log(c.astype(F32)))

  r = find(fn, jnp.ones(2))
  assert (r.primitive, r.finite_in_float32, r.fn_finite_in_float32) == ("log", False, True)
  assert r.upstream.startswith("scan at ") and "underflows to 0 in float16" in r.upstream


def test_an_underflow_inside_a_library_function_names_the_function_and_the_users_line():
  def reg(w):
    return jnp.linalg.norm(w.astype(F16)).astype(F32)  # the float16 norm

  r = find(reg, jnp.full(3, 1e-4), scale=2.0)  # (1e-4)^2 = 1e-8: 0 in float16, then 0 / 0
  assert (r.phase, r.primitive, r.finite_in_float32, r.fn_finite_in_float32) == (
    "backward", "div", False, True)
  assert "the float16 norm" in line_of(r) and r.where == ("jit norm",)
  assert r.upstream.startswith("mul inside norm at ") and "underflows to 0" in r.upstream
  assert "Call norm on float32 values" in r.advice


class Classifier(nnx.Module):
  def __init__(self, rngs):
    kernel = lambda *_: jnp.tile(jnp.array([[5.0, 0.0, -5.0]], F16), (4, 1))  # noqa: E731
    self.head = nnx.Linear(4, 3, dtype=F16, param_dtype=F16, kernel_init=kernel, rngs=rngs)

  def __call__(self, x):
    return jnp.log(jax.nn.softmax(self.head(x)))  # log of a float16 softmax


def test_an_nnx_models_log_of_softmax_blames_the_underflow_and_names_log_softmax():
  model = Classifier(nnx.Rngs(0))  # logits 20, 0, -20: exp(-40) is 0 in float16
  r = find(lambda m, x: jnp.sum(m(x).astype(F32)), model, jnp.ones((2, 4)))
  assert (r.primitive, r.finite_in_float32, r.fn_finite_in_float32) == ("log", False, True)
  assert "log of a float16 softmax" in line_of(r) and r.source.endswith("(Classifier.__call__)")
  assert "underflows to 0 in float16" in r.upstream and "log_softmax" in r.advice
