"""GRPO in float16, then bfloat16, in google-tunix with jmp_scaler's recipe (docs/tunix.md).

tunix's own GRPO learner, rollout, trainer and metrics on a tiny random Qwen3 of tunix's model
zoo (2 layers, d=64, a 48-character vocabulary), float32 master weights, the task "a+b=" with
a reward for digits and for the sum's first digit. Four helpers make it float16, each given
the policy:

* ``jmp_tunix.rollout_engine(policy)``: the sampler's prefill and decode under autocast;
* ``jmp_tunix.optimizer(policy, optax.adamw(...))``: the loss scaler (float16) or
  ``no_scale`` (bfloat16) ahead of AdamW, exact skip, in tunix's own optimizer and checkpoints;
* ``jmp_tunix.policy_loss(policy)``: tunix's GRPO loss under autocast, registered;
* ``jmp_tunix.install_train_step(trainer)``: tunix's train step with the gradients taken by
  ``jmp_scaler.value_and_grad(trainer.loss_fn, optimizer)``, the loss and grad_norm tunix logs
  unscaled.

Per step it prints what tunix logged (the mean reward, the loss, the grad_norm, the loss scale,
the skipped steps: GRPO's loss is 0 with num_iterations=1, its ratio being 1 and its advantages
centred in each group, but not its gradient); then the sampler against the trainer
(``jmp_scaler.logprob_parity``) on the 32 prompts, 48 sampled tokens each: the
log-probabilities the sampler drew the tokens with (KV-cache prefill and decode) against the
trainer's full-sequence forward of the same tokens (tunix's compute_per_token_logps, what the
GRPO loss runs), both under the policy.

  python examples/tunix_grpo.py                                    # about a minute on a CPU
  python examples/tunix_grpo.py --steps 0 --policies f32,bf16,f16  # the parity table only

Needs google-tunix: pip install 'jmp_scaler[tunix]'.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_scaler
from jmp_scaler import tunix as jmp_tunix

POLICIES = {"f32": "p=f32,c=f32,o=f32", "bf16": "p=f32,c=bf16,o=f32", "f16": "p=f32,c=f16,o=f32"}
PROMPTS = [f"{a}+{b}=" for a in range(8) for b in range(4)]  # 32 prompts
BATCH, GENERATIONS, TOKENS, PARITY_TOKENS = 4, 2, 8, 48


class CharTokenizer:
  """The 43 characters of the task and 5 specials: what tunix's TokenizerAdapter needs."""

  vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "<sep>",
           *"abcdefghijklmnopqrstuvwxyz0123456789 +-=?.,"]

  def __init__(self):
    self.ids = {c: i for i, c in enumerate(self.vocab)}

  def encode(self, text, **kwargs):
    return [1] + [self.ids.get(c, 3) for c in text]

  def decode(self, ids, **kwargs):
    return "".join(self.vocab[i] for i in ids if i >= 5)

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return 0


def tiny_qwen3():
  from tunix.models.qwen3 import model as qwen3

  config = qwen3.ModelConfig(
      num_layers=2, vocab_size=48, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
      num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=False,
      shd_config=qwen3.ShardingConfig.get_default_sharding(),
      dtype=jnp.float32, param_dtype=jnp.float32)  # float32 master weights and KV cache
  return qwen3.Qwen3(config, rngs=nnx.Rngs(params=0))


def reward(prompts, completions, **kwargs):
  """The share of digits in the completion (an answer to "a+b=" is digits), and 1 more when
  it starts with the sum's first digit."""
  out = []
  for prompt, completion in zip(prompts, completions, strict=True):
    a, b = str(prompt)[:-1].split("+")
    digits = sum(c.isdigit() for c in completion) / max(len(completion), 1)
    out.append(digits + float(completion[:1] == str(int(a) + int(b))[:1]))
  return out


