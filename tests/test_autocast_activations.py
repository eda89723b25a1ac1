"""autocast keeps activations between matmuls in the compute dtype, as torch.autocast does:
an activation function is one op (its input's dtype, float32 arithmetic inside, only its
input saved for the backward pass), a Dense/Conv bias is added in the matmul's dtype, and a
0-d value does not widen a tensor. What needs float32 keeps it."""

import collections
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_scaler
from tests.test_autocast_fn import eqns

try:
  from jax.ad_checkpoint import saved_residuals
except ImportError:  # jax 0.10.2 keeps it in _src
  from jax._src.ad_checkpoint import saved_residuals

F16 = "p=f32,c=f16,o=f32"
BF16 = "p=f32,c=bf16,o=f32"
_RNG = np.random.default_rng(0)
X16 = jnp.asarray(_RNG.normal(size=(4, 64)) * 3, jnp.float16)
W = jnp.asarray(_RNG.normal(size=(64, 64)) / 8, jnp.float32)
B = jnp.asarray(_RNG.normal(size=(64,)), jnp.float32)
ACTIVATIONS = {
  "gelu": jax.nn.gelu, "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
  "silu": jax.nn.silu, "elu": jax.nn.elu, "leaky_relu": jax.nn.leaky_relu,
  "mish": jax.nn.mish, "selu": jax.nn.selu,
  "hard_silu": jax.nn.hard_silu, "flax_gelu": nn.gelu, "nnx_silu": nnx.silu,
}
# Piecewise linear: decided primitive by primitive, in the input's dtype, no jax.checkpoint.
PIECEWISE_LINEAR = {
  "relu": jax.nn.relu, "relu6": jax.nn.relu6, "hard_tanh": jax.nn.hard_tanh,
  "flax_relu": nn.relu,
}


def _saved(fn, *args):
  """dtype -> bytes of what jax.vjp keeps of ``fn`` (the arguments left out)."""
  found = collections.Counter()
  for aval, where in saved_residuals(fn, *args):
    if "from the argument" not in where:
      found[str(aval.dtype)] += int(np.prod(aval.shape)) * aval.dtype.itemsize
  return found


def _out_dtypes(fn, *args):
  return [str(e.outvars[0].aval.dtype) for e in eqns(jax.make_jaxpr(fn)(*args))
          if e.outvars and e.primitive.name not in ("convert_element_type",)]


X32 = X16.astype(jnp.float32)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_an_activation_is_one_op_in_its_inputs_dtype_computed_in_float32(name):
  """float32 code: the activation of a float16 matmul's result is float16, the float32
  function of that float16 value rounded once (torch's float16 kernels compute so)."""
  act = ACTIVATIONS[name]
  matmul = jmp_scaler.autocast(lambda w, x: x @ w, "p=f32,c=f16,o=f16")(W, X32)
  inner = jmp_scaler.autocast(lambda w, x: act(x @ w), "p=f32,c=f16,o=f16")(W, X32)
  assert matmul.dtype == inner.dtype == jnp.float16
  want = act(matmul.astype(jnp.float32))  # within float16's rounding (XLA's fused tanh, exp
  np.testing.assert_allclose(inner.astype(jnp.float32), want, rtol=2**-10, atol=2**-14)  # differ)
  f = jmp_scaler.autocast(lambda w, x: act(x @ w) * 2, "p=f32,c=f16,o=f16")
  jaxpr = jax.make_jaxpr(f)(W, X32)
  remat = [e for e in eqns(jaxpr) if e.primitive.name in ("remat2", "checkpoint")]
  # one op, recomputed in the backward pass: one checkpoint per platform branch (TPU's open to
  # CSE, the others' behind the barrier), both reading (and keeping) the half input
  assert [e.params["prevent_cse"] for e in remat] == [False, True]
  for op in remat:
    body = [e for e in eqns(op.params["jaxpr"]) if e.primitive.name != "convert_element_type"]
    floats = [v.aval.dtype for e in body for v in e.outvars if jnp.issubdtype(v.aval.dtype,
                                                                             jnp.floating)]
    assert floats and set(floats) == {jnp.dtype(jnp.float32)}
    assert [v.aval.dtype for v in op.invars] == [jnp.float16]
  muls = [e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "mul"]
  assert muls[-1].outvars[0].aval.dtype == jnp.float16  # the next op reads a half value


