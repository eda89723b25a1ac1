"""The rollout under a policy: tunix's vanilla rollout whose sampler runs its prefill and decode
(and the rollout's full-sequence log-probabilities) under :func:`jmp_scaler.autocast`."""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_scaler.precision._autocast import autocast
from jmp_scaler.tunix._args import dtype_arg, policy_arg, rules_arg
from jmp_scaler.tunix._lazy import tunix_module

#: tunix's models whose attention mask constant ``K_MASK`` a float16 cache saturates.
MASKED_MODELS = ("gemma", "gemma3", "gemma4", "llama3", "qwen2", "qwen3")


def finite_masks(dtype: Any) -> list[str]:
  """Sets ``K_MASK`` of tunix's models to ``dtype``'s finite minimum where it is beyond it.

  tunix's models mask attention scores with ``jnp.where(mask, scores, K_MASK)``, ``K_MASK =
  -2.38e38``: in a model computing in float16 (``config.dtype``) the constant is converted
  when the function is traced, to ``-inf``, and a fully masked row (a left-padded prompt's
  padding) is NaN. The one module constant of tunix that jmp_scaler replaces: with
  ``-65504`` (``jnp.finfo(jnp.float16).min``) the row's softmax is the uniform one float32
  gives, and every other row is what it is with ``-2.38e38`` (a score of a real token is never
  near -65504). Process-wide, for the models already imported and those imported later by
  the same name (the constant is read when a model is traced). Returns the modules changed.
  """
  low = float(jnp.finfo(dtype).min)
  changed = []
  for name in MASKED_MODELS:
    module = sys.modules.get(f"tunix.models.{name}.model")
    if module is None:
      try:
        module = tunix_module(f"models.{name}.model")
      except ImportError:  # a tunix without this model
        continue
    if getattr(module, "K_MASK", 0.0) < low:
      setattr(module, "K_MASK", low)  # noqa: B010 - a module mypy does not see
      changed.append(module.__name__)
  return changed


def rollout_engine(policy: Any, *, rules: Any = None,
                   cache_dtype: Any = "float32") -> functools.partial:
  """tunix's vanilla rollout with the sampler's prefill and decode under ``policy``.

  Pass it as tunix's ``ClusterConfig(rollout_engine=...)``, which takes a subclass of
  tunix's ``BaseRollout`` or a ``functools.partial`` of one::

    rollout_engine=jmp_tunix.rollout_engine(policy)

  The rollout is tunix's ``VanillaRollout`` (same sampler, same KV cache, same sampling)
  whose sampler's jitted prefill and decode functions run under
  ``jmp_scaler.autocast(..., policy)``: the model's matmuls in ``policy.compute_dtype``, its
  exponentials, logarithms, reductions and softmax in float32, from the float32 master
  weights (the trainer's, which tunix shares with a rollout of its own). The rollout's
  full-sequence log-probabilities (tunix's "old" log-probabilities when GRPO's
  ``num_iterations`` is above 1) run under the same policy. Give the trainer's loss the same
  policy (:func:`jmp_scaler.tunix.policy_loss`) so that the sampler and the trainer compute
  in one precision.

  Several rollouts under several policies (or the same) run in one process.

  Args:
    policy: a :class:`jmp_scaler.Policy` or a policy string (``"p=f32,c=f16,o=f32"``).
    rules: :func:`jmp_scaler.autocast`'s ``rules``, the same as the trainer's
      (:func:`jmp_scaler.tunix.policy_loss`): e.g. the head in float32 (MaxText's remedy for
      the log-prob noise) with a scoped rule, ``{("dot_general",
      r"(^|/)einsum/BTD,DV->BTV$|embedder_decode"): "float32"}`` on tunix's models
      (``benchmarks/bench_rl.py``'s ``f16+head``). Validated here.
    cache_dtype: the KV cache's dtype: ``"float32"`` (the default, a model configured
      with ``dtype=jnp.float32``, the policy choosing the compute dtype) or the policy's
      compute dtype (half the cache's memory, the keys and values the sampler reads in the
      precision the trainer computes them). tunix allocates the cache in the model's
      ``config.dtype`` and writes the keys and values as the model computes them, so a half
      cache needs a model configured with ``dtype=`` that dtype and
      ``param_dtype=jnp.float32`` (its own casts then run the attention in half precision,
      the float32 master weights stay); a float16 cache also sets tunix's attention mask
      constant to float16's finite minimum (:func:`finite_masks`, process-wide), which is
      ``-inf`` in float16 as tunix writes it. The sampler keeps the cache in its dtype from
      one step to the next (the policy's output dtype applies to what the sampler returns).

  Returns:
    A ``functools.partial`` of a ``VanillaRollout`` subclass, which tunix's ``RLCluster``
    instantiates with the rollout model (whose ``config.dtype`` must be ``cache_dtype``).

  Raises:
    ValueError: naming the argument: a policy that does not parse, a ``cache_dtype`` that is
      not a dtype or not float32 (when called); a rollout model whose KV cache would not be
      ``cache_dtype`` (when tunix builds the rollout).
    ImportError: if google-tunix is not installed.

  Examples:
    >>> from jmp_scaler import tunix as jmp_tunix
    >>> jmp_tunix.rollout_engine("p=f32,c=f16,o=f32", cache_dtype="bfloat16")
    Traceback (most recent call last):
    ...
    ValueError: jmp_tunix.rollout_engine: cache_dtype=bfloat16 must be float32 or the policy's ...
  """
  policy = policy_arg("rollout_engine", policy)
  rules = rules_arg("rollout_engine", policy, rules)
  cache = dtype_arg("rollout_engine", "cache_dtype", cache_dtype)
  if cache not in (np.dtype(np.float32), policy.compute_dtype):
    raise ValueError(
        f"jmp_tunix.rollout_engine: cache_dtype={cache} must be float32 or the policy's "
        f"compute dtype, {policy.compute_dtype}")
  if cache == np.dtype(np.float16):
    finite_masks(cache)
  return functools.partial(rollout_classes()[1], policy=policy, rules=rules, cache_dtype=cache)


