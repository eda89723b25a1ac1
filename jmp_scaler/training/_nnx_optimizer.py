"""An ``nnx.Optimizer`` whose ``update`` skips non-finite steps exactly."""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from jmp_scaler.scaling._lookup import get_scale, scale_metrics, warn_without_scaler
from jmp_scaler.scaling._scaler import FINITE_KEY
from jmp_scaler.scaling._skip import apply_or_skip, noop_updates, plan_step


def _flat(state: Any) -> dict[tuple, Any]:
  return dict(nnx.to_flat_state(nnx.as_pure(state)))


def _restorable(model: Any, restore_on_skip: Any, graph: bool | None):
  """(snapshot, current values) of the variables in ``restore_on_skip``."""
  if restore_on_skip is None:
    return None, None
  refs = jax.tree.leaves(restore_on_skip, is_leaf=lambda x: isinstance(x, nnx.Variable))
  if any(isinstance(x, nnx.Variable) for x in refs):
    raise ValueError(
        "restore_on_skip must hold values, not Variables (nnx.state returns live "
        "references that the forward pass updates): take the snapshot with "
        "nnx.as_pure(nnx.state(model, nnx.BatchStat)) before the forward pass"
    )
  if isinstance(restore_on_skip, dict):
    restore_on_skip = nnx.State(restore_on_skip)
  snapshot = _flat(restore_on_skip)
  now = _flat(nnx.state(model, graph=graph))
  missing = [p for p in snapshot if p not in now]
  if missing:
    raise ValueError(f"restore_on_skip holds paths that are not in the model: {missing[:3]}")
  return snapshot, {p: now[p] for p in snapshot}


class NNXOptimizer(nnx.Optimizer):
  """``flax.nnx.Optimizer`` with the exact skip of :class:`jmp_scaler.TrainState`.

  A drop-in replacement for ``nnx.Optimizer`` (same constructor, same
  ``update(model, grads)``, same state layout, so checkpoints are
  interchangeable)::

    tx = optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3))
    optimizer = jmp_scaler.NNXOptimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
      scale = optimizer.loss_scale
      grads = nnx.grad(lambda m: loss_fn(m, x, y) * scale)(model)
      optimizer.update(model, grads)   # gradients of the *scaled* loss

  ``update`` decides first whether the unscaled gradients are all finite
  (one read of them), then (one trace, no host sync; under ``lax.cond`` or a
  fused select, as the scaler's ``skip_mode`` says):

  * finite: runs ``tx``, applies the updates to the ``wrt`` variables and
    counts the step (``step`` + 1);
  * not finite: every ``wrt`` variable, every optimizer state but the
    scaler's and ``step`` stay bit-identical; the scaler backs off and counts
    the skip. ``step`` therefore counts applied updates, like Adam's
    ``count`` (``nnx.Optimizer`` counts calls); the scaler's ``steps``
    metric counts every call.

  A forward pass in NNX updates non-trainable state (``nnx.BatchStat``) in
  place before the optimizer sees the gradients. To discard it on a skipped
  step, as :class:`jmp_scaler.TrainState` discards ``batch_stats=``, take a
  snapshot before the forward pass and hand it to ``update``::

    stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))  # before the forward
    ...
    optimizer.update(model, grads, restore_on_skip=stats)

  Without a scaler in ``tx``'s state nothing decides a skip: the constructor
  warns (put ``jmp_scaler.no_scale()`` at the head of the chain), and
  ``update`` is ``nnx.Optimizer``'s, which applies a non-finite gradient.

  Args:
    model: the NNX module.
    tx: an Optax transformation, typically
      ``optax.chain(jmp_scaler.dynamic_scale(), ...)``.
    wrt: the filter of the variables to optimize (as in ``nnx.grad``).
    graph: as in ``nnx.Optimizer``.
  """

  def __init__(self, model, tx, *args, **kwargs):
    super().__init__(model, tx, *args, **kwargs)
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    warn_without_scaler(nnx.as_pure(self.opt_state), params, "jmp_scaler.NNXOptimizer")

  def update(self, model, grads, /, *, restore_on_skip: Any = None, **kwargs) -> Any:
    """Applies ``grads`` (of the scaled loss) unless they are not finite.

    Args:
      model: the module whose ``wrt`` variables are updated in place.
      grads: gradients of the *scaled* loss, as returned by ``nnx.grad``.
      restore_on_skip: optional snapshot of values of non-trainable variables
        (``nnx.as_pure(nnx.state(model, nnx.BatchStat))``, taken before the
        forward pass), written back into ``model`` on a skipped step.
      **kwargs: extra arguments for ``tx.update``.

    Returns:
      The updates applied (``-0.0`` everywhere on a skipped step).
    """
    snapshot, current = _restorable(model, restore_on_skip, self.graph)
    opt_state = nnx.as_pure(self.opt_state)
    grads_in = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    plan = plan_step(grads_in, opt_state, {})
    if plan is None:
      return super().update(model, grads, **kwargs)
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    tx = optax.with_extra_args_support(self.tx)
    kwargs = nnx.as_pure(kwargs)
    step = self.step[...]

    def apply(decision):
      extra = {**kwargs, FINITE_KEY: decision}
      updates, new_opt_state = tx.update(plan.grads, opt_state, params, **extra)
      new_params = optax.apply_updates(params, updates)
      return updates, new_params, new_opt_state, step + 1, current

    def skip(shapes):
      return noop_updates(shapes[0]), params, plan.skipped_state, step, snapshot

    updates, new_params, new_opt_state, new_step, kept = apply_or_skip(
        plan.scaler, plan.finite, apply, skip)
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
    self.step[...] = new_step
    if kept is not None:
      nnx.update(model, nnx.from_flat_state(kept))
    return updates

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale (float32 scalar; a ``ValueError`` without a scaler)."""
    return get_scale(nnx.as_pure(self.opt_state))

  def scale_metrics(self) -> dict[str, Any]:
    """:func:`jmp_scaler.scale_metrics` of the optimizer state."""
    return scale_metrics(nnx.as_pure(self.opt_state))
