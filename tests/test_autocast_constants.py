"""Constants beyond float16's range under autocast: an attention mask of -2.38e38 (tunix's
``K_MASK``) never becomes -inf; a value computed at run time still overflows as it is."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_scaler

K_MASK = -2.3819763e38  # what tunix's Qwen3, Llama3 and Gemma mask attention with
POLICY = "p=f32,c=f16,o=f32"
MASK = np.tril(np.ones((4, 4), bool))
MASK[0] = False  # a fully masked row (a left-padded prompt)
S = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32)
V = jnp.full((4, 2), 1e-3)


def _masked_matmul(s, v, mask):
  """The masked scores feed a float16 matmul: the constant is cast to float16."""
  return jnp.where(mask, s, K_MASK) @ v * 1e-30


def _masked_softmax(s, mask, bias):
  """The masked scores meet a float16 bias before the softmax (an add autocast keeps half)."""
  scores = (jnp.where(mask, s, K_MASK) + bias).astype(jnp.float16)
  return jax.nn.softmax(scores.astype(jnp.float32), axis=-1)


def test_a_mask_constant_that_reaches_a_float16_matmul_is_saturated_not_minus_inf():
  out = jmp_scaler.autocast(_masked_matmul, POLICY)(S, V, MASK)
  assert np.isfinite(np.asarray(out)).all(), out
  # It is -65504 where the mask is false (float16's end), the scores elsewhere.
  hand = (jnp.where(MASK, S, jnp.finfo(jnp.float16).min).astype(jnp.float16)
          @ V.astype(jnp.float16)).astype(jnp.float32) * 1e-30  # fmt: skip
  np.testing.assert_allclose(out, hand, rtol=1e-3)


def test_a_fully_masked_row_stays_the_uniform_softmax_float32_gives():
  bias = jnp.zeros((4, 4), jnp.float16)
  auto = jmp_scaler.autocast(_masked_softmax, POLICY)(S, MASK, bias)
  plain = _masked_softmax(S, MASK, bias)  # the model as written: float16 makes the row NaN
  assert np.isnan(np.asarray(plain[0])).all()
  np.testing.assert_allclose(auto[0], np.full(4, 0.25))
  np.testing.assert_allclose(auto[1:], plain[1:], rtol=1e-3)


def test_values_computed_at_run_time_and_true_infinities_are_cast_as_they_are():
  big = jnp.full((4, 4), 1e6)  # an activation past float16's range: the scaler's to see

  def f(s, mask):  # each element through a float16 matmul of its own (times 1)
    return (jnp.where(mask, s * 1e6, -jnp.inf)[..., None] @ jnp.ones((1, 1)))[..., 0]

  out = np.asarray(jmp_scaler.autocast(f, POLICY)(big, MASK))
  # 1e12 overflows float16 to inf, -inf stays -inf: nothing is clipped at 65504.
  np.testing.assert_array_equal(out, np.where(MASK, np.inf, -np.inf))


def test_a_constant_within_range_adds_nothing_to_the_program():
  def f(s, v, mask):
    return jnp.where(mask, s, -1e4) @ v

  text = str(jax.make_jaxpr(jmp_scaler.autocast(f, POLICY))(S, V, MASK))
  assert text.count("select_n") == 1 and "eq " not in text
  text = str(jax.make_jaxpr(jmp_scaler.autocast(_masked_matmul, POLICY))(S, V, MASK))
  assert text.count("select_n") == 2  # the mask's, and the saturation's


# ---------------------------------------------------------------- without autocast


def _half_model(q, k, mask, baked):
  """A model written in float16 (its own dtype casts), masking with K_MASK."""
  s = jnp.einsum("td,sd->ts", q.astype(jnp.float16), k.astype(jnp.float16))
  fill = jnp.asarray(K_MASK, s.dtype) if baked else K_MASK  # baked: -inf at trace time
  return jnp.sum(jax.nn.softmax(jnp.where(mask, s, fill).astype(jnp.float32), axis=-1))


def test_find_nonfinite_names_the_constant_and_the_fix_in_a_float16_model():
  q = k = jnp.ones((4, 8))
  report = jmp_scaler.find_nonfinite(lambda q, k, m: _half_model(q, k, m, False), q, k, MASK)
  assert report.primitive == "convert_element_type" and report.finite_in_float32
  assert "the scalar of magnitude 2.382e+38" in report.advice
  assert "jnp.finfo(jnp.float16).min (-65504)" in report.advice
  assert "jmp_scaler.autocast, which saturates" in report.advice
  # Converted when traced: the jaxpr holds -inf itself, and no operation makes it.
  with np.errstate(over="ignore"):
    baked = lambda q, k, m: _half_model(q, k, m, True)  # noqa: E731
    with pytest.raises(ValueError, match=r"the constant -inf \(float16\) of the _where call at "
                       r".*test_autocast_constants.py:\d+ .*jnp.finfo\(jnp.float16\).min"):
      jmp_scaler.find_nonfinite(baked, q, k, MASK)


def _attention_weights(q, k, mask):
  """A float32 model's masked softmax, as written (Flax's and this repo's benchmarks)."""
  s = jnp.einsum("qd,kd->qk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
  s = jnp.where(mask, s, jnp.finfo(s.dtype).min)  # a float32 fill: finfo(float32).min
  return jax.nn.softmax(s, axis=-1)


@pytest.mark.parametrize("half", ["bf16", "f16"])
def test_a_masks_fill_keeps_the_scores_half_and_is_saturated_not_minus_inf(half):
  """The scores' scaling and mask stay in the compute dtype (the softmax widens its input
  itself; a scalar fill does not widen the scores, as masked_fill fills in the scores' dtype),
  so no score-sized float32 value is stored before the softmax; float32's lowest number is
  float16's -65504 (bfloat16's lowest), not -inf: the fully masked row is uniform, not NaN."""
  rng = np.random.default_rng(1)
  q, k = (jnp.asarray(rng.normal(size=(4, 8)), jnp.float32) for _ in range(2))
  f = jmp_scaler.autocast(_attention_weights, f"p=f32,c={half},o=f32")
  jaxpr = jax.make_jaxpr(f)(q, k, MASK).eqns[0].params["jaxpr"].jaxpr
  dtype = jnp.dtype(jnp.float16 if half == "f16" else jnp.bfloat16)
  # Every (4, 4) value before the softmax (the last equation, float32 inside) is half.
  shaped = [(e.primitive.name, v.aval.dtype) for e in jaxpr.eqns for v in e.outvars
            if v.aval.shape == (4, 4) and jnp.issubdtype(v.aval.dtype, jnp.floating)]
  assert [d for _, d in shaped[:-1]] == [dtype] * (len(shaped) - 1), shaped
  assert [n for n, _ in shaped[:-1]] == ["dot_general", "div", "jit"], shaped  # the where
  assert shaped[-1][1] == jnp.float32  # the softmax's result, float32 as torch's
  out = np.asarray(f(q, k, MASK))
  np.testing.assert_array_equal(out[0], np.full(4, 0.25, np.float32))  # uniform, not NaN
  np.testing.assert_allclose(out, _attention_weights(q, k, MASK), atol=2e-2)
  grads = jax.grad(lambda q: f(q, k, MASK)[1:, 0].sum())(q)
  assert np.isfinite(np.asarray(grads)).all()


def test_a_fill_computed_at_run_time_that_is_infinite_stays_infinite():
  """Saturation is for finite fills beyond the half dtype's range: a -inf fill is kept."""
  f = jmp_scaler.autocast(lambda s, m, c: jnp.where(m, s, c), "p=f32,c=f16,o=f32")
  s16 = S.astype(jnp.float16)
  out = np.asarray(f(s16, MASK, jnp.float32(-jnp.inf) * jnp.ones(())))
  assert np.isneginf(out[0]).all() and np.isfinite(out[1:][MASK[1:]]).all()