def grpo(policy: str, steps: int):
  """tunix's GRPO with the recipe's four helpers; trains ``steps`` steps."""
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={role: mesh for role in roles},
      rollout_engine=jmp_tunix.rollout_engine(policy),  # 1. prefill and decode under the policy
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=jmp_tunix.optimizer(policy, optax.adamw(3e-3)),  # 2. scaler, skip
          eval_every_n_steps=1000, max_steps=max(steps, 1)),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=TOKENS, max_prompt_length=8, kv_cache_size=8 + PARITY_TOKENS,
          temperature=1.0, top_p=1.0, top_k=None, return_logprobs=True))
  cluster = rl_cluster_lib.RLCluster(actor=tiny_qwen3(), tokenizer=CharTokenizer(),
                                     cluster_config=config)
  trainer = jmp_tunix.install_train_step(cluster.actor_trainer)  # 3. the scaled train step
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[reward],
      algo_config=grpo_learner.GRPOConfig(
          num_generations=GENERATIONS, num_iterations=1, beta=0.0, epsilon=0.2,
          policy_loss_fn=jmp_tunix.policy_loss(policy)))  # 4. the trainer's forward
  # tunix logs the aux keys it is told to: the installed step's scale and skip count too.
  trainer.with_rl_metrics_to_log(
      {**trainer.rl_metrics_to_log, "loss_scale": np.min, "loss_scale_skips": np.max})
  if steps:
    # A NumPy array: tunix repeats each prompt per generation with np.repeat (a list of strings
    # would become one array of characters, each prompt one completion).
    learner.train([{"prompts": np.array(PROMPTS[i * BATCH % 32:][:BATCH])}
                   for i in range(steps)])
  return cluster


def parity(cluster) -> jmp_scaler.LogprobParity:
  """The sampler's log-probabilities of the tokens it draws for the 32 prompts against the
  trainer-side forward of the same tokens, under the rollout's policy."""
  out = cluster.generate(prompts=PROMPTS, max_generation_steps=PARITY_TOKENS)
  pad = cluster.rollout.pad_id()
  shape = (len(PROMPTS), PARITY_TOKENS)
  tokens, sampled, mask = np.full(shape, pad, np.int32), np.zeros(shape, np.float32), \
      np.zeros(shape, bool)  # fmt: skip
  for i, (t, logps) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
    t = np.asarray(t)
    n = int(np.argmax(t == pad)) if (t == pad).any() else len(t)  # tunix's trainer stops at a pad
    tokens[i, :n], sampled[i, :n], mask[i, :n] = t[:n], np.asarray(logps)[:n], True
  trainer_side = cluster.rollout.get_per_token_logps(  # the full forward, under the policy
      jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(tokens))
  return jmp_scaler.logprob_parity(jnp.asarray(sampled), trainer_side, jnp.asarray(mask))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3, help="GRPO steps per policy")
  parser.add_argument("--policies", default="f16,bf16", help=f"of {', '.join(POLICIES)}")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, tunix's Qwen3 (2 layers, d=64, vocab 48), "
        f"{BATCH} prompts x {GENERATIONS} completions of {TOKENS} tokens per step")
  for name in args.policies.split(","):
    policy = POLICIES[name]
    start = time.perf_counter()
    cluster = grpo(policy, args.steps)
    if args.steps:
      log = cluster.actor_trainer.metrics_logger  # tunix's, what it logged per step
      rows = zip(*(log.get_metric_history(prefix, metric, "train") for prefix, metric in (
          ("rewards", "score/mean"), ("actor", "loss"), ("actor", "grad_norm"),
          ("actor", "loss_scale"), ("actor", "loss_scale_skips"))), strict=True)
      print(f"\n{name} ({policy}): step  reward    loss       grad_norm  scale    skips")
      for step, (r, loss, grad_norm, scale, skips) in enumerate(rows, 1):
        print(f"{'':>{len(name) + len(policy) + 4}}{step:4d}  {r:6.3f}  {loss:+.3e}  "
              f"{grad_norm:9.4f}  {scale:7g}  {int(skips):5d}")
      metrics = jmp_scaler.to_scalars(jmp_scaler.scale_metrics(cluster.actor_trainer.optimizer))
      print(f"{name}: {metrics['steps']} updates, {metrics['total_skips']} skipped, "
            f"scale {metrics['scale']:g} ({time.perf_counter() - start:.0f} s)")
    print(f"\n{name} ({policy}), {parity(cluster)}")


if __name__ == "__main__":
  main()
