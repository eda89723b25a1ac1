"""The actor's optimizer: the policy's loss scaler ahead of the user's chain, the exact skip
around both, and a guard against tunix's own (unscaled) train step."""

from __future__ import annotations

from typing import Any

import optax

from jmp_scaler.scaling._lookup import find_scale_state
from jmp_scaler.scaling._skip import skip_nonfinite
from jmp_scaler.tunix._args import policy_arg

#: The keyword argument :func:`jmp_scaler.tunix.install_train_step`'s step hands
#: ``optimizer.update``: the chain that :func:`optimizer` builds refuses gradients without it.
TRAIN_STEP_KEY = "jmp_tunix_scaled_step"


def _holds_scaler(tx: optax.GradientTransformation) -> bool:
  """Whether ``tx`` already holds a loss scaler (its state, initialised on no parameters)."""
  try:
    return find_scale_state(tx.init({})) is not None
  except Exception:  # noqa: BLE001 - a transformation that needs parameters: nothing to say
    return False


def optimizer(policy: Any, tx: optax.GradientTransformation,
              **scaler_kwargs: Any) -> optax.GradientTransformationExtraArgs:
  """The actor's optimizer for tunix: ``policy``'s loss scaler ahead of ``tx``, exact skip.

  Pass it as tunix's ``RLTrainingConfig(actor_optimizer=...)`` (or any tunix trainer's
  ``optimizer``)::

    actor_optimizer=jmp_tunix.optimizer(policy, optax.adamw(1e-3))

  It is ``jmp_scaler.skip_nonfinite(optax.chain(policy.loss_scaler(**scaler_kwargs), tx))``:
  under a float16 policy a :func:`jmp_scaler.dynamic_scale`, under bfloat16 and float32
  :func:`jmp_scaler.no_scale` (scale 1, non-finite steps still skipped), so one recipe
  serves every policy and checkpoints have one layout. On a step whose unscaled gradients
  hold inf or NaN the parameters and ``tx``'s state (Adam's moments and count) stay
  bit-identical and the scale backs off, inside tunix's own ``nnx.Optimizer``; the scaler's
  state is part of the optimizer state, so tunix's checkpoints save and restore it.

  The gradients must be those of the *scaled* loss, which tunix's own train step does not
  take: install :func:`jmp_scaler.tunix.install_train_step` on the trainer. The chain refuses,
  when the step is first traced, gradients from a step that is not that one (tunix's, which
  under its gradient accumulation would otherwise train silently on unscaled gradients).

  Args:
    policy: a :class:`jmp_scaler.Policy` or a policy string (``"p=f32,c=f16,o=f32"``): the
      one the rollout and the loss run under (:func:`jmp_scaler.tunix.rollout_engine`,
      :func:`jmp_scaler.tunix.policy_loss`).
    tx: the optimizer without a scaler, such as ``optax.adamw(1e-3)``.
    **scaler_kwargs: :func:`jmp_scaler.dynamic_scale`'s arguments (``init_scale``,
      ``growth_interval=400`` as verl's float16 recipe, ...), validated under every policy
      as :meth:`jmp_scaler.Policy.loss_scaler` does.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is the chain's.

  Raises:
    ValueError: naming the argument: a policy that does not parse, a ``tx`` that is not an
      optax transformation or that already holds a loss scaler, an invalid scaler argument.

  Examples:
    >>> import jax.numpy as jnp, optax, jmp_scaler
    >>> from jmp_scaler import tunix as jmp_tunix
    >>> tx = jmp_tunix.optimizer("p=f32,c=f16,o=f32", optax.adamw(1e-3))
    >>> float(jmp_scaler.get_scale(tx.init({"w": jnp.ones(2)})))
    65536.0
    >>> tx = jmp_tunix.optimizer("p=f32,c=bf16,o=f32", optax.adamw(1e-3))
    >>> float(jmp_scaler.get_scale(tx.init({"w": jnp.ones(2)})))
    1.0
  """
  policy = policy_arg("optimizer", policy)
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise ValueError(
        f"jmp_tunix.optimizer: tx must be an optax GradientTransformation (such as "
        f"optax.adamw(1e-3)), got {type(tx).__name__}")
  if _holds_scaler(tx):
    raise ValueError(
        "jmp_tunix.optimizer: tx already holds a loss scaler; pass the optimizer alone "
        "(optax.adamw(...)): the policy's scaler is put at the head of the chain here")
  try:
    scaler = policy.loss_scaler(**scaler_kwargs)
  except (TypeError, ValueError) as err:
    raise ValueError(f"jmp_tunix.optimizer: {err}") from err
  inner = skip_nonfinite(optax.chain(scaler, tx))

  def update_fn(updates, state, params=None, **extra_args):
    if not extra_args.pop(TRAIN_STEP_KEY, False):
      raise ValueError(
          "jmp_tunix.optimizer was handed gradients by a train step other than "
          "jmp_tunix.install_train_step's: tunix's own step differentiates the unscaled loss "
          "(the scaler would divide its gradients by the scale). Call "
          "jmp_tunix.install_train_step(trainer) (for GRPO: cluster.actor_trainer) before "
          "training")
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
