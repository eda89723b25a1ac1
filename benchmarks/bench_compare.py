"""What ``jmp_scaler.compare_precision`` costs, against the budget of issue 37.

The budget: two compiled training steps plus one forward pass per layer. The models are those
of bench_find.py, both under ``jmp_scaler.autocast`` with a float16 compute dtype: the
character-level GPT of bench_bf16.py and the CNN of bench_autocast.py. For each, in one
process and in interleaved rounds:

  step       one training step (jmp_scaler.value_and_grad, TrainState with dynamic_scale and
             Adam), compiled afresh and run once: a first training step
  forward    the loss alone, jitted, its run time (median of --runs), for the per-layer term
  compare    compare_precision(loss_fn, params, *batch, policy=...) as a user calls it (the
             model's float32 loss under the policy): tracing, both compiled runs, the table

and reports the medians over --rounds of the compare call, its ratio to a first step (per
round, then the median), and its ratio to the budget (2 first steps + layers x forward run).
Under the table: the layer where the error jumps and the number of layers.

  python benchmarks/bench_compare.py            # GPT (d 32, seq 32, 2 layers) and CNN (32 x 32)
  python benchmarks/bench_compare.py --quick    # smaller models, one round
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np
import optax

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
try:
  import jmp_scaler
except ImportError:  # run from a checkout that is not installed
  sys.path.insert(0, os.path.dirname(_HERE))
  import jmp_scaler

import bench_autocast  # noqa: E402 - the CNN
import bench_bf16  # noqa: E402 - the char-GPT task
import bench_find  # noqa: E402 - the two models under autocast, a first training step
from _models import row  # noqa: E402

POLICY = "p=f32,c=f16,o=f32"


def gpt(args):
  """(name, float32 loss_fn, params, batch): the char-GPT, its loss in float32."""
  task = bench_bf16.gpt_task(argparse.Namespace(
      seq=args.seq, d_model=args.d_model, gpt_layers=args.layers, gpt_batch=args.batch,
      gpt_steps=1, gpt_lr=1e-3))  # fmt: skip
  params = jax.jit(task.init)(jax.random.key(0))
  batch = (jax.numpy.asarray(task.x_train[: args.batch]),
           jax.numpy.asarray(task.y_train[: args.batch]))  # fmt: skip

  def loss_fn(params, x, y):
    return task.loss_acc(params, x, y)[0]

  name = f"char-GPT (d {args.d_model}, seq {args.seq}, {args.layers} layers, batch {args.batch})"
  return name, loss_fn, params, batch


def cnn(args):
  """(name, float32 loss_fn, params, batch): the CNN of bench_autocast.py."""
  model = bench_autocast.CNN(width=args.width)
  rng = np.random.default_rng(0)
  x = jax.numpy.asarray(rng.normal(size=(args.batch, args.side, args.side, 3)), jax.numpy.float32)
  y = jax.numpy.asarray(rng.integers(0, 10, args.batch), jax.numpy.int32)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  extra = {k: v for k, v in variables.items() if k != "params"}

  def loss_fn(params, x, y):
    logits = model.apply({**extra, "params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  name = f"CNN (3 x Conv+BN, Dense; {args.side} x {args.side}, width {args.width}, batch " \
         f"{args.batch})"
  return name, loss_fn, variables["params"], (x, y)


def forward_run(loss_fn, params, batch, runs):
  """The median run time of the jitted loss under the policy (compiled once)."""
  fn = jax.jit(jmp_scaler.autocast(loss_fn, POLICY))
  jax.block_until_ready(fn(params, *batch))
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(fn(params, *batch))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="smaller models, one round")
  parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per model")
  parser.add_argument("--runs", type=int, default=10, help="timed runs of the compiled steps")
  parser.add_argument("--models", default="gpt,cnn", help="comma-separated: gpt, cnn")
  args = parser.parse_args(argv)
  sizes = {"gpt": argparse.Namespace(seq=32, d_model=32, layers=2, batch=16),
           "cnn": argparse.Namespace(side=32, width=32, batch=64)}
  if args.quick:
    args.rounds, args.runs = 1, 3
    sizes = {"gpt": argparse.Namespace(seq=16, d_model=16, layers=1, batch=8),
             "cnn": argparse.Namespace(side=8, width=4, batch=8)}
  makers = {"gpt": gpt, "cnn": cnn}
  names = [m for m in args.models.split(",") if m]
  unknown = [m for m in names if m not in makers]
  if unknown or not names:
    parser.error(f"--models must name gpt and/or cnn, got {args.models!r}")
  print(f"jax {jax.__version__}, {jax.default_backend()}, policy {POLICY}; compare_precision: "
        f"median of {args.rounds} round(s), each call tracing and compiling afresh")
  width, widths = 58, (9, 9, 11, 9)
  print(row("model", width, ("case", "seconds", "x 1st step", "x budget"), widths))
  found = []
  for key in names:
    name, loss_fn, params, batch = makers[key](sizes[key])
    step_loss = jmp_scaler.autocast(loss_fn, POLICY)
    fwd = forward_run(loss_fn, params, batch, args.runs)
    firsts, compares, budgets, report = [], [], [], None
    for _ in range(args.rounds):  # interleaved: a first step, then a compare, per round
      compile_s, run_s = bench_find.one_step(step_loss, params, batch, args.runs)
      firsts.append(compile_s + run_s)
      start = time.perf_counter()
      report = jmp_scaler.compare_precision(loss_fn, params, *batch, policy=POLICY)
      compares.append(time.perf_counter() - start)
      budgets.append(2 * firsts[-1] + len(report.layers) * fwd)
    first, seconds = statistics.median(firsts), statistics.median(compares)
    to_step = statistics.median([c / f for c, f in zip(compares, firsts, strict=True)])
    to_budget = statistics.median([c / b for c, b in zip(compares, budgets, strict=True)])
    print(row(name, width, ("step", f"{first:.2f}", "1.00", "-"), widths))
    print(row("", width, ("forward", f"{fwd * 1e3:.1f}ms", "-", "-"), widths))
    print(row("", width, ("compare", f"{seconds:.2f}", f"{to_step:.2f}", f"{to_budget:.2f}"),
              widths))  # fmt: skip
    found.append(f"{name.split(' (')[0]}: {len(report.layers)} layers, error jumps at "
                 f"{report.jump}, loss {report.loss:.4g} (float32) vs {report.loss_half:.4g}")
  print("\nfound:")
  for line in found:
    print(f"  {line}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