@pytest.mark.parametrize("name", PIECEWISE_LINEAR)
def test_a_piecewise_linear_activation_runs_in_its_inputs_dtype_without_remat(name):
  """relu and its kin: every op in the input's dtype, no jax.checkpoint (which would keep XLA
  from fusing them into the matmul), the result that of float32 rounded once, and the backward
  keeps half-precision values only."""
  act = PIECEWISE_LINEAR[name]
  f = jmp_scaler.autocast(lambda w, x: act(x @ w), "p=f32,c=f16,o=f16")
  jaxpr = jax.make_jaxpr(f)(W, X32)
  assert not [e for e in eqns(jaxpr) if e.primitive.name in ("remat2", "checkpoint")]
  inner = jaxpr.eqns[0].params["jaxpr"]
  floats = {v.aval.dtype for e in eqns(inner) for v in e.outvars  # but a clip's bounds,
            if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.shape == (4, 64)
            and e.primitive.name != "broadcast_in_dim"}  # scalars broadcast (XLA folds them)
  assert floats == {jnp.dtype(jnp.float16)}, floats
  matmul = jmp_scaler.autocast(lambda w, x: x @ w, "p=f32,c=f16,o=f16")(W, X32)
  want = act(matmul.astype(jnp.float32)).astype(jnp.float16)  # float32, rounded once
  np.testing.assert_array_equal(f(W, X32), want)
  saved = _saved(lambda w: f(w, X32).astype(jnp.float32).sum(), W)
  assert set(saved) <= {"float16", "bool"}, saved


@pytest.mark.parametrize("name", ["gelu", "silu", "mish"])
def test_the_backward_keeps_only_the_half_input_and_recomputes_in_float32(name):
  act = ACTIVATIONS[name]
  def loss(w, x):  # an MLP's hidden layer: matmul, activation, matmul
    return jnp.sum(act(x @ w) @ w)
  ours = _saved(jmp_scaler.autocast(loss, F16), W, X32)
  # Decided primitive by primitive (the rule 'primitives'), float32 intermediates are kept.
  split = jmp_scaler.autocast(loss, F16, rules={name: "primitives"})
  assert ours.get("float32", 0) == 0 and _saved(split, W, X32).get("float32", 0) > 0
  # Both matmuls' float16 operands (x, w, the activation's input and its output): no more.
  assert ours["float16"] == 2 * (X32.size + W.size + 2 * X32.size)
  # The input's cotangent: float32's derivative at the float16 input, rounded to float16.
  h = jmp_scaler.autocast(lambda w, x: x @ w, "p=f32,c=f16,o=f16")(W, X32)
  g = jax.grad(lambda y: jnp.sum(jmp_scaler.autocast(
    lambda y: act(y) * 1, "p=f32,c=f16,o=f16")(y).astype(jnp.float32)))(h)
  want = jax.grad(lambda y: jnp.sum(act(y)))(h.astype(jnp.float32))
  assert g.dtype == jnp.float16
  np.testing.assert_allclose(g.astype(jnp.float32), want, rtol=2**-10, atol=2**-14)


@pytest.mark.parametrize("platform,barriers", [("tpu", 0), ("cuda", 1), ("cpu", 1)])
def test_the_platform_lowered_for_decides_the_recomputations_cse_barrier(platform, barriers):
  """A composite's recomputation is open to CSE on TPU (XLA:TPU fuses it into the matmuls
  around it, as hand-annotated code) and behind jax.checkpoint's barrier elsewhere (XLA:GPU
  would keep its float32 intermediates alive): by the platform the step is lowered for, not
  the host's backend (this host lowers for all three)."""
  f = jmp_scaler.autocast(lambda w, x: jnp.sum(jax.nn.gelu(x @ w) @ w), F16)
  step = jax.jit(jax.grad(f))
  text = step.trace(W, X32).lower(lowering_platforms=(platform,)).as_text()
  assert text.count("optimization_barrier") == barriers
  exported = jax.export.export(step, platforms=("tpu", "cuda"))(W, X32)
  assert exported.mlir_module().count("optimization_barrier") == 1  # cuda's, in its branch


