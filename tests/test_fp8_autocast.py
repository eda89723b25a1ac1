"""autocast(fn, policy, rules={"dot_general": "fp8"}): every matmul of any function in fp8.

The rule binds ``jmp_scaler.fp8_dot_general`` (tests/test_fp8.py tests the op); these
tests check what autocast adds: which dots it reaches (``@``, jnp.einsum, jnp.dot, Flax's
Dense, DenseGeneral and attention, NNX's Linear), in the exact GPU pattern (the checker of
tests/test_fp8.py), which it keeps out (regions, convolutions, dots the op refuses, with a
warning), the recipe, the loss scaler's skip, and training.
"""

import functools
import pathlib
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jmp_scaler
from tests.test_fp8 import (
    DN,
    Attention,
    DenseStack,
    _assert_every_dot_is_an_fp8_gemm,
    _bits,
    _digits,
    _dots,
    _f16_run,
    _grad_text,
    fast_jit,
)

BF16, F16, F32 = "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32", "p=f32,c=f32,o=f32"
FP8 = {"dot_general": "fp8"}
_RNG = np.random.default_rng(0)
X = jnp.asarray(_RNG.normal(size=(4, 8)), jnp.float32)
W = jnp.asarray(_RNG.normal(size=(8, 8)) / 3, jnp.float32)
TOKENS = jnp.ones((2, 4, 8))


def fp8_autocast(policy):
  return lambda fn: jmp_scaler.autocast(fn, policy, rules=FP8)


def _lowered(fn, *args):
  return jax.jit(fn).lower(*args).as_text()


def _operands(text):
  return sorted(d["operands"] for d in _dots(text))


# ------------------------------------------------------------- the GPU pattern


def test_every_dot_of_a_plain_dense_stack_is_the_fp8_gemm_pattern_through_autocast():
  # The Dense stack of tests/test_fp8.py written with lax.dot_general: no fp8 in the model.
  text = _grad_text(DenseStack(dot=lax.dot_general), TOKENS, fp8_autocast(BF16))
  _assert_every_dot_is_an_fp8_gemm(_dots(text), expected=9)  # 3 layers x (fwd, dgrad, wgrad)


def test_every_dot_of_a_plain_attention_block_with_multi_dimensional_einsums_is_fp8():
  text = _grad_text(Attention(dot=lax.dot_general), TOKENS, fp8_autocast(BF16))
  _assert_every_dot_is_an_fp8_gemm(_dots(text), expected=18)  # 6 sites x 3


def raw(w, x):
  """``@``, a two-contracting-dimension jnp.einsum and jnp.dot, in plain float32 code."""
  h = jnp.tanh(x @ w)
  h = jnp.einsum("bij,ijk->bk", h.reshape(4, 2, 4), w.reshape(2, 4, 8))
  return jnp.dot(h, w.T)


@pytest.mark.parametrize("policy, out", [(BF16, "bf16"), (F16, "f16"), (F32, "f32")])
def test_matmul_einsum_and_dot_run_in_fp8_under_every_policy(policy, out):
  fn = jmp_scaler.autocast(raw, policy, rules=FP8)
  dots = _dots(_lowered(jax.grad(lambda w, x: jnp.sum(fn(w, x) ** 2), (0, 1)), W, X))
  _assert_every_dot_is_an_fp8_gemm(dots, expected=9)
  # The forward GEMMs give the compute dtype: computed in float32, scaled in float32, then cast.
  fwd = _dots(_lowered(fn, W, X))
  assert [(d["result"], d["scale"], d["out"]) for d in fwd] == [("f32", "f32", out)] * 3
  assert jax.eval_shape(fn, W, X).dtype == jnp.float32  # o=f32


def test_an_fp8_dot_general_inside_autocast_stays_fp8():
  # Dense(dot_general=fp8_dot_general) under the default rules: the op's fp8 GEMMs are not
  # widened to the compute dtype (they were bfloat16 dots before the rule existed).
  text = _grad_text(DenseStack(), TOKENS, lambda f: jmp_scaler.autocast(f, BF16))
  _assert_every_dot_is_an_fp8_gemm(_dots(text), expected=9)


