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
