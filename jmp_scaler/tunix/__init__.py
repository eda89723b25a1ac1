"""Float16 (or bfloat16) RL fine-tuning in google-tunix: ``from jmp_scaler import tunix as
jmp_tunix``.

Four helpers, one per place tunix takes the piece, each given the same dtype policy
(docs/tunix.md has the recipe)::

  policy = "p=f32,c=f16,o=f32"                 # float32 master weights, float16 compute
  config = rl_cluster_lib.ClusterConfig(
      ...,
      rollout_engine=jmp_tunix.rollout_engine(policy),        # prefill and decode
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=jmp_tunix.optimizer(policy, optax.adamw(1e-3)), ...))
  cluster = rl_cluster_lib.RLCluster(actor=actor, ..., cluster_config=config)
  jmp_tunix.install_train_step(cluster.actor_trainer)          # scaled gradients
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[...],
      algo_config=grpo_learner.GRPOConfig(..., policy_loss_fn=jmp_tunix.policy_loss(policy)))

* :func:`optimizer`: the policy's loss scaler ahead of the user's optimizer, with the exact
  skip (tunix's ``actor_optimizer``);
* :func:`rollout_engine`: tunix's vanilla rollout under the policy (tunix's
  ``rollout_engine``);
* :func:`policy_loss`: a tunix policy loss under the policy, registered
  (``register_policy_loss_fn``);
* :func:`install_train_step`: the one replaced method, the trainer's train step,
  differentiating the scaled loss (tunix's step cannot be given a scaled loss).

And one diagnostic: :func:`mismatch_origin`, the first module where the sampler's decode path
and the trainer's full forward part under a policy (its report, a ``MismatchOrigin`` of
``LayerMismatch`` rows, is documented with it).

Floor 4, over ``scaling``, ``precision``, ``training`` and ``diagnostics``. tunix (PyPI
``google-tunix``, an optional extra: ``pip install 'jmp_scaler[tunix]'``) is imported by the
functions when called, never by ``import jmp_scaler`` or by this import.

* ``_optimizer``, ``_rollout``, ``_loss``, ``_train_step``: the four helpers;
* ``_origin``: the diagnostic;
* ``_accumulation``: tunix's ``optax.MultiSteps`` repaired for a loss scaler;
* ``_lazy``: importing tunix; ``_args``: the argument checks.
"""

from jmp_scaler.tunix._loss import policy_loss as policy_loss
from jmp_scaler.tunix._optimizer import optimizer as optimizer
from jmp_scaler.tunix._origin import mismatch_origin as mismatch_origin
from jmp_scaler.tunix._rollout import rollout_engine as rollout_engine
from jmp_scaler.tunix._train_step import install_train_step as install_train_step

__all__ = (
    "install_train_step",
    "mismatch_origin",
    "optimizer",
    "policy_loss",
    "rollout_engine",
)