# ------------------------------------------------------------- what stays out


def head(w, x):
  return x @ w


def regions(p, x, images):
  h = x @ p["w"]                                                     # fp8
  a = jmp_scaler.full_precision(head)(p["w"], h)                     # float32
  b = jmp_scaler.autocast(head, BF16)(p["w"], h)                     # bfloat16
  c = jmp_scaler.autocast(head, BF16, rules={"dot_general": "compute"})(p["w"], h)
  conv = lax.conv_general_dilated(images, p["k"], (1, 1), "SAME",
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return a + b + c, conv


def test_regions_and_convolutions_keep_their_dots_out_of_fp8():
  p = {"w": W, "k": jnp.ones((3, 3, 2, 4)) / 9}
  images = jnp.ones((1, 5, 5, 2))
  text = _lowered(jmp_scaler.autocast(regions, BF16, rules=FP8), p, X, images)
  assert _operands(text) == [("bf16", "bf16"), ("bf16", "bf16"), ("f32", "f32"),
                             ("f8E4M3FN", "f8E4M3FN")]
  assert re.findall(r"stablehlo\.convolution.*: \(tensor<\S*x(\w+)>", text) == ["bf16"]


def test_the_rule_is_for_dot_general_only_and_is_checked_at_construction():
  with pytest.raises(ValueError, match=r"rules\['conv_general_dilated'\] is 'fp8'.*dot_general"):
    jmp_scaler.autocast(raw, BF16, rules={"conv_general_dilated": "fp8"})
  with pytest.raises(ValueError, match=r"rules\['ragged_dot'\] is 'fp8'"):
    jmp_scaler.autocast(raw, BF16, rules={"ragged_dot": jmp_scaler.Fp8Recipe()})
  with pytest.raises(ValueError, match=r"rules\['dot_general'\] must be one of .*'fp8'.*Fp8Recipe"):
    jmp_scaler.autocast(raw, BF16, rules={"dot_general": "fp16"})
  jmp_scaler.autocast(raw, BF16, rules={lax.dot_general_p: "fp8"})  # the primitive works too


def refused(w, x, i):
  a = jnp.dot(x, w, precision=lax.Precision.HIGHEST)  # asks for more than fp8 has
  b = jnp.dot(i, i.T)                                 # integers: not a floating matmul
  return a @ w, b


def test_a_dot_the_op_refuses_runs_in_the_compute_dtype_with_one_warning_per_site():
  i = jnp.ones((3, 5), jnp.int32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    for _ in range(2):  # two transformations, two traces: one warning per site
      text = _lowered(jmp_scaler.autocast(refused, BF16, rules=FP8), W, X, i)
  msgs = sorted(str(w.message) for w in caught)  # "...:NN:..." sorts the sites by line
  assert len(msgs) == 2, msgs
  assert "runs in bfloat16" in msgs[0] and "cannot honour precision" in msgs[0], msgs
  assert "runs in int32" in msgs[1] and "operands, got lhs of dtype int32" in msgs[1], msgs
  assert all(f"{pathlib.Path(__file__).name}:" in m for m in msgs)  # the site is the user's
  # The refused dots are the compute rule's (bfloat16, int32); the next dot is fp8.
  assert _operands(text) == [("bf16", "bf16"), ("f8E4M3FN", "f8E4M3FN"), ("i32", "i32")]


def test_a_float64_dot_is_never_narrowed_and_says_it_is_not_fp8():
  with jax.enable_x64(True), pytest.warns(UserWarning, match="runs in float64.*float64"):
    x64 = jnp.ones((2, 2), jnp.float64)
    out = jax.eval_shape(jmp_scaler.autocast(lambda x: x @ x, BF16, rules=FP8), x64)
  assert out.dtype == jnp.float64


# ------------------------------------------------------------------ the recipe


@functools.cache
def _with(rule):
  return fast_jit(jmp_scaler.autocast(lambda w, x: x @ w, F32, rules={"dot_general": rule}))


def test_the_rule_runs_the_op_with_the_default_recipe_or_the_one_given():
  pow2 = jmp_scaler.Fp8Recipe(use_power_2_scales=True)
  op = fast_jit(lambda w, x, r: jmp_scaler.fp8_dot_general(x, w, DN, recipe=r),
                static_argnums=2)
  got, want = np.asarray(_with("fp8")(W, X)), np.asarray(op(W, X, jmp_scaler.Fp8Recipe()))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(_with(pow2)(W, X)), np.asarray(op(W, X, pow2)))
  assert not np.array_equal(np.asarray(_with(pow2)(W, X)), got)  # the recipe was used
  e4m3 = jmp_scaler.autocast(raw, BF16, rules={"dot_general": jmp_scaler.Fp8Recipe("e4m3")})
  grad = jax.grad(lambda w, x: jnp.sum(e4m3(w, x)), (0, 1))
  assert {d["operands"] for d in _dots(_lowered(grad, W, X))} == {("f8E4M3FN", "f8E4M3FN")}


# ------------------------------------------------------- non-finite, training


def _f16_fp8(apply):
  return jmp_scaler.autocast(apply, F16, rules=FP8)


def test_an_overflowing_fp8_operand_through_autocast_makes_the_step_skip_exactly():
  # The linen MLP of tests/test_fp8.py in plain float32 (lax.dot_general, no dtype); its
  # float16 input overflows at the second step: the fp8 dot gets an inf operand.
  s0, s1, s2, s3 = _f16_run(lax.dot_general, _f16_fp8, None)  # jitted once, no host sync
  m = lambda s: jmp_scaler.to_scalars(s.scale_metrics())
  assert [m(s)["skipped"] for s in (s1, s2, s3)] == [0, 1, 0]
  assert _bits(s2.params) == _bits(s1.params) and _bits(s2.opt_state[1]) == _bits(s1.opt_state[1])
  assert int(s2.step) == 1 and int(s3.step) == 2 and _bits(s3.params) != _bits(s2.params)
  # ... and the dots of that step were fp8 GEMMs, not float16 dots that overflowed.
  loss = lambda p, x: jnp.sum(s0.apply_fn({"params": p}, x.astype(jnp.float16)) ** 2)
  # 2 layers x (forward, wgrad) and the second layer's dgrad.
  _assert_every_dot_is_an_fp8_gemm(_dots(_lowered(jax.grad(loss), s0.params, X[:, :6])), 5)


def mlp(params, x):
  """A raw-jnp MLP: plain float32 code."""
  for w, b in params[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = params[-1]
  return x @ w + b


class LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(10)(x)


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(i, o, rngs=rngs) for i, o in ((64, 64), (64, 64),
                                                                       (64, 10))])

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