def _dense(x, w, b):
  return x @ w + b  # a Dense layer: matmul, broadcast bias


def test_a_bias_is_added_in_the_matmuls_dtype_and_its_gradient_summed_in_float32():
  f = jmp_scaler.autocast(lambda w, b, x: jax.nn.gelu(_dense(x, w, b)), "p=f32,c=f16,o=f16")
  jaxpr = jax.make_jaxpr(f)(W, B, X16)
  adds = [e for e in eqns(jaxpr) if e.primitive.name == "add" and e.outvars[0].aval.ndim == 2]
  assert adds and all(e.outvars[0].aval.dtype == jnp.float16 for e in adds[:1])
  matmul = jmp_scaler.autocast(lambda w, x: x @ w, "p=f32,c=f16,o=f16")(W, X16)
  ref = matmul + B.astype(jnp.float16)  # the add in float16
  np.testing.assert_allclose(f(W, B, X16).astype(jnp.float32),
                             jax.nn.gelu(ref.astype(jnp.float32)), rtol=2**-10, atol=2**-14)
  # The bias's gradient: the float16 cotangents of the add, summed over the batch in float32.
  grad_b = jax.grad(lambda b: jnp.sum(f(W, b, X16).astype(jnp.float32)))
  gb = grad_b(B)
  act = jmp_scaler.autocast(jax.nn.gelu, "p=f32,c=f16,o=f16")
  ct = jax.grad(lambda y: jnp.sum(act(y).astype(jnp.float32)))(ref)
  assert gb.dtype == jnp.float32 and ct.dtype == jnp.float16
  np.testing.assert_allclose(gb, jnp.sum(ct.astype(jnp.float32), 0), rtol=2**-9)
  sums = [e for e in eqns(jax.make_jaxpr(grad_b)(B)) if e.primitive.name == "reduce_sum"
          and e.outvars[0].aval.shape == B.shape]
  assert sums and all(e.invars[0].aval.dtype == jnp.float32 for e in sums)


def test_flax_dense_and_conv_biases_stay_half():
  for layer, x in ((nn.Dense(8), jnp.ones((2, 4))), (nn.Conv(8, (3, 3)), jnp.ones((1, 5, 5, 2)))):
    params = layer.init(jax.random.key(0), x)
    out = jmp_scaler.autocast(layer.apply, "p=f32,c=f16,o=f16")
    adds = [e for e in eqns(jax.make_jaxpr(out)(params, x)) if e.primitive.name == "add"]
    assert [e.outvars[0].aval.dtype for e in adds] == [jnp.float16]
    grads = jax.grad(lambda p, out=out, x=x: jnp.sum(out(p, x).astype(jnp.float32)))(params)
    assert grads["params"]["bias"].dtype == jnp.float32
    # The bias's gradient: the float16 cotangents (all ones) summed in float32.
    np.testing.assert_array_equal(grads["params"]["bias"], np.full(8, x.size / x.shape[-1]))


def test_a_rank2_mask_is_not_a_bias_and_keeps_float32():
  """An attention mask added to scores (rank 2 broadcast): not a bias. Added in float16 its
  -1e9 would be -inf, and a fully masked row NaN; it promotes, as in PyTorch."""
  mask = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), 0.0, -1e9).astype(jnp.float32)
  q = jnp.asarray(_RNG.normal(size=(2, 4, 8)), jnp.float32)
  def scores(q):
    return jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, q) + mask, axis=-1)
  f = jmp_scaler.autocast(scores, F16)
  adds = [e for e in eqns(jax.make_jaxpr(f)(q)) if e.primitive.name == "add"]
  assert adds[0].outvars[0].aval.dtype == jnp.float32
  assert bool(jnp.isfinite(f(q)).all())


