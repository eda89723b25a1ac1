"""A Flax ``TrainState`` whose ``apply_gradients`` skips non-finite steps exactly."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from jmp_scaler.scaling._lookup import get_scale, scale_metrics, warn_without_scaler
from jmp_scaler.scaling._scaler import FINITE_KEY
from jmp_scaler.scaling._skip import apply_or_skip, plan_step

_OWG = train_state.OVERWRITE_WITH_GRADIENT


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` with an exact skip.

  Use it with a ``tx`` that holds a loss scaler::

    tx = optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3))
    state = jmp_scaler.TrainState.create(apply_fn=model.apply, params=p, tx=tx)

  ``apply_gradients`` decides first whether the unscaled gradients are all
  finite (one read of them), then, under ``lax.cond`` (or a fused select:
  see ``skip_mode`` in :func:`jmp_scaler.dynamic_scale`):

  * finite: runs ``tx`` and applies the updates, ``step`` + 1, and replaces
    the fields given as keyword arguments (``batch_stats=...``);
  * not finite: the parameters, every optimizer state but the scaler's, the
    keyword-argument fields and ``step`` stay bit-identical; the scaler
    backs off and counts the skip.

  ``step`` therefore counts applied updates, like Adam's ``count``; the
  scaler's ``steps`` metric counts every call. ``create`` makes ``step`` an
  int32 array, so a jitted step traces once (flax's Python ``0`` retraces).
  Without a scaler in ``opt_state`` nothing decides a skip: ``create`` warns
  (put ``jmp_scaler.no_scale()`` at the head of the chain), and
  ``apply_gradients`` is flax's, which applies a non-finite gradient.
  """

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs):
    """Like flax's ``create``, with ``step`` an int32 array.

    Warns (``UserWarning``) when ``tx``'s state holds no loss scaler.
    """
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    warn_without_scaler(state.opt_state, params, "jmp_scaler.TrainState")
    return state.replace(step=jnp.asarray(0, jnp.int32))

  def apply_gradients(self, *, grads, **kwargs):
    """Applies ``grads`` (of the scaled loss) unless they are not finite.

    Args:
      grads: gradients of the *scaled* loss, same structure as ``params``.
      **kwargs: other fields to replace, only if the step is applied.

    Returns:
      The updated state (or, on a skipped step, the same state with the
      scaler's state backed off).
    """
    owg = not isinstance(grads, jax.Array) and _OWG in grads
    grads_opt = grads["params"] if owg else grads
    params_opt = self.params["params"] if owg else self.params
    plan = plan_step(grads_opt, self.opt_state, {})
    if plan is None:
      return super().apply_gradients(grads=grads, **kwargs)
    tx = optax.with_extra_args_support(self.tx)

    def apply(decision):
      updates, opt_state = tx.update(
          plan.grads, self.opt_state, params_opt, **{FINITE_KEY: decision}
      )
      new = optax.apply_updates(params_opt, updates)
      if owg:
        new = type(self.params)(
            {**self.params, "params": new, _OWG: grads[_OWG]}
        )
      return new, opt_state, self.step + 1, kwargs

    def skip(shapes):
      del shapes
      old = {k: getattr(self, k) for k in kwargs}
      return self.params, plan.skipped_state, self.step, old

    params, opt_state, step, fields = apply_or_skip(plan.scaler, plan.finite, apply, skip)
    return self.replace(step=step, params=params, opt_state=opt_state, **fields)

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale (float32 scalar; a ``ValueError`` without a scaler)."""
    return get_scale(self.opt_state)

  def scale_metrics(self) -> dict[str, Any]:
    """:func:`jmp_scaler.scale_metrics` of ``opt_state``."""
    return scale_metrics(self.opt_state)