def _mlp_params(seed, shift):
  """He-initialised 64-64-64-10 weights; the first layer's divided by ``shift``."""
  sizes = [(64, 64), (64, 64), (64, 10)]
  ks = jax.random.split(jax.random.key(seed), 3)
  ws = [jax.random.normal(k, s) * np.sqrt(2 / s[0]) for k, s in zip(ks, sizes, strict=True)]
  ws[0] = ws[0] / shift
  return [(w, jnp.zeros(w.shape[1])) for w in ws]


def _as_linen(params):
  return {"params": {f"Dense_{i}": {"kernel": w, "bias": b} for i, (w, b) in enumerate(params)}}


_NNX_GRAPH, _ = nnx.split(NnxMlp(nnx.Rngs(0)))


def _as_nnx(params):
  model = nnx.merge(_NNX_GRAPH, nnx.state(NnxMlp(nnx.Rngs(0))))
  for layer, (w, b) in zip(model.layers, params, strict=True):
    layer.kernel[...], layer.bias[...] = w, b
  return nnx.state(model)


MODELS = {  # name: (forward(params, x) in plain float32 code, params from _mlp_params)
    "raw": (mlp, lambda p: p),
    "linen": (LinenMlp().apply, _as_linen),
    "nnx": (lambda s, x: nnx.merge(_NNX_GRAPH, s)(x), _as_nnx),
}