def test_a_zero_dim_value_does_not_widen_a_tensor_as_in_pytorch():
  scale = jnp.float32(8.0)  # jnp.sqrt(d) in attention: a 0-d float32 array, not weak
  f = jmp_scaler.autocast(lambda w, x: (x @ w) / jnp.sqrt(scale) * scale, "p=f32,c=f16,o=f16")
  ops = [e for e in eqns(jax.make_jaxpr(f)(W, X32)) if e.primitive.name in ("div", "mul")]
  assert [e.outvars[0].aval.dtype for e in ops] == [jnp.float16] * 2
  both = jmp_scaler.autocast(lambda a, b: a * b, "p=f32,c=f16,o=f32")
  jaxpr = jax.make_jaxpr(both)(jnp.float16(2), jnp.float32(3))
  assert [e for e in eqns(jaxpr) if e.primitive.name == "mul"][0].outvars[0].aval.dtype == (
    jnp.float32)  # two 0-d values: the widest, as PyTorch's two zero-dim tensors


def test_results_that_feed_float32_ops_are_float32_and_norms_keep_their_statistics():
  # gelu's result only summed (reduce_sum is float32): it runs in float32 (the loss's case).
  f = jmp_scaler.autocast(lambda x: jnp.sum(jax.nn.gelu(x)), F16)
  gelus = [e for e in eqns(jax.make_jaxpr(f)(X16)) if e.primitive.name == "tanh"]
  assert gelus and all(e.outvars[0].aval.dtype == jnp.float32 for e in gelus)
  ln = nn.LayerNorm()
  params = ln.init(jax.random.key(0), X16.astype(jnp.float32))
  g = jmp_scaler.autocast(lambda p, x: jax.nn.gelu(ln.apply(p, x)), "p=f32,c=f16,o=f16")
  reductions = [e for e in eqns(jax.make_jaxpr(g)(params, X16))
                if e.primitive.name in ("reduce_sum", "rsqrt", "integer_pow")]
  assert reductions and all(e.outvars[0].aval.dtype == jnp.float32 for e in reductions)


def test_rules_name_an_activation_of_your_own_and_switch_one_off():
  @jax.jit
  def my_act(x):
    return x * jax.nn.sigmoid(1.702 * x)  # logistic: float32 if decided alone
  def last_mul(**kw):
    f = jmp_scaler.autocast(lambda w, x: my_act(x @ w) * 2, "p=f32,c=f16,o=f16", **kw)
    muls = [e for e in eqns(jax.make_jaxpr(f)(W, X32)) if e.primitive.name == "mul"]
    return muls[-1].outvars[0].aval.dtype
  assert last_mul(rules={"my_act": "activation"}) == jnp.float16
  assert last_mul() == jnp.float32  # without the rule: primitive by primitive
  whole32 = jmp_scaler.autocast(lambda x: jax.nn.gelu(x) * 2, "p=f32,c=f16,o=f32",
                                rules={"gelu": "float32"})
  muls = [e for e in eqns(jax.make_jaxpr(whole32)(X16)) if e.primitive.name == "mul"]
  assert muls[-1].outvars[0].aval.dtype == jnp.float32


