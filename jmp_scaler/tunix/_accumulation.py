"""tunix's gradient accumulation (``optax.MultiSteps``) made safe for a loss scaler.

tunix wraps the actor's optimizer in ``optax.MultiSteps(tx, k)`` when ``mini_batch_size //
train_micro_batch_size`` is above 1, and restores its checkpoints with that state layout
before any user code runs. Inside, a scaler sees the window's mean and skips it exactly when a
micro-batch overflowed; but ``MultiSteps`` resets its accumulator as ``(1 - emit) * acc``, and
``0 * inf`` is NaN: every later window would be skipped too, the scale halving each time
(docs/scale_out.md, "Why not optax.MultiSteps"). :func:`repair_multisteps` keeps
``MultiSteps`` and its state (checkpoints are unchanged) and resets the accumulator to zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def repair_multisteps(multi_steps: optax.MultiSteps) -> optax.GradientTransformationExtraArgs:
  """``multi_steps`` with its accumulator reset to zeros when a window closes.

  The state is ``multi_steps``'s own (an ``optax.MultiStepsState``). Each call runs
  ``multi_steps.update``; then, when the window closed (``mini_step`` back to 0), the
  accumulated gradients are set to zeros (``MultiSteps`` multiplies them by 0, which leaves an
  inf or a NaN of an overflowed micro-batch in place), and the updates of a call that did not
  close a window are ``-0.0``, which leaves every bit of the parameters as it is
  (``MultiSteps`` returns ``0.0 * update``, which turns a parameter's ``-0.0`` into ``0.0``).

  A window with a non-finite micro-batch is skipped as a whole, by the exact skip inside
  (``skip_nonfinite``): the inner state (Adam's moments and count) and the parameters stay
  bit-identical, the scaler backs off once, and the next window starts from zeros.

  Args:
    multi_steps: the ``optax.MultiSteps`` tunix built around the actor's optimizer.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``multi_steps``'s state.
  """

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = multi_steps.update(updates, state, params, **extra_args)
    closed = new_state.mini_step == 0
    acc = jax.tree.map(lambda a: jnp.where(closed, jnp.zeros_like(a), a), new_state.acc_grads)
    new_updates = jax.tree.map(
        lambda u: jnp.where(closed, u, jnp.full_like(u, -0.0)), new_updates)
    return new_updates, new_state._replace(acc_grads=acc)

  return optax.GradientTransformationExtraArgs(multi_steps.init, update_fn)
