"""What ``jmp_scaler.autocast`` costs against the same model hand-annotated with ``dtype=``.

For each model, three training steps (float32 master parameters, Adam, ``dynamic_scale``,
``jmp_scaler.TrainState``) are compiled and timed in one process:

  hand       the Flax model written with ``dtype=compute_dtype`` on every layer
  autocast   the same model written in float32 (no dtype anywhere), its ``apply``
             transformed by ``jmp_scaler.autocast(apply, policy)``
  fp8        the same, by ``jmp_scaler.autocast(apply, policy, rules={"dot_general": "fp8"})``:
             every matmul an fp8 GEMM with per-tensor current scaling (convolutions stay in
             the compute dtype); XLA:CPU has no fp8 GEMM and upcasts the fp8 operands

Rounds are interleaved (hand, autocast, fp8, then the reverse order, ...) so all see the same
machine load; the table gives the median step time over rounds and the median over rounds of
the per-round ratios autocast / hand and fp8 / autocast, with their interquartile ranges.
Compile time is the median of ``--compiles`` fresh lower+compile runs of each step. From the
compiled HLO it counts the dots and convolutions and how many run in the compute dtype
(XLA:CPU computes float16 dots in float32 between converts, so on CPU the lowered StableHLO is
counted as well, and the lowered dots with fp8 operands).

  python benchmarks/bench_autocast.py                   # CNN and MLP, float16 compute
  python benchmarks/bench_autocast.py --policy p=f32,c=bf16,o=f32 --rounds 21
  python benchmarks/bench_autocast.py --quick           # tiny sizes, a few seconds

``--model gpt`` trains instead (issue 12): the character-level GPT of bench_bf16.py, written in
plain float32 code with no dtype anywhere, for ``--gpt-steps`` steps and ``--seeds`` seeds, in
float32, with its loss function transformed by ``jmp_scaler.autocast(fn, policy)``, and by
``jmp_scaler.autocast(fn, policy, rules={"dot_general": "fp8"})`` (every matmul in fp8, the
tied output projection included), all through ``jmp_scaler.TrainState`` with
``optax.chain(jmp_scaler.dynamic_scale(), optax.adam)`` and ``jmp_scaler.value_and_grad``. The
table gives the final test loss and accuracy (mean +- sd over seeds), the skipped steps, and
the difference from float32 in float32 seed sds; then the per-seed differences (autocast -
float32, fp8 - autocast), and each setup's compile time and step time (all seeds' steps,
compile excluded) with the ratio fp8 / autocast.

  python benchmarks/bench_autocast.py --model gpt       # 3 seeds x 1500 steps
  python benchmarks/bench_autocast.py --model gpt --policy p=f32,c=bf16,o=f32   # fp8 vs bf16
  python benchmarks/bench_autocast.py --model gpt --quick

``--block-scaled`` adds the block-scaled rules to ``--model gpt`` (issue 39): ``"mxfp8"``,
``"nvfp4"`` and NVFP4 without its random Hadamard transform and stochastic rounding
(``Nvfp4Recipe(random_hadamard=False, stochastic_rounding=False)``), every matmul included,
and NVFP4 with its recipe's bf16 regions (attention's batched matmuls, the last block, the
head); each prints its per-seed loss relative to the autocast (bf16) row, same draws per seed.

  python benchmarks/bench_autocast.py --model gpt --policy p=f32,c=bf16,o=f32 --block-scaled
      --gpt-steps 1000 --gpt-layers 4 --d-model 64 --seeds 3    # (one line) docs/fp8.md's table
  ... --block-scaled --block-setups "nvfp4 recipe"            # of the four, only that row

``--model losses`` measures what running the ops fed only to float32 ops in float32 costs
(docs/autocast.md, "What the casts already in your function mean", point 4): the value and
gradient of six losses of float16 predictions (mse, l1, huber, BCE-with-logits, Poisson NLL,
hinge: their ``sub``/``abs``/``mul`` run in float32 under autocast), against the same code
run as written (those ops in float16, jnp's reductions upcasting), rounds interleaved.

  python benchmarks/bench_autocast.py --model losses    # 1024 x 1024 predictions
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_scaler
from jmp_scaler.precision._autocast import autocast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class CNN(nn.Module):
  width: int = 32
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = nn.Conv(self.width * 2**i, (3, 3), strides=2 if i else 1, dtype=self.dtype)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=True, dtype=self.dtype)(x))
    return nn.Dense(10, dtype=self.dtype)(x.mean((1, 2)))


class MLP(nn.Module):
  width: int = 1024
  depth: int = 4
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.gelu(nn.Dense(self.width, dtype=self.dtype)(x))
    return nn.Dense(10, dtype=self.dtype)(x)


def make_step(apply_fn, policy):
  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, x, y):
    scale = jmp_scaler.get_scale(state.opt_state)

    def loss_fn(params):
      logits = policy.cast_to_output(state.apply_fn({**state.extra, "params": params}, x))
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * scale

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss / scale

  return step


class State(jmp_scaler.TrainState):
  extra: Any = None


def hlo_counts(text: str, half: str) -> tuple[int, int]:
  """(dots and convolutions, of which in ``half``) in compiled HLO text."""
  ops = re.findall(r"= (\w+)\[[^\]]*\][^ ]* (dot|convolution)\(", text)
  return len(ops), sum(dt == half for dt, _ in ops)


def lowered_counts(text: str, half: str) -> tuple[int, int]:
  """The same count in lowered StableHLO (first operand's element type)."""
  ops = re.findall(r"stablehlo\.(?:dot_general|convolution).* : \(tensor<(?:[\d?]+x)*(\w+)>", text)
  return len(ops), sum(dt == half for dt in ops)


def lowered_fp8_dots(text: str) -> int:
  """The lowered dots whose operands are fp8."""
  return len(re.findall(r"stablehlo\.dot_general.* : \(tensor<(?:[\d?]+x)*f8E", text))


def f32_ops_sent_half(text: str, half: str) -> int:
  """Exponentials, logarithms and reductions the rules keep in float32 found in ``half``."""
  pat = rf"stablehlo\.(?:exponential|log|log_plus_one|reduce)\b.* : \(?tensor<(?:[\d?]+x)*{half}>"
  return len(re.findall(pat, text))


def bench_model(name, model_cls, kwargs, x, policy, args):
  half = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[policy.compute_dtype.name]
  y = jnp.zeros(x.shape[0], jnp.int32)
  ref = model_cls(**kwargs)
  variables = jax.jit(ref.init)(jax.random.key(0), x)
  extra = {k: v for k, v in variables.items() if k != "params"}
  tx = optax.chain(jmp_scaler.dynamic_scale(init_scale=2.0**10), optax.adam(1e-4))
  variants = {  # factories: each compile gets a fresh function, autocast's trace included
      "hand": lambda: model_cls(**kwargs, dtype=policy.compute_dtype).apply,
      "autocast": lambda: autocast(ref.apply, policy),
      "fp8": lambda: autocast(ref.apply, policy, rules={"dot_general": "fp8"}),
  }
  rows = {}
  for label, new_apply in variants.items():
    make = lambda apply_fn: State.create(
        apply_fn=apply_fn, params=jax.tree.map(jnp.copy, variables["params"]), tx=tx,
        extra=jax.tree.map(jnp.copy, extra),
    )  # fmt: skip
    compiles = []
    for _ in range(args.compiles):
      apply_fn = new_apply()
      step = make_step(apply_fn, policy)  # a fresh function: no cache
      t0 = time.perf_counter()
      lowered = step.lower(make(apply_fn), x, y)
      compiled = lowered.compile()
      compiles.append(time.perf_counter() - t0)
    text = compiled.as_text()
    low = lowered.as_text()
    rows[label] = {
        "step": step, "state": make(apply_fn), "times": [], "compile": statistics.median(compiles),
        "hlo": hlo_counts(text, half), "lowered": lowered_counts(low, half),
        "f32_in_half": f32_ops_sent_half(low, half), "fp8": lowered_fp8_dots(low),
    }  # fmt: skip
    rows[label]["state"], loss = step(rows[label]["state"], x, y)  # warm up
    jax.block_until_ready(loss)
  ratios, fp8_ratios = [], []
  for r in range(args.rounds):
    order = list(rows) if r % 2 == 0 else list(rows)[::-1]
    per = {}
    for label in order:
      row = rows[label]
      t0 = time.perf_counter()
      for _ in range(args.steps):
        row["state"], loss = row["step"](row["state"], x, y)
      jax.block_until_ready(loss)
      per[label] = (time.perf_counter() - t0) / args.steps
      row["times"].append(per[label])
    ratios.append(per["autocast"] / per["hand"])
    fp8_ratios.append(per["fp8"] / per["autocast"])
  q = np.percentile(ratios, [25, 50, 75])
  print(f"\n{name}  policy {policy}  backend {jax.default_backend()}  rounds {args.rounds} "
        f"x {args.steps} steps")  # fmt: skip
  print(f"{'variant':10} {'step ms':>9} {'compile s':>10} {'HLO dots+convs in ' + half:>24} "
          f"{'lowered':>10} {'f32 ops in ' + half:>13} {'fp8 dots':>9}")  # fmt: skip
  for label, row in rows.items():
    n, h = row["hlo"]
    ln, lh = row["lowered"]
    print(f"{label:10} {1e3 * statistics.median(row['times']):9.3f} {row['compile']:10.2f} "
          f"{f'{h}/{n}':>24} {f'{lh}/{ln}':>10} {row['f32_in_half']:>13} "
          f"{row['fp8']:>9}")  # fmt: skip
  print(f"ratio autocast/hand: step {q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}), "
        f"compile {rows['autocast']['compile'] / rows['hand']['compile']:.3f}")  # fmt: skip
  q8 = np.percentile(fp8_ratios, [25, 50, 75])
  emulated = "  (emulated: XLA:CPU upcasts fp8 operands)" if jax.default_backend() == "cpu" else ""
  print(f"ratio fp8/autocast: step {q8[1]:.3f} (IQR {q8[0]:.3f}-{q8[2]:.3f}), "
        f"compile {rows['fp8']['compile'] / rows['autocast']['compile']:.3f}{emulated}")
  return q[1]


def composite_losses(p, t):
  """Six losses of predictions ``p`` and targets ``t`` built from elementwise ops."""
  return (optax.squared_error(p, t).mean() + jnp.mean(jnp.abs(p - t))
          + optax.huber_loss(p, t).mean() + optax.sigmoid_binary_cross_entropy(p, t > 0).mean()
          + jnp.mean(jnp.exp(p) - t * p) + jnp.mean(jnp.maximum(0.0, 1.0 - p * t)))  # fmt: skip


def bench_losses(args, policy):
  """autocast(losses) against the same losses as written, on float16 predictions."""
  side = 64 if args.quick else 1024
  rng = np.random.default_rng(0)
  p, t = (jnp.asarray(rng.normal(size=(side, side)), policy.compute_dtype) for _ in range(2))
  variants = {"as written": lambda: composite_losses,
              "autocast": lambda: autocast(composite_losses, policy)}  # fmt: skip
  rows = {}
  for label, new_fn in variants.items():
    compiles = []
    for _ in range(args.compiles):
      step = jax.jit(jax.value_and_grad(new_fn()))  # a fresh function: no cache
      t0 = time.perf_counter()
      compiled = step.lower(p, t).compile()
      compiles.append(time.perf_counter() - t0)
    jax.block_until_ready(compiled(p, t))
    rows[label] = {"fn": compiled, "compile": statistics.median(compiles), "times": []}
  ratios = []
  for r in range(args.rounds):
    per = {}
    for label in (["as written", "autocast"] if r % 2 == 0 else ["autocast", "as written"]):
      t0 = time.perf_counter()
      for _ in range(args.steps):
        out = rows[label]["fn"](p, t)
      jax.block_until_ready(out)
      per[label] = (time.perf_counter() - t0) / args.steps
      rows[label]["times"].append(per[label])
    ratios.append(per["autocast"] / per["as written"])
  q = np.percentile(ratios, [25, 50, 75])
  print(f"\ncomposite losses, value and gradient, {side} x {side} {policy.compute_dtype.name} "
        f"predictions  backend {jax.default_backend()}  rounds {args.rounds} x {args.steps}")
  print(f"{'variant':12} {'step ms':>9} {'compile s':>10}")
  for label, row in rows.items():
    print(f"{label:12} {1e3 * statistics.median(row['times']):9.3f} {row['compile']:10.2f}")
  print(f"ratio autocast/as written: step {q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}), "
        f"compile {rows['autocast']['compile'] / rows['as written']['compile']:.3f}")
  return q[1]


BLOCK_SETUPS = ("mxfp8", "nvfp4", "nvfp4 -rht -sr", "nvfp4 recipe")


def block_setups(task, policy):
  """``--block-scaled``'s loss functions, by label: every matmul in MXFP8, in NVFP4, in NVFP4
  without its random Hadamard transform and stochastic rounding, and NVFP4's recipe: attention's
  batched matmuls, the last block and the head in the policy's compute dtype, by nested
  autocast regions (``keep=`` of bench_bf16's char-GPT; a region with no rule)."""
  plain = jmp_scaler.Nvfp4Recipe(random_hadamard=False, stochastic_rounding=False)
  out = {label: autocast(task.loss_acc, policy, rules={"dot_general": rule})
         for label, rule in (("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("nvfp4 -rht -sr", plain))}
  region = functools.partial(jmp_scaler.autocast, policy=policy)
  out["nvfp4 recipe"] = autocast(functools.partial(task.loss_acc, keep=region), policy,
                                 rules={"dot_general": "nvfp4"})
  return out


def train_gpt(args, policy):
  """The char-GPT of bench_bf16.py in float32 and under autocast; prints the quality table."""
  import bench_bf16  # the model and data: plain float32 code, no dtype annotations

  task = bench_bf16.gpt_task(argparse.Namespace(
      seq=args.seq, d_model=args.d_model, gpt_layers=args.gpt_layers, gpt_batch=args.gpt_batch,
      gpt_steps=args.gpt_steps, gpt_lr=args.gpt_lr))  # fmt: skip
  xtr, ytr = jnp.asarray(task.x_train), jnp.asarray(task.y_train)
  xte, yte = jnp.asarray(task.x_test), jnp.asarray(task.y_test)
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.adam(task.lr))
  auto, fp8 = f"autocast {policy}", f"fp8 {policy}"
  setups = {"float32": task.loss_acc, auto: autocast(task.loss_acc, policy),
            fp8: autocast(task.loss_acc, policy, rules={"dot_general": "fp8"})}
  if getattr(args, "block_scaled", False):
    wanted = {w.strip() for w in args.block_setups.split(",")} if args.block_setups else None
    for label, fn in block_setups(task, policy).items():
      if wanted is None or label in wanted:
        setups[f"{label} {policy}"] = fn

  def make_train(apply_fn):
    def loss_fn(params, x, y):
      return apply_fn(params, x, y)[0]

    @jax.jit
    def train(seed):
      state = jmp_scaler.TrainState.create(apply_fn=apply_fn, params=task.init(
          jax.random.key(seed)), tx=tx)  # fmt: skip

      def body(state, i):
        key = jax.random.fold_in(jax.random.key(seed + 1000), i)
        idx = jax.random.randint(key, (task.batch,), 0, len(ytr))
        _, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params, xtr[idx], ytr[idx])
        return state.apply_gradients(grads=grads), None

      state, _ = jax.lax.scan(body, state, jnp.arange(task.steps))
      loss, acc = state.apply_fn(state.params, xte, yte)
      metrics = jmp_scaler.scale_metrics(state.opt_state)
      return loss, acc, metrics["total_skips"], metrics["scale"]

    return train

  rows = {}
  for label, apply_fn in setups.items():
    t0 = time.perf_counter()
    train = make_train(apply_fn).lower(0).compile()
    t1 = time.perf_counter()
    out = [jax.device_get(train(seed)) for seed in range(args.seeds)]
    t2 = time.perf_counter()
    rows[label] = {
        "loss": np.array([float(o[0]) for o in out]), "acc": np.array([float(o[1]) for o in out]),
        "skips": [int(o[2]) for o in out], "scale": [float(o[3]) for o in out],
        "time": t2 - t0, "compile": t1 - t0, "step": (t2 - t1) / (args.seeds * task.steps),
    }  # fmt: skip
  ref = rows["float32"]["loss"]
  sd = ref.std(ddof=1) if len(ref) > 1 else float("nan")
  print(f"\nchar-GPT (d={args.d_model}, seq {args.seq}, {args.gpt_layers} layers, 4 heads, batch "
        f"{args.gpt_batch})  {args.gpt_steps} steps at Adam lr {args.gpt_lr}  {args.seeds} seeds"
        f"  backend {jax.default_backend()}")  # fmt: skip
  print(f"{'setup':28} {'test loss':>17} {'test acc':>15} {'skipped steps':>15} "
        f"{'final scale':>12} {'loss - f32 (f32 sds)':>21} {'s':>6}")  # fmt: skip
  for label, row in rows.items():
    loss, acc = row["loss"], row["acc"]
    diff = (loss.mean() - ref.mean()) / sd
    print(f"{label:28} {loss.mean():8.4f} +- {loss.std(ddof=1) if len(loss) > 1 else 0:.4f} "
          f"{acc.mean():7.4f} +- {acc.std(ddof=1) if len(acc) > 1 else 0:.4f} "
          f"{'/'.join(map(str, row['skips'])):>15} {statistics.median(row['scale']):12.0f} "
          f"{diff:+21.2f} {row['time']:6.1f}")  # fmt: skip
  paired = rows[auto]["loss"] - ref
  print(f"per-seed loss difference autocast - float32: "
        f"{' '.join(f'{d:+.4f}' for d in paired)}")  # fmt: skip
  paired8 = rows[fp8]["loss"] - rows[auto]["loss"]
  sd_auto = rows[auto]["loss"].std(ddof=1) if args.seeds > 1 else float("nan")
  print(f"per-seed loss difference fp8 - autocast: {' '.join(f'{d:+.4f}' for d in paired8)}"
        f"  (mean {paired8.mean() / sd_auto:+.2f} autocast sds)")  # fmt: skip
  for label, row in rows.items():  # same draws per seed: the paired relative difference
    if label.split()[0] in ("mxfp8", "nvfp4"):
      rel = 100 * (row["loss"] / rows[auto]["loss"] - 1)
      print(f"per-seed loss vs autocast, {label}: {' '.join(f'{d:+.2f}%' for d in rel)}  "
            f"(mean {rel.mean():+.2f}%)")  # fmt: skip
  print("step ms (compile s): " + ", ".join(
      f"{label.removesuffix(f' {policy}')} {1e3 * row['step']:.2f} ({row['compile']:.1f})"
      for label, row in rows.items()) + f"; ratio fp8/autocast: step "
      f"{rows[fp8]['step'] / rows[auto]['step']:.3f}, compile "
      f"{rows[fp8]['compile'] / rows[auto]['compile']:.3f}")  # fmt: skip
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--policy", default="p=f32,c=f16,o=f32")
  parser.add_argument("--model", choices=["cnn", "mlp", "all", "gpt", "losses"], default="all",
                      help="all: the CNN and MLP timings; gpt: train the char-GPT instead; "
                           "losses: the cost of float32-fed elementwise ops")
  parser.add_argument("--rounds", type=int, default=11)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--compiles", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds")
  parser.add_argument("--seeds", type=int, default=3, help="--model gpt: seeds per setup")
  parser.add_argument("--gpt-steps", type=int, default=None, help="1500 (30 with --quick)")
  parser.add_argument("--gpt-lr", type=float, default=3e-3)
  parser.add_argument("--gpt-batch", type=int, default=16)
  parser.add_argument("--seq", type=int, default=None, help="32 (16 with --quick)")
  parser.add_argument("--d-model", type=int, default=None, help="32 (16 with --quick)")
  parser.add_argument("--gpt-layers", type=int, default=None, help="2 (1 with --quick)")
  parser.add_argument("--block-scaled", action="store_true",
                      help="--model gpt: also the mxfp8 and nvfp4 rules")
  parser.add_argument("--block-setups", default="",
                      help="with --block-scaled: only these of 'mxfp8', 'nvfp4', "
                           "'nvfp4 -rht -sr', 'nvfp4 recipe' (comma-separated)")
  args = parser.parse_args(argv)
  unknown = {w.strip() for w in args.block_setups.split(",")} - set(BLOCK_SETUPS) - {""}
  if unknown:
    parser.error(f"--block-setups {args.block_setups!r}: {sorted(unknown)} not among "
                 f"{list(BLOCK_SETUPS)}")
  policy = jmp_scaler.get_policy(args.policy)
  if args.quick:
    args.rounds, args.steps, args.compiles = 3, 2, 1
  if args.gpt_steps is None:
    args.gpt_steps = 30 if args.quick else 1500
  for name, full, quick in (("seq", 32, 16), ("d_model", 32, 16), ("gpt_layers", 2, 1)):
    if getattr(args, name) is None:
      setattr(args, name, quick if args.quick else full)
  if args.model == "gpt":
    train_gpt(args, policy)
    return 0
  if args.model == "losses":
    bench_losses(args, policy)
    return 0
  batch = 8 if args.quick else 64
  rng = np.random.default_rng(0)
  if args.model in ("cnn", "all"):
    side, width = (8, 4) if args.quick else (32, 32)
    x = jnp.asarray(rng.normal(size=(batch, side, side, 3)), jnp.float32)
    bench_model("CNN (3 x Conv+BN, Dense)", CNN, {"width": width}, x, policy, args)
  if args.model in ("mlp", "all"):
    width = 32 if args.quick else 1024
    x = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)
    bench_model(f"MLP (4 x {width}, gelu)", MLP, {"width": width}, x, policy, args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
