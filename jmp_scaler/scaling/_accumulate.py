"""Gradient accumulation under a loss scaler: one scale per window, exact averages.

It replaces ``optax.MultiSteps`` for scaled training, which (optax 0.2.8)
cannot drop one micro-batch safely: without ``should_skip_update_fn`` a NaN
micro-batch poisons its window *and every later one* (the accumulator is
reset as ``0 * acc``, and ``0 * NaN`` is NaN); with ``skip_not_finite`` the
overflow is hidden from the scaler, which never backs off (a scale too large
for the data drops every micro-batch for ever); and it sums *scaled*
gradients, so a scale that changes inside a window (an outer skip wrapper
backing off) mixes two scales. ``docs/scale_out.md`` has the details.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_scaler import _validation as validation
from jmp_scaler._leaves import is_floating, math_dtype, row_major
from jmp_scaler.scaling._lookup import find_scale_state, replace_scale_state
from jmp_scaler.scaling._scaler import (
  FINITE_KEY,
  SCALED_BY_KEY,
  LossScaleState,
  decision,
  next_state,
  no_scale,
  reciprocal,
  unscale_leaf,
)
from jmp_scaler.scaling._skip import apply_or_skip, noop_updates

_MODES = ("drop_micro_batch", "skip_window")


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    mini_step: micro-batches seen in the current window (int32, ``0`` right
      after a window closes).
    finite_steps: finite micro-batches accumulated in the current window
      (int32).
    grad_sum: sum of the *unscaled* finite micro-batch gradients, one leaf per
      parameter, in at least float32.
    dropped: non-finite micro-batches since init (int32, saturating).
    inner_state: the wrapped transformation's state (holds the scaler).
  """

  mini_step: jax.Array
  finite_steps: jax.Array
  grad_sum: Any
  dropped: jax.Array
  inner_state: Any


def _window_scaler(scaler: LossScaleState, overflowed: jax.Array) -> LossScaleState:
  """The scaler after an *applied* window, which backs off if it dropped a micro-batch.

  The update was applied, so the skip counters do not move; the scale,
  growth and hysteresis trackers move as for an overflow.
  """
  ok = next_state(scaler, True)
  backed_off = next_state(scaler, False)._replace(
      skipped=jnp.asarray(False),
      consecutive_skips=jnp.zeros([], jnp.int32),
      total_skips=scaler.total_skips,
  )
  return jax.tree.map(lambda b, o: jnp.where(overflowed, b, o), backed_off, ok)


