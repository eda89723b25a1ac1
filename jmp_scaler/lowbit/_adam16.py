"""Adam and AdamW with 16-bit moments, and the optimizer a dtype policy calls for.

optax's ``scale_by_adam`` has ``mu_dtype`` but no dtype for the second moment
(optax#1552, maxtext PR#1437). Here both moments are stored in a chosen dtype
(bfloat16 by default), all arithmetic is float32, and the stored moments can
be rounded stochastically: with ``b2 = 0.999`` the relative change of ``nu``
per step (1e-3) is below half a bfloat16 ulp (2e-3), so round-to-nearest
freezes ``nu`` where stochastic rounding follows it on average.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_scaler.lowbit._stochastic import (
  check_seed,
  kahan_summation,
  leaf_specs,
  random_bits,
  step_key,
  stochastic_cast,
  stochastic_round,
)

_STREAM_MU, _STREAM_NU = 1, 2
_MU_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_NU_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
_ROUNDINGS = ("stochastic", "kahan", "nearest")


def _dtype(name: str, value: Any, allowed: tuple[np.dtype, ...], why: str = "") -> np.dtype:
  try:
    d = np.dtype(value)
  except TypeError as e:
    raise ValueError(f"{name} must be one of {[a.name for a in allowed]}, got {value!r}") from e
  if d not in allowed:
    raise ValueError(f"{name} must be one of {[a.name for a in allowed]}, got {value!r}{why}")
  return d


def _rate(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
    raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
  return float(value)


class ScaleByAdamState(NamedTuple):
  """State of :func:`scale_by_adam`: optax's layout, moments in their own dtypes.

  Attributes:
    count: int32, the number of applied steps (saturating).
    mu: first moments, in ``mu_dtype``.
    nu: second moments, in ``nu_dtype``.
  """

  count: jax.Array
  mu: Any
  nu: Any


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    mu_dtype: Any = jnp.bfloat16,
    nu_dtype: Any = jnp.bfloat16,
    stochastic_moments: bool = True,
    seed: int = 0,
    param_specs: Any = None,
) -> optax.GradientTransformation:
  """optax's ``scale_by_adam`` with both moments stored in 16 bits.

  Every step, in float32::

    mu     = b1 * mu + (1 - b1) * g
    nu     = b2 * nu + (1 - b2) * g**2
    u      = (mu / (1 - b1**t)) / (sqrt(nu / (1 - b2**t) + eps_root) + eps)
    store mu in mu_dtype, nu in nu_dtype (stochastically rounded, or to nearest)

  The updates are float32 (the next transformation, e.g.
  :func:`jmp_scaler.stochastic_round`, rounds ``p + u`` once).

  Args:
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the denominator, >= 0.
    eps_root: added inside the square root, >= 0.
    mu_dtype: float32, bfloat16 or float16.
    nu_dtype: float32 or bfloat16. float16 is refused: ``g**2`` of a gradient
      below 2.4e-4 underflows float16's normal range, and the update ``mu /
      (sqrt(nu) + eps)`` then explodes.
    stochastic_moments: round the stored moments stochastically (bits from
      ``seed`` and ``count``); else round to nearest.
    seed: integer in [0, 2**32).
    param_specs: as in :func:`jmp_scaler.stochastic_round` (``shard_map`` only).

  Returns:
    An ``optax.GradientTransformation`` with :class:`ScaleByAdamState`.

  References:
    Kingma and Ba, 2014, Adam (arXiv:1412.6980); Zamirai et al., 2020
    (arXiv:2010.06192).
  """
  b1, b2 = _rate("b1", b1), _rate("b2", b2)
  for name, v in (("eps", eps), ("eps_root", eps_root)):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
      raise ValueError(f"{name} must be a number >= 0, got {v!r}")
  mu_dtype = _dtype("mu_dtype", mu_dtype, _MU_DTYPES)
  nu_dtype = _dtype(
      "nu_dtype", nu_dtype, _NU_DTYPES,
      " (float16 underflows g**2 below 2.4e-4: keep nu in bfloat16 or float32)",
  )  # fmt: skip
  seed = check_seed(seed)

  def init_fn(params):
    def zeros(dtype):
      return lambda p: jnp.zeros(jnp.shape(p), dtype)

    return ScaleByAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(zeros(mu_dtype), params),
        nu=jax.tree.map(zeros(nu_dtype), params),
    )

  def update_fn(updates, state, params=None):
    g_leaves, treedef = jax.tree.flatten(updates)
    mu_leaves = treedef.flatten_up_to(state.mu)
    nu_leaves = treedef.flatten_up_to(state.nu)
    specs = leaf_specs(param_specs, updates)
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.float32)
    c1 = 1 - jnp.float32(b1) ** t
    c2 = 1 - jnp.float32(b2) ** t
    if stochastic_moments:
      k_mu = step_key(seed, _STREAM_MU, state.count)
      k_nu = step_key(seed, _STREAM_NU, state.count)
    out, mus, nus = [], [], []
    for i, (g, mu, nu, spec) in enumerate(zip(g_leaves, mu_leaves, nu_leaves, specs, strict=True)):
      g32 = g.astype(jnp.float32)
      mu32 = b1 * mu.astype(jnp.float32) + (1 - b1) * g32
      nu32 = b2 * nu.astype(jnp.float32) + (1 - b2) * jnp.square(g32)
      out.append((mu32 / c1) / (jnp.sqrt(nu32 / c2 + eps_root) + eps))
      if stochastic_moments:
        mus.append(stochastic_cast(mu32, mu_dtype, random_bits(k_mu, i, g.shape, spec)))
        nus.append(stochastic_cast(nu32, nu_dtype, random_bits(k_nu, i, g.shape, spec)))
      else:
        mus.append(mu32.astype(mu_dtype))
        nus.append(nu32.astype(nu_dtype))
    new = ScaleByAdamState(count, treedef.unflatten(mus), treedef.unflatten(nus))
    return treedef.unflatten(out), new

  return optax.GradientTransformation(init_fn, update_fn)


def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    state_dtype: Any = jnp.bfloat16,
    stochastic_moments: bool = True,
    seed: int = 0,
    param_specs: Any = None,
) -> optax.GradientTransformation:
  """``optax.adam`` with its moments in ``state_dtype`` (bfloat16 by default).

  Same arguments and update as ``optax.adam`` (no ``nesterov``), plus those of
  :func:`scale_by_adam`; ``state_dtype`` sets both moments' dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> tx = adam(1e-3)
    >>> state = tx.init({"w": jnp.ones(3, jnp.bfloat16)})
    >>> state[0].nu["w"].dtype
    dtype(bfloat16)
  """
  return optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype=state_dtype, nu_dtype=state_dtype,
                    stochastic_moments=stochastic_moments, seed=seed, param_specs=param_specs),
      optax.scale_by_learning_rate(learning_rate),
  )


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 1e-4,
    mask: Any = None,
    *,
    state_dtype: Any = jnp.bfloat16,
    stochastic_moments: bool = True,
    seed: int = 0,
    param_specs: Any = None,
) -> optax.GradientTransformation:
  """``optax.adamw`` with its moments in ``state_dtype`` (bfloat16 by default).

  Same arguments and update as ``optax.adamw`` (no ``nesterov``), plus those
  of :func:`scale_by_adam`. Keep the parameters in 16 bits by ending the
  chain with :func:`jmp_scaler.stochastic_round` (or use
  :func:`low_precision_optimizer`)::

    tx = optax.chain(jmp_scaler.adamw(1e-3), jmp_scaler.stochastic_round())

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> tx = adamw(1e-3, weight_decay=0.1)
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> updates, _ = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, tx.init(params), params)
    >>> updates["w"].dtype
    dtype('float32')
  """
  return optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype=state_dtype, nu_dtype=state_dtype,
                    stochastic_moments=stochastic_moments, seed=seed, param_specs=param_specs),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def low_precision_optimizer(
    policy: Any,
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    rounding: str = "stochastic",
    state_dtype: Any = None,
    stochastic_moments: bool = True,
    seed: int = 0,
    param_specs: Any = None,
    skip_nonfinite: bool = True,
    **scaler_kwargs: Any,
) -> optax.GradientTransformation:
  """The AdamW chain a dtype policy calls for, master weights or not.

  * ``policy.param_dtype`` float32: ``optax.chain(head, optax.adamw(...))``,
    the float32-master-weights baseline (16 bytes per parameter with float32
    gradients).
  * 16-bit ``param_dtype`` (``get_policy("p=bf16,c=bf16,o=f32")``):
    ``optax.chain(head, jmp_scaler.adamw(..., state_dtype), rounding)`` with
    the moments in ``state_dtype`` (default bfloat16) and the parameters
    updated by :func:`jmp_scaler.stochastic_round` (``rounding="stochastic"``),
    :func:`jmp_scaler.kahan_summation` (``"kahan"``, +2 bytes per parameter) or
    plain round-to-nearest (``"nearest"``, for comparison: it loses small
    updates). bfloat16 parameters, gradients and moments: 8 bytes per parameter.

  ``head`` is ``policy.loss_scaler(**scaler_kwargs)`` when float16 is involved
  (:func:`jmp_scaler.dynamic_scale`), else :func:`jmp_scaler.no_scale` when
  ``skip_nonfinite`` (a NaN step would otherwise reach the only copy of the
  parameters; with it ``jmp_scaler.TrainState``, ``NNXOptimizer`` and
  ``skip_nonfinite`` skip it exactly, at the cost of one finiteness check),
  else nothing.

  Args:
    policy: a :class:`jmp_scaler.Policy`.
    learning_rate: a float or an Optax schedule.
    b1, b2, eps: Adam's.
    weight_decay: decoupled weight decay (AdamW), >= 0.
    rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``.
    state_dtype: dtype of both moments for 16-bit parameters (default
      bfloat16, also for float16 parameters: float16 ``nu`` is refused).
    stochastic_moments: round the stored moments stochastically.
    seed: seed of every stochastic rounding in the chain.
    param_specs: see :func:`jmp_scaler.stochastic_round` (``shard_map`` only).
    skip_nonfinite: put ``no_scale()`` at the head when no scaler is needed.
    **scaler_kwargs: for ``dynamic_scale`` (float16 policies) or ``no_scale``.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> policy = jmp_scaler.get_policy("p=bf16,c=bf16,o=f32")
    >>> tx = low_precision_optimizer(policy, 1e-3)
    >>> state = tx.init({"w": jnp.ones(3, jnp.bfloat16)})
    >>> [type(s).__name__ for s in state]
    ['LossScaleState', 'ScaleByAdamState', 'EmptyState', 'EmptyState', 'StochasticRoundState']
  """
  if rounding not in _ROUNDINGS:
    raise ValueError(f"rounding must be one of {list(_ROUNDINGS)}, got {rounding!r}")
  if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not (
      weight_decay >= 0
  ):
    raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
  param_dtype = np.dtype(policy.param_dtype)
  head = policy.needs_loss_scaling or skip_nonfinite
  parts = [policy.loss_scaler(**scaler_kwargs)] if head else []
  if jnp.finfo(param_dtype).bits >= 32:
    parts.append(optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay))
    return optax.chain(*parts)
  state_dtype = jnp.bfloat16 if state_dtype is None else state_dtype
  parts += [
      scale_by_adam(b1, b2, eps, mu_dtype=state_dtype, nu_dtype=state_dtype,
                    stochastic_moments=stochastic_moments, seed=seed, param_specs=param_specs),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  ]
  if rounding == "stochastic":
    parts.append(stochastic_round(seed, param_specs=param_specs))
  elif rounding == "kahan":
    parts.append(kahan_summation())
  return optax.chain(*parts)