def _keep_cache(new: Any, old: Any) -> Any:
  """``new`` (a sampling state autocast returned, its floating leaves in the policy's output
  dtype) with its KV cache back in the dtype the cache had: what the model writes into it
  next step (a float16 cache's values round-trip float32 exactly)."""
  cache = jax.tree.map(lambda n, o: n.astype(o.dtype), new.cache, old.cache)
  return new.replace(cache=cache)


@functools.cache
def rollout_classes():  # unannotated: its classes subclass tunix's, which mypy does not see
  """``(AutocastSampler, AutocastRollout)``, built on tunix's classes at the first call."""
  sampler_lib = tunix_module("generate.sampler")
  vanilla_rollout = tunix_module("rl.rollout.vanilla_rollout")

  class AutocastSampler(sampler_lib.Sampler):
    """tunix's ``Sampler`` whose jitted prefill and decode bodies run under a policy.

    tunix's ``__init__`` jits ``self._prefill_fn`` and ``self._decode_fn`` with its own
    options (the sampling state donated, ``echo`` static); the bodies are overridden here.
    """

    def __init__(self, transformer, tokenizer, cache_config, *, policy, rules=None, **kwargs):
      self.jmp_policy, self.jmp_rules = policy, rules
      super().__init__(transformer, tokenizer, cache_config, **kwargs)

    def _prefill_fn(self, params, sampler_state, images=None, echo=True):
      prefill = autocast(super()._prefill_fn, self.jmp_policy, rules=self.jmp_rules)
      return _keep_cache(prefill(params, sampler_state, images, echo=echo), sampler_state)

    def _decode_fn(self, params, sampling_state):
      decode = autocast(super()._decode_fn, self.jmp_policy, rules=self.jmp_rules)
      return _keep_cache(decode(params, sampling_state), sampling_state)

  class AutocastRollout(vanilla_rollout.VanillaRollout):
    """tunix's ``VanillaRollout`` over an :class:`AutocastSampler` (tunix's ``rollout_engine``
    extension point: ``RLCluster`` builds it with these keyword arguments)."""

    def __init__(self, rollout_actor, tokenizer, mesh=None, rollout_config=None, *, policy,
                 rules=None, cache_dtype):
      del mesh  # the vanilla rollout runs on the mesh it is called under, as tunix's
      config = getattr(rollout_actor, "config", None)
      if config is None or rollout_config is None:
        raise ValueError(
            "jmp_tunix.rollout_engine: the rollout model must have a config (a model of "
            "tunix's zoo) and the cluster a rollout_config")
      self.jmp_policy, self.jmp_rules = policy, rules
      self._sampler = AutocastSampler(
          rollout_actor, tokenizer,
          sampler_lib.CacheConfig(cache_size=rollout_config.kv_cache_size,
                                  num_layers=config.num_layers,
                                  num_kv_heads=config.num_kv_heads, head_dim=config.head_dim),
          policy=policy, rules=rules)
      allocated = np.dtype(self._sampler.dtype)
      if allocated != cache_dtype:
        raise ValueError(
            f"jmp_tunix.rollout_engine: cache_dtype={cache_dtype} but tunix allocates the KV "
            f"cache in the rollout model's dtype, {allocated} (config.dtype): build the model "
            f"with dtype=jnp.{cache_dtype} and param_dtype=jnp.float32 (float32 master "
            "weights; for a float32 cache, dtype=jnp.float32: the policy chooses the compute "
            "dtype)")

    def get_per_token_logps(self, prompt_tokens, completion_tokens):
      logps = super().get_per_token_logps
      return autocast(logps, self.jmp_policy, rules=self.jmp_rules)(prompt_tokens,
                                                                   completion_tokens)

  AutocastSampler.__qualname__ = AutocastSampler.__name__
  AutocastRollout.__qualname__ = AutocastRollout.__name__
  return AutocastSampler, AutocastRollout

