"""How far the sampler's log-probabilities are from the trainer's: the RL mismatch, measured.

In RL fine-tuning the policy gradient weighs each sampled token by the probability ratio of
the trainer's forward pass to the sampler's (rollout, KV-cache decode). Both run the same
weights, so the ratio should be 1; half-precision rounding makes the two paths disagree, and
the disagreement biases the gradient (Qi et al., 2025, "Defeating the Training-Inference
Mismatch via FP16", arXiv:2510.26788: bfloat16's 8-bit mantissa makes it large, float16's
11 bits mostly remove it). :func:`logprob_parity` reports what practitioners track, as a
pytree of scalars that can leave a jitted step as metrics.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

#: The bands of the probability ratio: a token is out of band when ``|ratio - 1| > band``.
BANDS = (0.001, 0.01, 0.05, 0.1)
_BAND_NAMES = ("0.1%", "1%", "5%", "10%")


class LogprobParity(struct.PyTreeNode):
  """What :func:`logprob_parity` measured: float32 scalars (int32 counts), jittable.

  ``dlogp`` is the trainer's log-probability minus the sampler's, per token; the
  probability ratio is ``exp(dlogp)`` (the importance weight of the policy gradient,
  1 when the two agree).

  Attributes:
    tokens: tokens counted (the mask's).
    sequences: sequences with at least one counted token.
    mean_abs_dlogp, max_abs_dlogp: ``|dlogp|`` over the tokens.
    outside: share of tokens whose ratio lies outside ``1 +- band`` for each of
      :data:`BANDS` (0.1%, 1%, 5%, 10%: the last is ``[0.9, 1.1]``), a float32 vector.
    k1, k3: per-token estimates of ``KL(sampler || trainer)`` from the sampled tokens,
      averaged over tokens: ``k1 = -dlogp``, ``k3 = (ratio - 1) - dlogp`` (Schulman's
      estimators; ``k3`` is never negative).
    seq_k1, seq_k3: the same per sequence (``k1`` summed over a sequence's tokens; ``k3`` of
      the sequence's ratio), averaged over sequences.
    mean_abs_seq_dlogp, max_abs_seq_dlogp: the sequence-level log-ratio ``sum(dlogp)``.
  """

  tokens: jax.Array
  sequences: jax.Array
  mean_abs_dlogp: jax.Array
  max_abs_dlogp: jax.Array
  outside: jax.Array
  k1: jax.Array
  k3: jax.Array
  seq_k1: jax.Array
  seq_k3: jax.Array
  mean_abs_seq_dlogp: jax.Array
  max_abs_seq_dlogp: jax.Array

  def to_dict(self, prefix: str = "parity") -> dict[str, float | int]:
    """Host-side Python numbers, one key per figure (``parity/outside_1%``...), for a metric
    writer (:func:`jmp_scaler.to_scalars` calls it on a report among the metrics)."""
    host = jax.device_get(self)
    prefix = f"{prefix}/" if prefix else ""
    out: dict[str, float | int] = {}
    for name in self.__dataclass_fields__:
      value = np.asarray(getattr(host, name))
      if name == "outside":
        bands = zip(_BAND_NAMES, value, strict=True)
        out.update({f"{prefix}outside_{b}": float(v) for b, v in bands})
      elif name in ("tokens", "sequences"):
        out[f"{prefix}{name}"] = int(value)
      else:
        out[f"{prefix}{name}"] = float(value)
    return out

  def __str__(self) -> str:
    d = self.to_dict("")
    bands = "  ".join(f"{b} {100 * d[f'outside_{b}']:.2f}%" for b in _BAND_NAMES)
    return "\n".join([
        f"sampler vs trainer over {d['tokens']} tokens in {d['sequences']} sequences",
        f"  |dlogp|        mean {d['mean_abs_dlogp']:.3e}  max {d['max_abs_dlogp']:.3e}",
        f"  ratio outside  {bands}",
        f"  KL per token   k1 {d['k1']:.3e}  k3 {d['k3']:.3e}",
        f"  KL per seq     k1 {d['seq_k1']:.3e}  k3 {d['seq_k3']:.3e}",
        f"  seq |log-ratio| mean {d['mean_abs_seq_dlogp']:.3e}  max "
        f"{d['max_abs_seq_dlogp']:.3e}",
    ])


def logprob_parity(
    sampler_logprobs: Any, trainer_logprobs: Any, mask: Any = None
) -> LogprobParity:
  """The mismatch between the sampler's and the trainer's log-probabilities of the same tokens.

  Jittable, no host sync: call it inside the train step and log the report with the other
  metrics (``jmp_scaler.to_scalars({"parity": report, ...})``), or print it on the host::

    report = jmp_scaler.logprob_parity(old_logprobs, new_logprobs, completion_mask)
    print(report)

  Everything is computed in float32, whatever the inputs' dtype.

  Args:
    sampler_logprobs: the log-probabilities of the sampled tokens as the sampler computed
      them (rollout, KV-cache decode), ``[batch, tokens]``.
    trainer_logprobs: the same tokens' log-probabilities from the trainer's forward pass,
      with the same weights, same shape.
    mask: which tokens count (the completion tokens, not the prompt and padding), same
      shape, boolean or 0/1; ``None`` counts every token.

  Returns:
    A :class:`LogprobParity`.

  Raises:
    ValueError: naming the argument, for shapes that differ or are not ``[batch, tokens]``,
      or inputs that are not floating.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> sampler = jnp.log(jnp.array([[0.5, 0.25, 0.9]]))
    >>> trainer = jnp.log(jnp.array([[0.5, 0.2515, 0.8]]))     # the third is masked out
    >>> report = jmp_scaler.logprob_parity(sampler, trainer, jnp.array([[1, 1, 0]]))
    >>> int(report.tokens), report.outside.tolist()             # ratio 1.006: out of 0.1%
    (2, [0.5, 0.0, 0.0, 0.0])
  """
  s = _as_logprobs("sampler_logprobs", sampler_logprobs)
  t = _as_logprobs("trainer_logprobs", trainer_logprobs)
  if s.shape != t.shape:
    raise ValueError(
        f"sampler_logprobs and trainer_logprobs must have one shape, got {s.shape} and "
        f"{t.shape}")
  if mask is None:
    m = jnp.ones(s.shape, jnp.float32)
  else:
    if jnp.shape(mask) != s.shape:
      raise ValueError(f"mask must have the log-probabilities' shape {s.shape}, got "
                       f"{jnp.shape(mask)}")
    m = (jnp.asarray(mask) != 0).astype(jnp.float32)
  d = jnp.where(m > 0, t - s, 0.0)  # masked tokens (padding may hold -inf) count nothing
  ratio = jnp.exp(d)
  n = jnp.sum(m)
  per = lambda x: jnp.sum(x * m) / jnp.maximum(n, 1.0)  # noqa: E731
  k3 = (ratio - 1.0) - d
  seq_tokens = jnp.sum(m, axis=1)
  has = (seq_tokens > 0).astype(jnp.float32)
  n_seq = jnp.sum(has)
  per_seq = lambda x: jnp.sum(x * has) / jnp.maximum(n_seq, 1.0)  # noqa: E731
  seq_d = jnp.sum(d, axis=1)
  outside = jnp.stack([per((jnp.abs(ratio - 1.0) > band).astype(jnp.float32))
                       for band in BANDS])  # fmt: skip
  return LogprobParity(
      tokens=n.astype(jnp.int32),
      sequences=n_seq.astype(jnp.int32),
      mean_abs_dlogp=per(jnp.abs(d)),
      max_abs_dlogp=jnp.max(jnp.abs(d) * m),
      outside=outside,
      k1=per(-d),
      k3=per(k3),
      seq_k1=per_seq(-seq_d),
      seq_k3=per_seq(jnp.expm1(seq_d) - seq_d),
      mean_abs_seq_dlogp=per_seq(jnp.abs(seq_d)),
      max_abs_seq_dlogp=jnp.max(jnp.abs(seq_d) * has),
  )


def _as_logprobs(name: str, x: Any) -> jax.Array:
  a = jnp.asarray(x)
  if a.ndim != 2:
    raise ValueError(f"{name} must be [batch, tokens], got shape {a.shape}")
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating log-probabilities, got dtype {a.dtype}")
  return a.astype(jnp.float32)
