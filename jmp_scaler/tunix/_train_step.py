"""The one method of tunix that is replaced: a trainer's train step, with the loss scaled.

tunix's ``PeftTrainer._train_step`` (which every tunix trainer runs: SFT, DPO, distillation,
the RL actor and critic) differentiates the loss as it is, and no hook lets a user scale it
(the loss function cannot read the optimizer's state, and the optimizer cannot change what
the gradients were computed from). :func:`install_train_step` replaces the step on one trainer
instance, through tunix's own ``create_train_step_fn``, with the same step differentiating the
scaled loss (:func:`jmp_scaler.value_and_grad`).
"""

from __future__ import annotations

from typing import Any

import optax

from jmp_scaler.scaling._grad import value_and_grad
from jmp_scaler.scaling._lookup import find_scale_state, get_scale
from jmp_scaler.tunix._accumulation import repair_multisteps
from jmp_scaler.tunix._lazy import tunix_module
from jmp_scaler.tunix._optimizer import TRAIN_STEP_KEY

#: The keys the installed step adds to a trainer's ``aux`` dict (RL trainers: log them with
#: ``trainer.with_rl_metrics_to_log``).
AUX_KEYS = ("loss_scale", "loss_scale_skips")


def _scaled_step(trainer: Any):
  """``PeftTrainer._train_step`` with the loss scaled, for ``trainer``."""

  def train_step(model, optimizer, inputs):
    inputs = trainer.gen_model_input_fn(inputs)
    has_aux = trainer._has_aux  # set by tunix's with_loss_fn
    scale = get_scale(optimizer)  # the scale the gradients are multiplied by
    out, grads = value_and_grad(trainer.loss_fn, optimizer, has_aux=has_aux)(model, **inputs)
    grad_norm = optax.global_norm(grads) / scale  # what tunix's step logs, unscaled
    optimizer.update(model, grads, **{TRAIN_STEP_KEY: True})
    loss, aux = out if has_aux else (out, None)
    if isinstance(aux, dict):
      state = find_scale_state(optimizer)
      aux = {**aux, AUX_KEYS[0]: state.scale, AUX_KEYS[1]: state.total_skips}
    return loss, aux, grad_norm

  return train_step


class InstalledStep:
  """What :func:`install_train_step` puts in a trainer's ``create_train_step_fn``: returns
  the scaled step (and tells an installed trainer apart)."""

  def __init__(self, step: Any):
    self.step = step

  def __call__(self) -> Any:
    return self.step


def install_train_step(trainer: Any) -> Any:
  """Replaces ``trainer``'s train step with one that differentiates the scaled loss.

  The only method of tunix that jmp_scaler replaces, on this trainer instance (through
  tunix's ``create_train_step_fn``): tunix's step takes the gradients of the loss as it is,
  and no public hook can scale it. The installed step is tunix's ``_train_step`` with

  * the gradients taken by ``jmp_scaler.value_and_grad(trainer.loss_fn, optimizer)`` (the
    loss times the scale held in the optimizer's state, in float32);
  * the loss it returns (tunix logs it) unscaled, and the ``grad_norm`` it returns (tunix
    logs it) the norm of the unscaled gradients;
  * the scale and the count of skipped steps added to a dict ``aux`` (an RL trainer's), under
    ``"loss_scale"`` and ``"loss_scale_skips"``, for ``trainer.with_rl_metrics_to_log``.

  Under tunix's gradient accumulation (``optax.MultiSteps``, from ``mini_batch_size //
  train_micro_batch_size``) the optimizer's ``MultiSteps`` is also kept but repaired: a
  window with a non-finite micro-batch is skipped exactly (parameters and the inner state
  bit-identical, the scale backed off once), and the next window starts from zeros instead of
  the NaN ``MultiSteps`` would keep. The state layout is unchanged, so tunix's checkpoints
  restore as they are.

  Call it after the trainer exists and before it trains, in any order with the learner that
  sets its loss (the loss function is read when the step is traced)::

    cluster = rl_cluster_lib.RLCluster(actor=actor, ..., cluster_config=config)
    jmp_tunix.install_train_step(cluster.actor_trainer)

  Args:
    trainer: a tunix trainer (``tunix.sft.peft_trainer.PeftTrainer`` or a subclass that keeps
      its train step: tunix's RL ``Trainer``, ``DPOTrainer``, ``DistillationTrainer``) whose
      optimizer holds a loss scaler (:func:`jmp_scaler.tunix.optimizer`).

  Returns:
    ``trainer``.

  Raises:
    ValueError: naming the argument: ``trainer`` is not a tunix trainer, its class replaces
      tunix's train step, the step is already installed, or its optimizer holds no loss
      scaler.
    ImportError: if google-tunix is not installed.
  """
  peft = tunix_module("sft.peft_trainer").PeftTrainer
  if not isinstance(trainer, peft):
    raise ValueError(
        "jmp_tunix.install_train_step: trainer must be a tunix trainer "
        "(tunix.sft.peft_trainer.PeftTrainer or a subclass, such as cluster.actor_trainer), "
        f"got {type(trainer).__name__}")
  if isinstance(trainer.create_train_step_fn, InstalledStep):
    raise ValueError(
        "jmp_tunix.install_train_step: trainer already runs jmp_tunix's train step "
        "(install it once per trainer)")
  for name in ("create_train_step_fn", "_train_step"):
    if getattr(type(trainer), name) is not getattr(peft, name):
      raise ValueError(
          f"jmp_tunix.install_train_step: trainer's class {type(trainer).__name__} replaces "
          f"tunix's {name}, which the installed step would drop; install it on a trainer "
          "that runs PeftTrainer's train step")
  optimizer = trainer.optimizer
  if find_scale_state(optimizer) is None:
    raise ValueError(
        "jmp_tunix.install_train_step: trainer's optimizer holds no loss scaler: build it "
        "with jmp_tunix.optimizer(policy, optax.adamw(...)) (tunix's actor_optimizer)")
  if isinstance(optimizer.tx, optax.MultiSteps):
    optimizer.tx = repair_multisteps(optimizer.tx)
  trainer.create_train_step_fn = InstalledStep(_scaled_step(trainer))
  trainer.clear_jit_cache()
  return trainer
