"""What ``jmp_scaler.autocast`` costs against the same model hand-annotated with ``dtype=``.

For each model, two training steps (float32 master parameters, Adam, ``dynamic_scale``,
``jmp_scaler.TrainState``) are compiled and timed in one process:

  hand       the Flax model written with ``dtype=compute_dtype`` on every layer
  autocast   the same model written in float32 (no dtype anywhere), its ``apply``
             transformed by ``jmp_scaler.autocast(apply, policy)``

Rounds are interleaved (hand, autocast, autocast, hand, ...) so both see the same machine
load; the table gives the median step time over rounds and the median over rounds of the
per-round ratio autocast / hand, with its interquartile range. Compile time is the median of
``--compiles`` fresh lower+compile runs of each step. From the compiled HLO it counts the
dots and convolutions and how many run in the compute dtype (XLA:CPU computes float16 dots in
float32 between converts, so on CPU the lowered StableHLO is counted as well).

  python benchmarks/bench_autocast.py                   # CNN and MLP, float16 compute
  python benchmarks/bench_autocast.py --policy p=f32,c=bf16,o=f32 --rounds 21
  python benchmarks/bench_autocast.py --quick           # tiny sizes, a few seconds
"""

from __future__ import annotations

import argparse
import functools
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
from jmp_scaler._autocast_fn import autocast


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
  variants = {
      "hand": model_cls(**kwargs, dtype=policy.compute_dtype).apply,
      "autocast": autocast(ref.apply, policy),
  }
  rows = {}
  for label, apply_fn in variants.items():
    make = lambda apply_fn=apply_fn: State.create(
        apply_fn=apply_fn, params=jax.tree.map(jnp.copy, variables["params"]), tx=tx,
        extra=jax.tree.map(jnp.copy, extra),
    )  # fmt: skip
    compiles = []
    for _ in range(args.compiles):
      step = make_step(apply_fn, policy)  # a fresh function: no cache
      t0 = time.perf_counter()
      lowered = step.lower(make(), x, y)
      compiled = lowered.compile()
      compiles.append(time.perf_counter() - t0)
    text = compiled.as_text()
    low = lowered.as_text()
    rows[label] = {
        "step": step, "state": make(), "times": [], "compile": statistics.median(compiles),
        "hlo": hlo_counts(text, half), "lowered": lowered_counts(low, half),
        "f32_in_half": f32_ops_sent_half(low, half),
    }  # fmt: skip
    rows[label]["state"], loss = step(rows[label]["state"], x, y)  # warm up
    jax.block_until_ready(loss)
  ratios = []
  for r in range(args.rounds):
    order = ["hand", "autocast"] if r % 2 == 0 else ["autocast", "hand"]
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
  q = np.percentile(ratios, [25, 50, 75])
  print(f"\n{name}  policy {policy}  backend {jax.default_backend()}  rounds {args.rounds} "
        f"x {args.steps} steps")  # fmt: skip
  print(f"{'variant':10} {'step ms':>9} {'compile s':>10} {'HLO dots+convs in ' + half:>24} "
          f"{'lowered':>10} {'f32 ops in ' + half:>13}")  # fmt: skip
  for label, row in rows.items():
    n, h = row["hlo"]
    ln, lh = row["lowered"]
    print(f"{label:10} {1e3 * statistics.median(row['times']):9.3f} {row['compile']:10.2f} "
          f"{f'{h}/{n}':>24} {f'{lh}/{ln}':>10} {row['f32_in_half']:>13}")  # fmt: skip
  print(f"ratio autocast/hand: step {q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}), "
        f"compile {rows['autocast']['compile'] / rows['hand']['compile']:.3f}")  # fmt: skip
  return q[1]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--policy", default="p=f32,c=f16,o=f32")
  parser.add_argument("--model", choices=["cnn", "mlp", "all"], default="all")
  parser.add_argument("--rounds", type=int, default=11)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--compiles", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds")
  args = parser.parse_args(argv)
  policy = jmp_scaler.get_policy(args.policy)
  if args.quick:
    args.rounds, args.steps, args.compiles = 3, 2, 1
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