@functools.cache
def _trainer(names, policy, rules=None):
  """100 Adam steps of 128 digits (tests/test_fp8.py's task) of each of ``MODELS[names]``
  under ``autocast(forward, policy, rules=rules)``, side by side in one compiled program;
  each one's loss on all 1797 digits. ``shift`` multiplies the inputs (and divides the
  first layer's initial weights)."""
  x, y = _digits()
  tx = optax.adam(1e-2)
  forwards = [jmp_scaler.autocast(MODELS[n][0], policy, rules=dict(rules or {})) for n in names]

  def loss(forward, p, xb, yb, shift):
    return optax.softmax_cross_entropy_with_integer_labels(forward(p, xb * shift), yb).mean()

  @fast_jit
  def train(params, key, shift):
    def step(carry, i):
      idx = jax.random.randint(jax.random.fold_in(key, i), (128,), 0, x.shape[0])
      new = []
      for forward, (p, o) in zip(forwards, carry, strict=True):
        g = jax.grad(functools.partial(loss, forward))(p, x[idx], y[idx], shift)
        u, o = tx.update(g, o, p)
        new.append((optax.apply_updates(p, u), o))
      return tuple(new), None

    carry, _ = lax.scan(step, tuple((p, tx.init(p)) for p in params), jnp.arange(STEPS))
    return [loss(f, p, x, y, shift) for f, (p, _) in zip(forwards, carry, strict=True)]

  def run(seed, shift=1.0):
    weights = _mlp_params(seed, shift)
    params = tuple(MODELS[n][1](weights) for n in names)
    return [float(v) for v in train(params, jax.random.key(seed + 100), jnp.float32(shift))]

  return run


_FP8 = tuple(FP8.items())
STEPS = 100
_ALL = tuple(MODELS)


def test_raw_linen_and_nnx_mlps_train_in_fp8_from_one_autocast_argument_within_noise_of_bf16():
  # Seeds 0-2 (this trainer): bfloat16 0.0575 +- 0.0108, fp8 0.0586 +- 0.0054, float32
  # 0.0569 +- 0.0093. The bar: 2.5 seed sds of bfloat16. The linen
  # and NNX MLPs have the raw MLP's weights: the same losses, to 4 decimals.
  (bf16,) = _trainer(("raw",), BF16)(0)
  raw, linen, nnx_ = _trainer(_ALL, BF16, _FP8)(0)
  assert bf16 < 0.1 and abs(raw - bf16) < 0.03, (raw, bf16)
  assert abs(linen - raw) < 1e-4 and abs(nnx_ - raw) < 1e-4, (raw, linen, nnx_)


def test_the_magnitude_shifted_task_learns_in_fp8_through_autocast():
  # Inputs x 2**-10: fp8 0.107 +- 0.010 (float32 0.110); unscaled fp8 casts learn nothing
  # (2.303 = ln 10: tests/test_fp8.py).
  losses = _trainer(_ALL, BF16, _FP8)(0, 2.0**-10)
  assert max(losses) < 2.0, losses


# ------------------------------------------------------------------------ docs


def test_the_docs_autocast_example_runs_every_matmul_in_fp8():
  doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "fp8.md").read_text()
  block = doc.split("## With autocast", 1)[1]
  namespace = {}
  exec(re.findall(r"```python\n(.*?)```", block, flags=re.S)[0], namespace)  # noqa: S102
  fp8, params, x = namespace["forward8"], namespace["params"], namespace["x"]
  grad = jax.grad(lambda p, x: jnp.sum(fp8(p, x) ** 2), (0, 1))
  _assert_every_dot_is_an_fp8_gemm(_dots(_lowered(grad, params, x)), expected=9)
  head_dots = _operands(_lowered(namespace["with_head"], params, x))
  assert head_dots == [("bf16", "bf16"), ("f8E4M3FN", "f8E4M3FN")]
  assert namespace["logits"].dtype == jnp.float32
