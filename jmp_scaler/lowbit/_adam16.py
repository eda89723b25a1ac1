"""Adam and AdamW with 16-bit moments, and the optimizer a dtype policy calls for.

optax's ``scale_by_adam`` has ``mu_dtype`` but no dtype for the second moment
(optax#1552, maxtext PR#1437). Here both moments are stored in a chosen dtype
(at least float32 unless asked: the names are optax's, and swapping ``optax.adam``
for ``jmp_scaler.adam`` must not lower the optimizer state's precision behind the
user's back; ``low_precision_optimizer``, whose name says it, stores bfloat16),
the arithmetic is optax's own (its ``update_moment`` and ``bias_correction``, in
its order) in float32, and the stored moments can
be rounded stochastically: with ``b2 = 0.999`` the relative change of ``nu``
per step (1e-3) is below half a bfloat16 ulp (2e-3), so round-to-nearest
freezes ``nu`` where stochastic rounding follows it on average. With float32
gradients and moments the result is optax's, bit for bit, under ``jax.jit``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_scaler._leaves import math_dtype
from jmp_scaler.lowbit._stochastic import (
  check_seed,
  is_low_precision,
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
_NU_F16 = " (float16 underflows g**2 below 2.4e-4: keep nu in bfloat16 or float32)"


class _StateDtype:
  """The default of ``adam``'s ``mu_dtype`` and ``nu_dtype``: ``state_dtype``."""

  def __repr__(self) -> str:
    return "state_dtype"


class _AtLeastFloat32:
  """The default moment dtype: float32, or the parameter's dtype where it is wider or complex
  (float64, complex64): a moment never holds less than float32 unless a dtype is asked for."""

  def __repr__(self) -> str:
    return "float32 or wider"


_FROM_STATE_DTYPE = _StateDtype()
AT_LEAST_FLOAT32 = _AtLeastFloat32()


def _dtype(name: str, value: Any, allowed: tuple[np.dtype, ...], why: str = "") -> Any:
  """``value`` as an allowed dtype, ``None`` (each parameter's dtype, optax's rule) or
  :data:`AT_LEAST_FLOAT32`."""
  names = [a.name for a in allowed] + [None]
  if value is None or value is AT_LEAST_FLOAT32:
    return value
  try:
    d = np.dtype(value)
  except TypeError as e:
    raise ValueError(f"{name} must be one of {names}, got {value!r}") from e
  if d not in allowed:
    raise ValueError(f"{name} must be one of {names}, got {value!r}{why}")
  return d


