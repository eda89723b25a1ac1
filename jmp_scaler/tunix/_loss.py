"""The trainer's forward under a policy: a tunix policy loss run under autocast, registered
with tunix's ``register_policy_loss_fn`` under a name the algorithm's config takes."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jmp_scaler.precision._autocast import autocast
from jmp_scaler.precision._policy import Policy
from jmp_scaler.tunix._args import policy_arg, rules_arg, rules_key
from jmp_scaler.tunix._lazy import tunix_module

#: ``(base, policy, rules key) -> name`` of every loss :func:`policy_loss` registered in this
#: process.
REGISTERED: dict[tuple[str, Policy, str], str] = {}


def _under_policy(inner: Any, policy: Policy, rules: Any) -> Any:
  """``inner`` (a tunix policy loss) with the model's forward and the loss under ``policy``."""

  def loss_fn(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    graphdef, state = nnx.split(model)

    def on_state(state, train_example):
      return inner(nnx.merge(graphdef, state), train_example, algo_config, pad_id, eos_id,
                   **kwargs)

    return autocast(on_state, policy, rules=rules)(state, train_example)

  return loss_fn


def policy_loss(policy: Any, base: str = "grpo", *, rules: Any = None) -> str:
  """Registers tunix's policy loss ``base`` under ``policy`` and returns its name.

  Pass the name to the algorithm's config, tunix's public hook for the policy loss::

    algo_config = grpo_learner.GRPOConfig(..., policy_loss_fn=jmp_tunix.policy_loss(policy))

  The registered loss is ``base`` (tunix's ``"grpo"``, ``"ppo"`` or one of your own) with
  the model's forward and the loss under ``jmp_scaler.autocast(..., policy)``: the
  trainer's log-probabilities in the precision the sampler used
  (:func:`jmp_scaler.tunix.rollout_engine`), the loss in float32 when the policy's output
  dtype is. The name is ``"<base>@<policy>"`` (``"grpo@p=f32,c=f16,o=f32"``), followed by
  ``"+rules:<digest>"`` with ``rules``; calling again with the same arguments returns it
  without registering again.

  Args:
    policy: a :class:`jmp_scaler.Policy` or a policy string (``"p=f32,c=f16,o=f32"``).
    base: the name of a policy loss registered with tunix's
      ``function_registry.register_policy_loss_fn``.
    rules: :func:`jmp_scaler.autocast`'s ``rules``, the same as the rollout's
      (:func:`jmp_scaler.tunix.rollout_engine`): a float32 head, say. Validated here.

  Returns:
    The name the loss is registered under.

  Raises:
    ValueError: naming the argument: a policy that does not parse, a ``base`` that tunix
      has not registered or that this function registered (already under a policy).
    ImportError: if google-tunix is not installed.
  """
  policy = policy_arg("policy_loss", policy)
  rules = rules_arg("policy_loss", policy, rules)
  key = rules_key(rules)
  if not isinstance(base, str) or not base:
    raise ValueError(f"jmp_tunix.policy_loss: base must be a loss name such as 'grpo', got "
                     f"{base!r}")
  if (base, policy, key) in REGISTERED:
    return REGISTERED[base, policy, key]
  if base in REGISTERED.values():
    raise ValueError(
        f"jmp_tunix.policy_loss: base={base!r} is a loss this function registered, already "
        "under a policy; pass the loss it was made from")
  registry = tunix_module("rl.function_registry")
  try:
    inner = registry.get_policy_loss_fn(base)
  except LookupError as err:
    known = registry.default_registry.list_functions("policy_loss_fn")
    raise ValueError(
        f"jmp_tunix.policy_loss: base={base!r} is not a policy loss registered with tunix "
        f"(registered: {', '.join(sorted(known))})") from err
  name = f"{base}@{policy}" + (f"+rules:{key}" if key else "")
  registry.register_policy_loss_fn(name)(_under_policy(inner, policy, rules))
  REGISTERED[base, policy, key] = name
  return name
