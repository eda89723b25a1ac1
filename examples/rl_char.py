"""GRPO on a pre-trained character-level model, bfloat16 against float16 (docs/tunix.md).

Does bfloat16's sampler-trainer mismatch hurt an RL run that a CPU can make? The task is
verifiable: ``"a+b+c="`` for three digits (1,000 problems, generated here), the answer the
sum's digits then ``<eos>``, the reward 1 for the exact answer and 0 otherwise. The model is
tunix's Qwen3 at its smallest (2 layers, d=64, a 48-character vocabulary), random, then:

1. **pre-trained** here with supervised next-token training in float32 (the answer's tokens,
   tunix's own ``compute_per_token_logps``, ``jmp_scaler.value_and_grad(loss_fn, optimizer)``
   with ``jmp_scaler.NNXOptimizer``), stopped while it is decent but not perfect; the weights
   are cached (``--cache-dir``) so that every run starts from the same ones;
2. **fine-tuned with GRPO** (tunix's ``GRPOLearner``, the recipe of ``examples/tunix_grpo.py``:
   ``jmp_tunix.rollout_engine``, ``optimizer``, ``policy_loss``, ``install_train_step``), once
   under ``p=f32,c=bf16,o=f32`` and once under ``p=f32,c=f16,o=f32`` (dynamic loss scaling),
   from the same weights with the same prompts and the same sampling seeds.

Per step it records the mean reward tunix logged, the loss scale and the skipped steps, and
the sampler against the trainer on that step's own completions (``jmp_scaler.logprob_parity``):
the log-probabilities the sampler drew the tokens with (KV-cache prefill and decode, which tunix
returns with ``return_logprobs=True``) against the trainer's, computed inside the train step
by the call tunix's GRPO loss makes (``compute_per_token_logps``, in the same jitted program as
the gradients), both under the run's policy with the weights of that step: a learner that adds
the sampler's log-probabilities to each train example and a loss registered with tunix
(``"grpo"`` plus the measurement) carry them there. It prints a table per run and a summary,
and plots the reward and the mismatch against the step (``--out``, with matplotlib).

  python examples/rl_char.py                # 1 to 6 minutes on a 2-core CPU, by its load
  python examples/rl_char.py --quick        # a smoke run: a few steps of each

What it measured is in docs/tunix.md, "An RL run". Two things to know when reading it: with
``num_iterations=1`` (tunix's default) GRPO's importance ratio is computed from the trainer's
own forward, so the mismatch enters the update only as off-policy sampling (the tokens come
from the sampler's distribution); and on XLA:CPU the mismatch depends on the shapes: at 16
prompts x 4 completions per step the sampler and the trainer round alike under both policies
(|dlogp| ~2e-7), at the default 32 x 8 bfloat16's appears.

Needs google-tunix: pip install 'jmp_scaler[tunix]'.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_scaler
from jmp_scaler import tunix as jmp_tunix

POLICIES = {"bf16": "p=f32,c=bf16,o=f32", "f16": "p=f32,c=f16,o=f32",
            "f32": "p=f32,c=f32,o=f32"}  # f32: the control, with --policies f32,bf16,f16
PROMPT_LEN, ANSWER_LEN = 8, 3  # "<bos>a+b+c=" left-padded to 8; two digits and <eos>


class CharTokenizer:
  """The 43 characters and 5 specials of examples/tunix_grpo.py: what tunix needs."""

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


TOKENIZER = CharTokenizer()
PROBLEMS = [(f"{a}+{b}+{c}=", str(a + b + c)) for a in range(10) for b in range(10)
            for c in range(10)]
ANSWERS = dict(PROBLEMS)


def tiny_qwen3(seed: int):
  from tunix.models.qwen3 import model as qwen3

  config = qwen3.ModelConfig(
      num_layers=2, vocab_size=48, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
      num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=False,
      shd_config=qwen3.ShardingConfig.get_default_sharding(),
      dtype=jnp.float32, param_dtype=jnp.float32)  # float32 master weights and KV cache
  return qwen3.Qwen3(config, rngs=nnx.Rngs(params=seed))


def reward(prompts, completions, **kwargs):
  """1 for the exact sum (the completion ends at <eos>, or after 3 tokens), 0 otherwise."""
  return [float(completion == ANSWERS[str(prompt)])
          for prompt, completion in zip(prompts, completions, strict=True)]


# ---------------------------------------------------------------- supervised pre-training


def encode(problems):
  """Left-padded prompts (as tunix's sampler pads them) and answers + <eos>, right-padded."""
  prompts = np.zeros((len(problems), PROMPT_LEN), np.int32)
  answers = np.zeros((len(problems), ANSWER_LEN), np.int32)
  for i, (prompt, answer) in enumerate(problems):
    tokens = TOKENIZER.encode(prompt)
    prompts[i, PROMPT_LEN - len(tokens):] = tokens
    answers[i, :len(answer) + 1] = [TOKENIZER.ids[c] for c in answer] + [TOKENIZER.eos_id()]
  return jnp.asarray(prompts), jnp.asarray(answers)


def answer_logps(model, prompts, answers, stop_gradient=True):
  """Per-token log-probabilities of the answers and the logits: tunix's trainer forward."""
  from tunix.rl import common

  graphdef, state = nnx.split(model)
  return common.compute_per_token_logps(graphdef, state, prompts, answers, pad_id=0, eos_id=2,
                                        stop_gradient=stop_gradient, return_logits=True)


@nnx.jit
def evaluate(model, prompts, answers):
  """Greedy accuracy, and the expected reward of sampling at temperature 1 (the probability
  of the answer and <eos>), over the given problems, in float32."""
  logps, logits = answer_logps(model, prompts, answers)
  mask = answers != 0
  greedy = ((jnp.argmax(logits, -1) == answers) | ~mask).all(-1).mean()
  return greedy, jnp.exp(jnp.where(mask, logps, 0.0).sum(-1)).mean()


@nnx.jit
def sft_step(model, optimizer, prompts, answers):
  def loss_fn(model):
    logps, _ = answer_logps(model, prompts, answers, stop_gradient=False)
    mask = answers != 0
    return -jnp.where(mask, logps, 0.0).sum() / mask.sum()

  loss, grads = jmp_scaler.value_and_grad(loss_fn, optimizer)(model)  # float32: scale 1
  optimizer.update(model, grads)
  return loss


def pretrain(args) -> tuple[dict[str, np.ndarray], str]:
  """The pre-trained float32 weights (by parameter path), from the cache or trained now."""
  key = f"s{args.seed}-n{args.pretrain_steps}-b64-lr{args.pretrain_lr:g}-jax{jax.__version__}"
  path = args.cache_dir / f"rl_char-{hashlib.sha1(key.encode()).hexdigest()[:12]}.npz"
  if path.exists():
    with np.load(path) as f:
      return dict(f), f"loaded from {path}"
  model = tiny_qwen3(args.seed)
  tx = optax.chain(jmp_scaler.no_scale(), optax.adamw(args.pretrain_lr))
  optimizer = jmp_scaler.NNXOptimizer(model, tx, wrt=nnx.Param)
  prompts, answers = encode(PROBLEMS)
  rng = np.random.default_rng(args.seed)
  start = time.perf_counter()
  for _ in range(args.pretrain_steps):
    batch = rng.integers(0, len(PROBLEMS), 64)
    sft_step(model, optimizer, prompts[batch], answers[batch])
  weights = to_arrays(model)
  path.parent.mkdir(parents=True, exist_ok=True)
  np.savez(path, **weights)
  return weights, f"trained in {time.perf_counter() - start:.0f} s, cached in {path}"


def to_arrays(model) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def from_arrays(weights: dict[str, np.ndarray], seed: int):
  """A fresh model holding ``weights``."""
  model = tiny_qwen3(seed)
  state = nnx.state(model, nnx.Param)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  if sorted(weights) != sorted(jax.tree_util.keystr(p) for p, _ in flat):
    raise ValueError("the cached weights do not fit the model: delete the cache")
  leaves = [jnp.asarray(weights[jax.tree_util.keystr(p)]) for p, _ in flat]
  nnx.update(model, jax.tree.unflatten(treedef, leaves))
  return model


# ---------------------------------------------------------------- GRPO

#: What the measuring loss adds to tunix's aux (logged per step): logprob_parity's figures.
MISMATCH = {"mismatch/mean": np.mean, "mismatch/max": np.max, "mismatch/out1": np.mean,
            "mismatch/out01": np.mean}


class Recorder:
  """``cluster.generate`` with a sampling seed per step (the same under every policy), which
  keeps the sampler's log-probabilities of the tokens it drew, padded as GRPO pads them."""

  def __init__(self, cluster, seed: int):
    self.cluster, self.generate, self.seed, self.calls = cluster, cluster.generate, seed, 0
    self.sampled: tuple[np.ndarray, np.ndarray] | None = None

  def __call__(self, prompts, **kwargs):
    self.cluster.cluster_config.rollout_config.seed = self.seed * 10_007 + self.calls
    self.calls += 1
    out = self.generate(prompts=prompts, **kwargs)
    pad = self.cluster.rollout.pad_id()
    logps, mask = np.zeros((len(out.tokens), ANSWER_LEN), np.float32), \
        np.zeros((len(out.tokens), ANSWER_LEN), bool)  # fmt: skip
    for i, (t, lp) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
      t = np.asarray(t)
      n = int(np.argmax(t == pad)) if (t == pad).any() else len(t)  # a sampled pad ends it
      logps[i, :n], mask[i, :n] = np.asarray(lp)[:n], True
    self.sampled = logps, mask
    return out


@functools.cache
def measuring_grpo():
  """tunix's GRPO whose train step also measures the mismatch, on tunix's extension points.

  The learner (one overridden method) adds the sampler's log-probabilities to each train
  example; the loss ``"grpo+mismatch"`` (registered with tunix) is tunix's ``"grpo"`` plus
  ``jmp_scaler.logprob_parity`` of them against the trainer's per-token log-probabilities,
  computed by the call tunix's loss makes, in the same jitted train step (under the policy
  when wrapped by ``jmp_tunix.policy_loss``). Returns the learner class and the loss name."""
  import flax
  from tunix.rl import common, function_registry
  from tunix.rl.grpo import grpo_learner

  @flax.struct.dataclass(frozen=True)
  class SampledExample(grpo_learner.TrainExample):
    sampler_logps: jax.Array | None = None
    sampler_mask: jax.Array | None = None

  class Learner(grpo_learner.GRPOLearner):
    def _generate_and_compute_advantage(self, training_input, mode=None):
      kwargs = {} if mode is None else {"mode": mode}
      example = super()._generate_and_compute_advantage(training_input, **kwargs)
      logps, mask = self.rl_cluster.generate.sampled  # the Recorder's, of this rollout
      fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
      return SampledExample(**fields, sampler_logps=jnp.asarray(logps),
                            sampler_mask=jnp.asarray(mask))

  grpo_loss = function_registry.get_policy_loss_fn("grpo")

  def loss_fn(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    loss, aux = grpo_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs)
    graphdef, state = nnx.split(model)
    trainer_logps, _ = common.compute_per_token_logps(  # as tunix's GRPO loss calls it
        graphdef, state, prompt_tokens=train_example.prompt_ids,
        completion_tokens=train_example.completion_ids, pad_id=pad_id, eos_id=eos_id,
        stop_gradient=False, return_logits=True, segment_ids=None, segment_positions=None,
        temperature=algo_config.temperature)
    p = jmp_scaler.logprob_parity(train_example.sampler_logps,
                                  jax.lax.stop_gradient(trainer_logps), train_example.sampler_mask)
    figures = (p.mean_abs_dlogp, p.max_abs_dlogp, p.outside[1], p.outside[0])
    return loss, {**aux, **dict(zip(MISMATCH, figures, strict=True))}

  function_registry.register_policy_loss_fn("grpo+mismatch")(loss_fn)
  return Learner, "grpo+mismatch"


def grpo(name: str, weights, batches, args) -> dict:
  """GRPO from ``weights`` under POLICIES[name], one step per batch of prompts."""
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  policy = POLICIES[name]
  start = time.perf_counter()
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={role: mesh for role in roles},
      rollout_engine=jmp_tunix.rollout_engine(policy),
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=jmp_tunix.optimizer(policy, optax.adamw(args.lr)),
          eval_every_n_steps=10**6, max_steps=len(batches)),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=ANSWER_LEN, max_prompt_length=PROMPT_LEN,
          kv_cache_size=args.kv_cache, temperature=1.0, top_p=1.0, top_k=None,
          return_logprobs=True))
  model = from_arrays(weights, args.seed)
  cluster = rl_cluster_lib.RLCluster(actor=model, tokenizer=TOKENIZER, cluster_config=config)
  trainer = jmp_tunix.install_train_step(cluster.actor_trainer)
  cluster.generate = Recorder(cluster, args.seed)
  learner_class, loss_name = measuring_grpo()
  learner = learner_class(
      rl_cluster=cluster, reward_fns=[reward],
      algo_config=grpo_learner.GRPOConfig(
          num_generations=args.generations, num_iterations=1, beta=0.0, epsilon=0.2,
          policy_loss_fn=jmp_tunix.policy_loss(policy, base=loss_name)))
  trainer.with_rl_metrics_to_log({**trainer.rl_metrics_to_log, **MISMATCH,
                                  "loss_scale": np.min, "loss_scale_skips": np.max})
  # tunix repeats each prompt with jax.tree.map(np.repeat): prompts in an array, not a list
  learner.train([{"prompts": np.array(batch)} for batch in batches])
  log = cluster.actor_trainer.metrics_logger
  history = {metric: np.asarray(log.get_metric_history(prefix, metric, "train"), np.float64)
             for prefix, metric in (("rewards", "score/mean"), ("actor", "loss_scale"),
                                    ("actor", "loss_scale_skips"),
                                    *(("actor", key) for key in MISMATCH))}
  final = jmp_scaler.to_scalars(jmp_scaler.scale_metrics(cluster.actor_trainer.optimizer))
  return {"name": name, "policy": policy, "reward": history["score/mean"],
          "scale": history["loss_scale"], "skips": history["loss_scale_skips"],
          "mismatch": {key.split("/")[1]: history[key] for key in MISMATCH}, "final": final,
          "eval": [float(v) for v in evaluate(cluster.actor_trainer.model, *encode(PROBLEMS))],
          "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------- report


def print_run(run: dict) -> None:
  print(f"\n{run['name']} ({run['policy']})")
  print(" step  reward  |dlogp| mean  |dlogp| max  outside 1%  outside 0.1%   scale  skips")
  m = run["mismatch"]
  for i, (r, scale, skips) in enumerate(zip(run["reward"], run["scale"], run["skips"],
                                            strict=True)):
    print(f"{i + 1:5d}  {r:6.3f}  {m['mean'][i]:12.2e}  {m['max'][i]:11.2e}  "
          f"{100 * m['out1'][i]:9.2f}%  {100 * m['out01'][i]:10.2f}%  {scale:6g}  "
          f"{int(skips):5d}")


def summary(runs, before) -> None:
  k = max(1, min(10, len(runs[0]["reward"]) // 3))
  print(f"\nsummary (reward: mean over the first and the last {k} steps; greedy accuracy and "
        "expected reward at temperature 1 over the 1,000 problems, float32 forward; "
        "mismatch: mean over the steps)")
  print("run   reward first  reward last  greedy  expected  |dlogp| mean  outside 1%  "
        "skips   scale  seconds")
  print(f"{'start':<5} {'':>12}  {'':>11}  {100 * before[0]:5.1f}%  {100 * before[1]:7.1f}%")
  for run in runs:
    m = run["mismatch"]
    print(f"{run['name']:<5} {np.mean(run['reward'][:k]):12.3f}  "
          f"{np.mean(run['reward'][-k:]):11.3f}  {100 * run['eval'][0]:5.1f}%  "
          f"{100 * run['eval'][1]:7.1f}%  {np.mean(m['mean']):12.2e}  "
          f"{100 * np.mean(m['out1']):9.2f}%  "
          f"{run['final']['total_skips']:5d}  {run['final']['scale']:6g}  "
          f"{run['seconds']:7.0f}")


STYLES = {"bf16": dict(color="tab:orange", ls="-"), "f16": dict(color="tab:blue", ls="--"),
          "f32": dict(color="tab:gray", ls=":")}


def plot(runs, out: pathlib.Path) -> bool:
  """The reward and the mismatch against the step, every run; False without matplotlib."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  titles = ("GRPO on a+b+c=: mean reward", "sampler vs trainer: mean |dlogp|",
            "tokens with ratio outside [0.99, 1.01]")
  for run in runs:
    steps = np.arange(1, len(run["reward"]) + 1)
    style, label = STYLES[run["name"]], f"{run['name']} ({run['policy']})"
    k = max(1, min(10, len(steps) // 5))
    smooth = np.convolve(run["reward"], np.ones(k) / k, mode="valid")
    axes[0].plot(steps, run["reward"], alpha=0.25, lw=0.8, color=style["color"])
    axes[0].plot(steps[k - 1:], smooth, label=f"{label}, mean of {k}", **style)
    axes[1].plot(steps, run["mismatch"]["mean"], label=label, **style)
    axes[2].plot(steps, 100 * run["mismatch"]["out1"], label=label, **style)
  axes[0].set(xlabel="GRPO step", ylabel="mean reward (exact sum)", title=titles[0])
  axes[1].set(xlabel="GRPO step", ylabel="mean |dlogp| per token", yscale="log",
              title=titles[1])
  axes[2].set(xlabel="GRPO step", ylabel="% of sampled tokens", title=titles[2])
  for ax in axes:
    ax.legend(fontsize=7)
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=80, metadata={"Title": " | ".join(titles)})
  plt.close(fig)
  return True


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100, help="GRPO steps per run")
  parser.add_argument("--seed", type=int, default=0, help="model, data and sampling seed")
  parser.add_argument("--prompts", type=int, default=32, help="prompts per GRPO step")
  parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
  parser.add_argument("--lr", type=float, default=1e-3, help="GRPO's AdamW learning rate")
  parser.add_argument("--pretrain-steps", type=int, default=150, help="supervised steps")
  parser.add_argument("--pretrain-lr", type=float, default=3e-3)
  parser.add_argument("--kv-cache", type=int, default=PROMPT_LEN + ANSWER_LEN + 256,
                      help="the sampler's KV cache (tunix's CLI: prompt + answer + 256)")
  parser.add_argument("--policies", default="bf16,f16", help=f"of {', '.join(POLICIES)}")
  parser.add_argument("--cache-dir", type=pathlib.Path,
                      default=pathlib.Path(tempfile.gettempdir()) / "jmp_scaler_rl_char",
                      help="where the pre-trained weights are cached")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("rl_char.png"),
                      help="the plot (PNG)")
  parser.add_argument("--quick", action="store_true",
                      help="a smoke run: 20 pre-training steps, 3 GRPO steps of 4 prompts")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.prompts, args.pretrain_steps = 3, 4, 20
  if args.steps < 1 or args.prompts < 1 or args.generations < 2:
    parser.error("--steps and --prompts must be at least 1, --generations at least 2")
  if not set(args.policies.split(",")) <= set(POLICIES):
    parser.error(f"--policies: a comma-separated list of {', '.join(POLICIES)}")

  print(f"jax {jax.__version__}; task a+b+c= ({len(PROBLEMS)} problems, reward 1 for the "
        "exact sum); tunix's Qwen3, 2 layers, d=64, vocab 48")
  weights, how = pretrain(args)
  before = [float(v) for v in evaluate(from_arrays(weights, args.seed), *encode(PROBLEMS))]
  print(f"pre-trained ({args.pretrain_steps} float32 steps of 64 problems, {how}): greedy "
        f"accuracy {100 * before[0]:.1f}%, expected reward at temperature 1 "
        f"{100 * before[1]:.1f}%")
  rng = np.random.default_rng(args.seed)
  batches = [[PROBLEMS[i][0] for i in rng.integers(0, len(PROBLEMS), args.prompts)]
             for _ in range(args.steps)]
  print(f"GRPO: {args.steps} steps of {args.prompts} prompts x {args.generations} "
        f"completions (<= {ANSWER_LEN} tokens, temperature 1), AdamW {args.lr:g}, the same "
        "prompts and sampling seeds under each policy")
  runs = []
  for name in args.policies.split(","):
    runs.append(grpo(name, weights, batches, args))
    print_run(runs[-1])
  summary(runs, before)
  if plot(runs, args.out):
    print(f"\nplot: {args.out}")
  else:
    print("\nno plot: matplotlib is not installed (pip install matplotlib)")
  return runs


if __name__ == "__main__":
  main()