def _rate(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
    raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
  return float(value)


def _moment_dtype(name: str, dtype: Any, p: Any) -> np.dtype:
  """The dtype one moment of parameter ``p`` is stored in; refuses what cannot hold it."""
  p_dtype = np.dtype(jnp.result_type(p))
  if dtype is AT_LEAST_FLOAT32:  # float32 for integer and 16-bit parameters, else theirs
    return math_dtype(p_dtype)
  d = p_dtype if dtype is None else dtype
  if not jnp.issubdtype(d, jnp.inexact):
    raise ValueError(f"{name}=None follows the parameters' dtype, but a parameter is {p_dtype}: "
                     f"pass {name}=jnp.float32 (or bfloat16)")  # fmt: skip
  if name == "mu_dtype" and jnp.iscomplexobj(p) and not jnp.issubdtype(d, jnp.complexfloating):
    raise ValueError(f"mu_dtype={d.name} cannot hold the first moment of a {p_dtype} parameter "
                     "(its imaginary part would be dropped): pass mu_dtype=None")  # fmt: skip
  if name == "nu_dtype" and d == np.dtype(jnp.float16):
    raise ValueError(f"nu_dtype=None follows the parameters' dtype, float16 here{_NU_F16}")
  return d


def _widen(x: Any) -> Any:
  """``x`` in the arithmetic's dtype: float32 for 16-bit floats (complex stays complex)."""
  return x.astype(math_dtype(x.dtype))


class ScaleByAdamState(NamedTuple):
  """State of :func:`scale_by_adam`: optax's layout, moments in their own dtypes.

  Attributes:
    count: int32, the number of applied steps (saturating).
    mu: first moments, in ``mu_dtype``.
    nu: second moments, in ``nu_dtype``.
  """

  count: jax.Array  # type: ignore[assignment]  # optax's field name, over tuple.count
  mu: Any
  nu: Any


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = AT_LEAST_FLOAT32,
    *,
    nu_dtype: Any = AT_LEAST_FLOAT32,
    stochastic_moments: bool = True,
    seed: int = 0,
    param_specs: Any = None,
) -> optax.GradientTransformation:
  """optax's ``scale_by_adam`` with each moment stored in a dtype of its own (16 bits if asked).

  Every step, with optax's own ``optax.tree.update_moment``,
  ``update_moment_per_elem_norm`` and ``bias_correction``, in optax's order,
  on the moments and gradients widened to float32::

    mu     = (1 - b1) * g + b1 * mu
    nu     = (1 - b2) * g**2 + b2 * nu
    u      = (mu / (1 - b1**t)) / (sqrt(nu / (1 - b2**t) + eps_root) + eps)
    store mu in mu_dtype, nu in nu_dtype (stochastically rounded, or to nearest)

  With float32 gradients and ``mu_dtype = nu_dtype = float32`` this is
  ``optax.scale_by_adam`` bit for bit, eagerly and under ``jax.jit``. With
  16-bit moments it is not: optax computes ``b1 * mu`` in the moment's dtype
  (a bfloat16 rounding before the sum), here it is float32 (``docs/bf16.md``).
  The updates are float32 (the next transformation, e.g.
  :func:`jmp_scaler.stochastic_round`, rounds ``p + u`` once).

  Args:
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the denominator, >= 0.
    eps_root: added inside the square root, >= 0.
    mu_dtype: float32, bfloat16, float16, or ``None``: each parameter's
      dtype, as in optax (kept across steps, so the state never changes
      dtype). Default: float32, or the parameter's dtype where it is wider
      or complex (never less precise than float32 unless asked).
    nu_dtype: float32, bfloat16, or ``None`` (each parameter's dtype);
      the same default as ``mu_dtype``.
      float16 is refused: ``g**2`` of a gradient below 2.4e-4 underflows
      float16's normal range, and the update ``mu / (sqrt(nu) + eps)`` then
      explodes.
    stochastic_moments: round the stored 16-bit moments stochastically (bits
      from ``seed`` and ``count``); else round to nearest.
    seed: integer in [0, 2**32).
    param_specs: as in :func:`jmp_scaler.stochastic_round` (``shard_map`` only).

  Returns:
    An ``optax.GradientTransformation`` with :class:`ScaleByAdamState`.

  Raises:
    ValueError: for an argument out of its range; at ``init``, for a moment
      dtype that cannot hold a parameter's moment (a real ``mu_dtype`` for a
      complex parameter, ``None`` for a float16 parameter's ``nu``).

  References:
    Kingma and Ba, 2014, Adam (arXiv:1412.6980); Zamirai et al., 2020
    (arXiv:2010.06192).

  Examples:
    >>> import jax.numpy as jnp
    >>> tx = scale_by_adam(mu_dtype=None, nu_dtype=jnp.float32)
    >>> state = tx.init({"w": jnp.ones(3, jnp.bfloat16)})
    >>> state.mu["w"].dtype, state.nu["w"].dtype
    (dtype(bfloat16), dtype('float32'))
  """
  b1, b2 = _rate("b1", b1), _rate("b2", b2)
  for name, v in (("eps", eps), ("eps_root", eps_root)):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
      raise ValueError(f"{name} must be a number >= 0, got {v!r}")
  mu_dtype = _dtype("mu_dtype", mu_dtype, _MU_DTYPES)
  nu_dtype = _dtype("nu_dtype", nu_dtype, _NU_DTYPES, _NU_F16)
  seed = check_seed(seed)

  def init_fn(params):
    def zeros(name, dtype):
      return lambda p: jnp.zeros_like(p, dtype=_moment_dtype(name, dtype, p))

    return ScaleByAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(zeros("mu_dtype", mu_dtype), params),
        nu=jax.tree.map(zeros("nu_dtype", nu_dtype), params),
    )

  def store(moments, like, stream, count, specs):
    """``moments`` rounded to the dtypes of ``like`` (stochastically if asked)."""
    leaves, treedef = jax.tree.flatten(moments)
    key = step_key(seed, stream, count) if stochastic_moments else None
    out = []
    for i, (x, old, spec) in enumerate(zip(leaves, treedef.flatten_up_to(like), specs,
                                           strict=True)):
      if key is not None and is_low_precision(old):
        out.append(stochastic_cast(x, old.dtype, random_bits(key, i, x.shape, spec)))
      else:
        out.append(x.astype(old.dtype))
    return treedef.unflatten(out)

  def update_fn(updates, state, params=None):
    del params
    grads = jax.tree.map(_widen, updates)
    mu = optax.tree.update_moment(grads, jax.tree.map(_widen, state.mu), b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(grads, jax.tree.map(_widen, state.nu), b2, 2)
    count_inc = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
    nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
    specs = leaf_specs(param_specs, updates)
    mu = store(mu, state.mu, _STREAM_MU, state.count, specs)
    nu = store(nu, state.nu, _STREAM_NU, state.count, specs)
    return updates, ScaleByAdamState(count=count_inc, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _moment_dtypes(mu_dtype: Any, nu_dtype: Any, state_dtype: Any) -> tuple[Any, Any]:
  mu = state_dtype if mu_dtype is _FROM_STATE_DTYPE else mu_dtype
  return mu, state_dtype if nu_dtype is _FROM_STATE_DTYPE else nu_dtype


def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = _FROM_STATE_DTYPE,
    *,
    nu_dtype: Any = _FROM_STATE_DTYPE,
    state_dtype: Any = AT_LEAST_FLOAT32,
    stochastic_moments: bool = True,
    seed: int = 0,
    param_specs: Any = None,
) -> optax.GradientTransformation:
  """``optax.adam`` with its moments in ``state_dtype`` (float32 unless asked: pass
  ``state_dtype=jnp.bfloat16`` for 16-bit moments).

  Same arguments, in the same order, and the same update as ``optax.adam``
  (no ``nesterov``), plus those of :func:`scale_by_adam`. ``state_dtype``
  sets both moments' dtype; ``mu_dtype`` and ``nu_dtype``, where given,
  override it, and ``mu_dtype=None`` follows the parameters' dtype, as in
  optax. With float32 parameters and gradients and the default ``state_dtype``
  (float32, or the parameter's dtype where it is wider or complex) the updates and
  the state are ``optax.adam``'s, bit for bit.

  Examples:
    >>> import jax.numpy as jnp
    >>> adam(1e-3).init({"w": jnp.ones(3, jnp.bfloat16)})[0].nu["w"].dtype
    dtype('float32')
    >>> tx = adam(1e-3, state_dtype=jnp.bfloat16)
    >>> tx.init({"w": jnp.ones(3, jnp.bfloat16)})[0].nu["w"].dtype
    dtype(bfloat16)
  """
  mu_dtype, nu_dtype = _moment_dtypes(mu_dtype, nu_dtype, state_dtype)
  return optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nu_dtype=nu_dtype,
                    stochastic_moments=stochastic_moments, seed=seed, param_specs=param_specs),
      optax.scale_by_learning_rate(learning_rate),
  )


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = _FROM_STATE_DTYPE,
    weight_decay: float = 1e-4,
    mask: Any = None,
    *,
    nu_dtype: Any = _FROM_STATE_DTYPE,
    state_dtype: Any = AT_LEAST_FLOAT32,
    stochastic_moments: bool = True,
    seed: int = 0,
    param_specs: Any = None,
) -> optax.GradientTransformation:
  """``optax.adamw`` with its moments in ``state_dtype`` (float32 unless asked, as
  :func:`adam`).

  Same arguments, in the same order, and the same update as ``optax.adamw``
  (no ``nesterov``), plus those of :func:`scale_by_adam`; the moments' dtypes
  as in :func:`adam`. Keep the parameters in 16 bits by ending the chain
  with :func:`jmp_scaler.stochastic_round` (or use
  :func:`low_precision_optimizer`)::

    tx = optax.chain(jmp_scaler.adamw(1e-3, state_dtype=jnp.bfloat16),
                     jmp_scaler.stochastic_round())

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> tx = adamw(1e-3, weight_decay=0.1)
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> updates, _ = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, tx.init(params), params)
    >>> updates["w"].dtype
    dtype('float32')
  """
  mu_dtype, nu_dtype = _moment_dtypes(mu_dtype, nu_dtype, state_dtype)
  return optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nu_dtype=nu_dtype,
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