def accumulate_gradients(
    inner: optax.GradientTransformation,
    every_k: int,
    *,
    on_nonfinite: str = "drop_micro_batch",
) -> optax.GradientTransformationExtraArgs:
  """Averages ``every_k`` micro-batches per update, one loss scale per window.

  Wrap the whole chain, scaler included (this replaces ``optax.MultiSteps``)::

    tx = jmp_scaler.accumulate_gradients(
        optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3)), every_k=4)
    scale = jmp_scaler.get_scale(opt_state)       # fixed within the window
    grads = jax.grad(lambda p: loss(p, micro_batch) * scale)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

  Each call takes the gradients of one micro-batch's *scaled* loss, decides
  whether they are finite (one read, reduced over the scaler's ``axis_name``)
  and adds ``grads / scale`` in float32 to a running sum. The scale does
  not change inside a window. On the ``every_k``-th call the window closes::

    n = number of finite micro-batches in the window
    if n == every_k:                         # the usual case
      run inner on grad_sum / n; the scaler counts a finite step
    elif n > 0 and on_nonfinite == "drop_micro_batch":
      run inner on grad_sum / n (the mean over the finite micro-batches);
      the scaler backs off as for an overflow; no skip is counted
    else:                                    # nothing finite, or "skip_window"
      inner does not run; its state is bit-identical but the scaler's,
      which backs off and counts a skipped step

  ``inner`` receives the unscaled mean with its scaler's scale momentarily
  set to 1, so nothing is divided twice. Calls that do not close a window,
  and skipped windows, return ``-0.0`` updates, which leave parameters
  bit-identical under ``optax.apply_updates``. ``inner`` runs under
  ``lax.cond`` only when a window closes, or on every call, its results
  kept by ``jnp.where``, under the scaler's ``skip_mode="select"`` (GPU). The scaler's counters
  (``steps``, ``growth_interval``, ``hysteresis``) count windows, as
  PyTorch's ``GradScaler.update()`` does when called once per window.

  Use it as the outermost wrapper. Under :class:`jmp_scaler.TrainState` (or
  :func:`jmp_scaler.skip_nonfinite`) the outer wrapper drops a non-finite
  micro-batch before this sees it: the scale backs off at once and the window
  waits for ``every_k`` finite micro-batches; sums stay exact because each
  micro-batch is unscaled with its own scale. Without a scaler in ``inner``
  the scale is 1 and the finiteness decision is local to each device.

  Args:
    inner: the transformation to apply once per window, usually
      ``optax.chain(jmp_scaler.dynamic_scale(...), ...)``.
    every_k: micro-batches per window; an integer >= 1.
    on_nonfinite: ``"drop_micro_batch"`` (the default) or ``"skip_window"``
      (a single non-finite micro-batch skips the whole update, as
      ``optax.MultiSteps`` without ``should_skip_update_fn`` does).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulationState`.

  Raises:
    ValueError: naming the argument and its value, for an invalid setting.

  Examples:
    >>> import jax.numpy as jnp, optax, jmp_scaler
    >>> tx = jmp_scaler.accumulate_gradients(
    ...     optax.chain(jmp_scaler.dynamic_scale(4.0), optax.sgd(1.0)), every_k=2)
    >>> state = tx.init(jnp.zeros(2))
    >>> u, state = tx.update(jnp.array([4.0, 8.0]), state)        # scaled by 4
    >>> u, state = tx.update(jnp.array([jnp.nan, 0.0]), state)    # dropped
    >>> u.tolist(), float(jmp_scaler.get_scale(state))
    ([-1.0, -2.0], 2.0)
  """
  k = validation.integer("every_k", every_k, 1)
  validation.one_of("on_nonfinite", on_nonfinite, _MODES)
  drop = on_nonfinite == "drop_micro_batch"
  inner = optax.with_extra_args_support(inner)

  def acc_zeros(p):
    dtype = math_dtype(p.dtype) if is_floating(p) else p.dtype
    return jnp.zeros(jnp.shape(p), dtype)

  def init_fn(params):
    i32 = jnp.zeros([], jnp.int32)
    return AccumulationState(
        mini_step=i32,
        finite_steps=i32,
        grad_sum=jax.tree.map(acc_zeros, params),
        dropped=i32,
        inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    extra_args = dict(extra_args)
    scaler = find_scale_state(state.inner_state)
    ref = scaler if scaler is not None else no_scale().init(None)
    raw = updates  # as the step computed them: the scaler checks that they were scaled
    updates = row_major(updates)  # read in order by the check and the sum
    finite = jnp.asarray(decision(updates, ref, extra_args), jnp.bool_)
    extra_args.pop(FINITE_KEY, None)  # the inner chain gets this window's decision instead
    pre, inv = reciprocal(ref.scale)  # two normal factors: exact up to the largest scale

    def add(s, g):
      if not is_floating(g):
        return s
      u = unscale_leaf(g, pre, inv, s.dtype)  # in the sum's dtype
      # A window of one call: its mean is its own unscaled gradients, and the sum,
      # which stays zero, is neither written nor cleared on every call (x0.80 / 1.49
      # / 1.33 of a step without a scaler at 8 / 64 / 256 leaves with it).
      return u if k == 1 else jnp.where(finite, s + u, s)

    grad_sum = jax.tree.map(add, state.grad_sum, updates)
    mini_step = state.mini_step + 1
    finite_steps = state.finite_steps + finite.astype(jnp.int32)
    at_end = mini_step >= k
    overflowed = finite_steps < mini_step
    run = at_end & ((finite_steps > 0) if drop else ~overflowed)

    def apply(decision):
      del decision  # the window's decision is `run`, taken above
      n = finite_steps
      mean = jax.tree.map(
          lambda s, g: (s / n.astype(s.dtype)).astype(g.dtype) if is_floating(g) else g,
          grad_sum,
          updates,
      )
      inner_state = state.inner_state
      if scaler is not None:
        unit = scaler._replace(scale=jnp.ones([], jnp.float32))
        inner_state = replace_scale_state(inner_state, unit)
      out, inner_state = inner.update(mean, inner_state, params, **{
          **extra_args, FINITE_KEY: True, SCALED_BY_KEY: (raw, ref.scale)})
      if scaler is not None:
        inner_state = replace_scale_state(inner_state, _window_scaler(scaler, overflowed))
      return out, inner_state

    def wait(shapes):
      zeros = noop_updates(shapes[0])
      inner_state = state.inner_state
      if scaler is not None:
        skipped = jax.tree.map(
            lambda a, b: jnp.where(at_end, a, b), next_state(scaler, False), scaler
        )
        inner_state = replace_scale_state(inner_state, skipped)
      return zeros, inner_state

    # The chain runs on one call in k: skipping the other k - 1 under a conditional
    # beats running the optimizer on every micro-batch, whatever the backend.
    auto = "cond" if k > 1 else "select"
    out, inner_state = apply_or_skip(scaler, run, apply, wait, auto)
    dropped = jnp.where(finite, state.dropped, optax.safe_increment(state.dropped))
    new_state = AccumulationState(
        mini_step=jnp.where(at_end, 0, mini_step).astype(jnp.int32),
        finite_steps=jnp.where(at_end, 0, finite_steps).astype(jnp.int32),
        grad_sum=state.grad_sum if k == 1 else jax.tree.map(
            lambda s: jnp.where(at_end, jnp.zeros_like(s), s), grad_sum),
        dropped=dropped.astype(jnp.int32),
        inner_state=inner_state,
    )
    return out, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
