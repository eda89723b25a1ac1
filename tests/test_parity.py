"""jmp_scaler.logprob_parity: the sampler-trainer mismatch against a float64 NumPy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_scaler

RNG = np.random.default_rng(0)
SAMPLER = np.log(RNG.uniform(0.01, 1.0, (5, 12))).astype(np.float32)
NOISE = RNG.normal(0.0, 0.02, (5, 12)).astype(np.float32)
TRAINER = SAMPLER + NOISE
MASK = (RNG.uniform(size=(5, 12)) > 0.3).astype(np.int32)
MASK[4] = 0  # a sequence with no completion token: counted nowhere


def _oracle(s, t, m):
  s, t, m = (np.asarray(a, np.float64) for a in (s, t, m))
  d = (t - s)[m > 0]
  ratio = np.exp(d)
  seqs = [(t - s)[i][m[i] > 0] for i in range(len(m)) if m[i].any()]
  seq_d = np.array([x.sum() for x in seqs])
  return {
      "tokens": len(d), "sequences": len(seqs),
      "mean_abs_dlogp": np.abs(d).mean(), "max_abs_dlogp": np.abs(d).max(),
      "outside": [np.mean(np.abs(ratio - 1) > b) for b in (0.001, 0.01, 0.05, 0.1)],
      "k1": np.mean(-d), "k3": np.mean(ratio - 1 - d),
      "seq_k1": np.mean(-seq_d), "seq_k3": np.mean(np.expm1(seq_d) - seq_d),
      "mean_abs_seq_dlogp": np.abs(seq_d).mean(), "max_abs_seq_dlogp": np.abs(seq_d).max(),
  }


def test_every_figure_matches_the_oracle_inside_jit_without_a_host_transfer():
  step = jax.jit(jmp_scaler.logprob_parity)
  args = [jnp.asarray(a) for a in (SAMPLER, TRAINER, MASK)]
  with jax.transfer_guard("disallow"):
    report = step(*args)
  want = _oracle(SAMPLER, TRAINER, MASK)
  for name, value in want.items():
    np.testing.assert_allclose(np.asarray(getattr(report, name)), value, rtol=2e-4,
                               atol=1e-7, err_msg=name)  # fmt: skip
  assert float(report.k3) >= 0 and float(report.seq_k3) >= 0


def test_padding_that_holds_minus_inf_counts_nothing_and_bfloat16_is_read_in_float32():
  s = SAMPLER.copy()
  t = TRAINER.copy()
  s[MASK == 0] = -np.inf  # what a sampler writes for pad tokens
  report = jmp_scaler.logprob_parity(jnp.asarray(s, jnp.bfloat16), jnp.asarray(t), MASK)
  d = report.to_dict()
  assert all(np.isfinite(v) for v in d.values()), d
  assert d["parity/tokens"] == int(MASK.sum()) and d["parity/sequences"] == 4


def test_identical_logprobs_report_no_mismatch_and_print_a_table():
  report = jmp_scaler.logprob_parity(SAMPLER, SAMPLER)
  assert report.to_dict("") == {
      "tokens": 60, "sequences": 5, "mean_abs_dlogp": 0.0, "max_abs_dlogp": 0.0,
      "outside_0.1%": 0.0, "outside_1%": 0.0, "outside_5%": 0.0, "outside_10%": 0.0,
      "k1": 0.0, "k3": 0.0, "seq_k1": 0.0, "seq_k3": 0.0, "mean_abs_seq_dlogp": 0.0,
      "max_abs_seq_dlogp": 0.0}
  text = str(report)
  assert "over 60 tokens in 5 sequences" in text and "1% 0.00%" in text
  scalars = jmp_scaler.to_scalars({"rl": report})
  assert scalars["rl/outside_10%"] == 0.0 and scalars["rl/tokens"] == 60


@pytest.mark.parametrize("args, match", [
    ((SAMPLER, SAMPLER[:, :3]), r"one shape, got \(5, 12\) and \(5, 3\)"),
    ((SAMPLER[0], SAMPLER[0]), r"sampler_logprobs must be \[batch, tokens\], got shape \(12,\)"),
    ((SAMPLER, SAMPLER, MASK[:, :2]), r"mask must have the log-probabilities' shape"),
    ((SAMPLER, MASK), "trainer_logprobs must be floating log-probabilities, got dtype int32"),
])
def test_bad_inputs_name_the_argument(args, match):
  with pytest.raises(ValueError, match=match):
    jmp_scaler.logprob_parity(*args)
