"""What ``jmp_scaler.find_nonfinite`` costs, against one compiled training step of the same model.

Two models of the other benchmarks, both under ``jmp_scaler.autocast`` with a float16 compute
dtype (the setting where one looks for an overflow): the character-level GPT of bench_bf16.py
(plain float32 code, its loss transformed by autocast) and the CNN of bench_autocast.py (Flax
Conv + BatchNorm + Dense, its ``apply`` transformed by autocast). For each, in one process:

  step       one training step (jmp_scaler.value_and_grad, TrainState with dynamic_scale and
             Adam): its compile time (lower + compile) and its run time (median of --runs)
  clean      find_nonfinite(loss_fn, params, ..., scale=2^16) on the healthy model: it returns
             None after the forward and the backward compiled passes (the whole search)
  forward    the same with one weight made large, so that a float16 matmul (GPT) or
             convolution (CNN) overflows: the forward pass, then the inputs of that operation
  backward   the healthy model at scale 2^30: the forward pass, the backward pass, then the
             inputs of the backward operation that overflows

Each find_nonfinite call traces and compiles afresh, as a user's does; the table gives the
median of --repeats calls, in seconds, and its ratio to the step's compile plus one run (the
cost of a first training step). The operation found and its line are printed under the table.

  python benchmarks/bench_find.py            # GPT (d 32, seq 32, 2 layers) and CNN (32 x 32)
  python benchmarks/bench_find.py --quick    # smaller models, one call each
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
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

POLICY = jmp_scaler.get_policy("p=f32,c=f16,o=f32")


def gpt(args):
  """(loss_fn, params, batch, how to break it): the char-GPT under autocast."""
  task = bench_bf16.gpt_task(argparse.Namespace(
      seq=args.seq, d_model=args.d_model, gpt_layers=args.layers, gpt_batch=args.batch,
      gpt_steps=1, gpt_lr=1e-3))  # fmt: skip
  forward = jmp_scaler.autocast(task.loss_acc, POLICY)

  def loss_fn(params, x, y):
    return forward(params, x, y)[0]

  params = jax.jit(task.init)(jax.random.key(0))
  batch = (jnp.asarray(task.x_train[: args.batch]), jnp.asarray(task.y_train[: args.batch]))

  def broken(p):  # the first block's MLP: its float16 matmul passes 65504
    blocks = [dict(b) for b in p["blocks"]]
    blocks[0]["up"] = blocks[0]["up"] * 2e4
    return {**p, "blocks": blocks}

  name = f"char-GPT (d {args.d_model}, seq {args.seq}, {args.layers} layers, batch {args.batch})"
  return name, loss_fn, params, batch, broken


def cnn(args):
  """(loss_fn, params, batch, how to break it): the CNN under autocast."""
  model = bench_autocast.CNN(width=args.width)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(args.batch, args.side, args.side, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, args.batch), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  extra = {k: v for k, v in variables.items() if k != "params"}
  apply = jmp_scaler.autocast(model.apply, POLICY)

  def loss_fn(params, x, y):
    logits = POLICY.cast_to_output(apply({**extra, "params": params}, x))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def broken(p):  # the first convolution's kernel: its float16 output passes 65504
    return {**p, "Conv_0": {**p["Conv_0"], "kernel": p["Conv_0"]["kernel"] * 1e5}}

  name = f"CNN (3 x Conv+BN, Dense; {args.side} x {args.side}, width {args.width}, batch " \
         f"{args.batch})"
  return name, loss_fn, variables["params"], (x, y), broken


def one_step(loss_fn, params, batch, runs):
  """The compile time and the median run time of one training step, in seconds."""
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3))
  state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)

  def step(state, *batch):
    loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params, *batch)
    return state.apply_gradients(grads=grads), loss

  start = time.perf_counter()
  compiled = jax.jit(step).lower(state, *batch).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(state, *batch))
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(compiled(state, *batch))
    times.append(time.perf_counter() - start)
  return compile_s, statistics.median(times)


def timed_find(loss_fn, params, batch, scale, repeats):
  times, report = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    report = jmp_scaler.find_nonfinite(loss_fn, params, *batch, scale=scale)
    times.append(time.perf_counter() - start)
  return statistics.median(times), report


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="smaller models, one call each")
  parser.add_argument("--repeats", type=int, default=3, help="find_nonfinite calls per case")
  parser.add_argument("--runs", type=int, default=10, help="timed runs of the compiled step")
  args = parser.parse_args(argv)
  gpt_args = argparse.Namespace(seq=32, d_model=32, layers=2, batch=16)
  cnn_args = argparse.Namespace(side=32, width=32, batch=64)
  if args.quick:
    args.repeats, args.runs = 1, 3
    gpt_args = argparse.Namespace(seq=16, d_model=16, layers=1, batch=8)
    cnn_args = argparse.Namespace(side=8, width=4, batch=8)
  print(f"jax {jax.__version__}, {jax.default_backend()}, policy {POLICY}; find_nonfinite: "
        f"median of {args.repeats} call(s), each tracing and compiling afresh")
  print(f"{'model':<58} {'case':<9} {'seconds':>8} {'x first step':>13}")
  found = []
  for make, margs in ((gpt, gpt_args), (cnn, cnn_args)):
    name, loss_fn, params, batch, broken = make(margs)
    compile_s, run_s = one_step(loss_fn, params, batch, args.runs)
    first = compile_s + run_s
    print(f"{name:<58} {'step':<9} {first:8.2f} {1.0:13.2f}   (compile {compile_s:.2f} s, "
          f"run {1e3 * run_s:.1f} ms)")  # fmt: skip
    cases = (("clean", params, 2.0**16), ("forward", broken(params), 2.0**16),
             ("backward", params, 2.0**30))  # fmt: skip
    for case, p, scale in cases:
      seconds, report = timed_find(loss_fn, p, batch, scale, args.repeats)
      print(f"{'':<58} {case:<9} {seconds:8.2f} {seconds / first:13.2f}")
      if report is not None:
        found.append(f"{name.split(' (')[0]}, {case}: {report.phase} {report.primitive} at "
                     f"{report.source}, finite in float32: {report.finite_in_float32}")
      else:
        found.append(f"{name.split(' (')[0]}, {case}: nothing non-finite")
  print("\nfound:")
  for line in found:
    print(f"  {line}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