def test_a_misspelt_activation_name_warns_and_bad_rules_are_refused():
  f = jmp_scaler.autocast(lambda x: jax.nn.gelu(x), F16, rules={"my_actt": "activation"})
  with pytest.warns(UserWarning, match=r"\['my_actt' \('activation'\)\].*check the spelling"):
    f(X16)
  # "primitives" switches a composite off: whether the function is called or not, nothing is
  # misspelt (it warned that gelu, called, was not, and named the rule 'activation')
  for rules in ({"gelu": "primitives"}, {"silu": "primitives"}):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      jmp_scaler.autocast(lambda x: jax.nn.gelu(x), F16, rules=rules)(X16)
  with pytest.raises(ValueError, match="names a function"):
    jmp_scaler.autocast(jnp.sin, F16, rules={"gelu": "promote"})
  with pytest.raises(ValueError, match="applies to functions"):
    jmp_scaler.autocast(jnp.sin, F16, rules={"exp": "activation"})
  with pytest.raises(ValueError, match="unknown primitive 'tanhh'"):
    jmp_scaler.autocast(jnp.sin, F16, rules={"tanhh": "float32"})
  assert jmp_scaler.DEFAULT_RULES["gelu"] == "activation"


@pytest.mark.parametrize("policy", [F16, BF16])
def test_a_gpt_block_saves_less_than_its_hand_annotation(policy):
  """The MLP of a GPT block (Dense, gelu, Dense) and its attention, as Flax users write it:
  autocast's saved bytes are at most the hand-annotated model's."""
  half = jnp.float16 if policy == F16 else jnp.bfloat16

  class Block(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm(dtype=self.dtype)(x)
      a = nn.MultiHeadDotProductAttention(2, dtype=self.dtype, force_fp32_for_softmax=True)(h)
      x = x + a
      h = nn.gelu(nn.Dense(64, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x)))
      return x + nn.Dense(16, dtype=self.dtype)(h)

  x = jnp.asarray(_RNG.normal(size=(2, 8, 16)), jnp.float32)
  params = Block().init(jax.random.key(0), x)
  loss = lambda apply: lambda p: jnp.mean(apply(p, x).astype(jnp.float32) ** 2)  # noqa: E731
  hand = sum(_saved(loss(Block(dtype=half).apply), params).values())
  ours = sum(_saved(loss(jmp_scaler.autocast(Block().apply, policy)), params).values())
  full = sum(_saved(loss(Block().apply), params).values())
  assert ours <= hand < full, (ours, hand, full)


def test_autocast_and_hand_float16_train_a_small_lm_alike():
  """A 2-layer LM (embedding, pre-LN blocks with gelu MLPs, tied head) trained 25 steps in
  float16 by hand annotation and under autocast: the losses agree within noise."""

  class LM(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, t):
      embed = nn.Embed(32, 32, dtype=self.dtype)
      x = embed(t)
      for _ in range(2):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.SelfAttention(2, dtype=self.dtype, force_fp32_for_softmax=True)(
          h, mask=nn.make_causal_mask(t))
        h = nn.gelu(nn.Dense(64, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x)))
        x = x + nn.Dense(32, dtype=self.dtype)(h)
      return embed.attend(nn.LayerNorm(dtype=self.dtype)(x)).astype(jnp.float32)

  tokens = jnp.asarray(np.tile(np.arange(16) % 7, (8, 1)), jnp.int32)
  params = LM().init(jax.random.key(0), tokens)["params"]

  def train(apply):
    tx = optax.chain(jmp_scaler.dynamic_scale(2.0**10), optax.adam(1e-2))
    state = jmp_scaler.TrainState.create(apply_fn=apply, params=params, tx=tx)

    @jax.jit
    def step(state):
      def loss(p):
        logits = state.apply_fn({"params": p}, tokens)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      value, grads = jmp_scaler.value_and_grad(loss, state)(state.params)
      return state.apply_gradients(grads=grads), value
    losses = []
    for _ in range(25):
      state, value = step(state)
      losses.append(float(value))
    return np.asarray(losses), int(state.scale_metrics()["total_skips"])

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hand, hand_skips = train(LM(dtype=jnp.float16).apply)
    ours, our_skips = train(jmp_scaler.autocast(LM().apply, F16))
  assert hand[-5:].mean() < 0.2 * hand[0] and ours[-5:].mean() < 0.2 * ours[0]
  np.testing.assert_allclose(ours[-5:].mean(), hand[-5:].mean(), rtol=0.15)
  assert our_skips <= 2 and hand_skips <= 2
