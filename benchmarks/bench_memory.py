"""What mixed precision saves in activation memory: autocast against hand annotation.

For each model (benchmarks/_memory_models.py) and half dtype, the value and gradient of a
float32 loss of float32 master parameters is measured four ways:

  float32    the model as written, no dtype anywhere
  hand       the same model with ``dtype=`` on every layer (Flax's hand annotation)
  module     ``jmp_scaler.autocast_linen`` around the float32 model (``autocast_nnx`` for
             the NNX Gemma)
  autocast   ``jmp_scaler.autocast(apply, "p=f32,c=<half>,o=f32")`` of the float32 model

Two figures per cell, in MiB:

* **saved**: the bytes JAX's autodiff keeps for the backward pass (``saved_residuals``:
  every residual but the arguments, which every variant holds alike). It is read from the
  jaxpr, so it holds for GPU and TPU as for this CPU.
* **temp** (``--compile``): XLA's compiled temporary buffers of the jitted value-and-grad
  (``memory_analysis().temp_size_in_bytes``), XLA:CPU's. Its float normalisation computes
  bfloat16 elementwise ops in float32, so it understates bfloat16's saving.

The ratios are autocast / hand and autocast / float32, on saved bytes. ``--trace`` times the
trace and lowering of ``jax.value_and_grad`` of an unrolled GPT of ``--trace-layers``
blocks, plain and under autocast, rounds interleaved, and prints the medians and their
ratio.

  python benchmarks/bench_memory.py                      # every model, float16 and bfloat16
  python benchmarks/bench_memory.py --compile --trace    # + XLA's temp bytes, trace cost
  python benchmarks/bench_memory.py --quick              # tiny sizes, float16 (the suite's)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _memory_models as M  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _models import row  # noqa: E402
from flax import nnx  # noqa: E402

import jmp_scaler  # noqa: E402

try:  # public from jax 0.4.3x on; jax 0.10.2 keeps it in _src
  from jax.ad_checkpoint import saved_residuals
except ImportError:  # pragma: no cover
  from jax._src.ad_checkpoint import saved_residuals

MIB = 2.0**20
VARIANTS = ("float32", "hand", "module", "autocast")
HALF = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}
TRANSFORMERS = ("gpt", "gpt_scan", "gpt_remat", "llama", "llama_scan", "lm1b", "gemma")


def saved_bytes(loss: Callable, params) -> int:
  """Bytes of the residuals ``jax.vjp`` of ``loss`` keeps, arguments left out."""
  total = 0
  for aval, where in saved_residuals(loss, params):
    if "from the argument" in where:
      continue
    total += int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
  return total


def temp_bytes(loss: Callable, params) -> int:
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def _xent(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()


def linen_case(make: Callable, x, policy: str, loss_of: Callable, mutable=False):
  """(params, {variant: loss(params)}) for a linen model ``make(dtype)``."""
  half = HALF[policy.split("c=")[1].split(",")[0].replace("f16", "float16")
              .replace("bf16", "bfloat16")]  # fmt: skip
  plain, hand = make(None), make(half)
  variables = plain.init(jax.random.key(0), x)
  params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}

  def apply_with(model, transform=lambda f: f, context=contextlib.nullcontext):
    def loss(p):
      with context():
        kw = {"mutable": ["batch_stats"]} if mutable else {}
        out = transform(model.apply)({"params": p, **rest}, x, **kw)
      out = out[0] if mutable else out
      return loss_of(out)
    return loss

  return params, {
    "float32": apply_with(plain),
    "hand": apply_with(hand),
    "module": apply_with(plain, context=lambda: jmp_scaler.autocast_linen(policy)),
    "autocast": apply_with(plain, lambda f: jmp_scaler.autocast(f, policy)),
  }


def gemma_case(cfg: dict, tokens, policy: str):
  half = jnp.float16 if "c=f16" in policy else jnp.bfloat16
  args = (cfg["vocab"], cfg["d"], cfg["heads"], max(1, cfg["heads"] // 2), cfg["layers"])
  models = {
    "float32": M.Gemma(*args, rngs=nnx.Rngs(0)),
    "hand": M.Gemma(*args, rngs=nnx.Rngs(0), dtype=half),
    "module": jmp_scaler.autocast_nnx(M.Gemma(*args, rngs=nnx.Rngs(0)), policy),
    "autocast": M.Gemma(*args, rngs=nnx.Rngs(0)),
  }
  graphdef, params = nnx.split(models["float32"])
  losses = {}
  for name, model in models.items():
    gd = nnx.graphdef(model)

    def loss(p, gd=gd, name=name):
      fwd = lambda p_: nnx.merge(gd, p_)(tokens)  # noqa: E731
      if name == "autocast":
        fwd = jmp_scaler.autocast(fwd, policy)
      return _xent(fwd(p), tokens)
    losses[name] = loss
  del graphdef
  return params, losses


def cases(quick: bool) -> dict[str, Callable]:
  """name -> policy -> (params, {variant: loss})."""
  d, heads, layers, batch, seq = (32, 2, 2, 2, 16) if quick else (256, 4, 4, 8, 128)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, seq, d)), jnp.float32)
  vocab = 64 if quick else 1024
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (batch, seq)), jnp.int32)
  images = jnp.asarray(np.random.default_rng(2).normal(
    size=(2 if quick else 16, 16 if quick else 32, 16 if quick else 32, 3)), jnp.float32)
  widths = (8, 16, 32) if quick else (32, 64, 128)
  square = lambda y: jnp.mean(y.astype(jnp.float32) ** 2)  # noqa: E731
  labels = jnp.zeros(images.shape[0], jnp.int32)

  def stack(block, **kw):
    return lambda policy: linen_case(
      lambda dt: M.Stack(block, d, heads, layers, dtype=dt, **kw), x, policy, square)

  return {
    "gpt": stack("gpt"),
    "gpt_scan": stack("gpt", scan=True),
    "gpt_remat": stack("gpt", remat=True),
    "llama": stack("llama"),
    "llama_scan": stack("llama", scan=True),
    "lm1b": lambda policy: linen_case(
      lambda dt: M.LM1B(vocab, d, heads, layers, dtype=dt), tokens, policy,
      lambda logits: _xent(logits, tokens)),
    "gemma": lambda policy: gemma_case(
      dict(vocab=vocab, d=d, heads=heads, layers=layers), tokens, policy),
    "resnet": lambda policy: linen_case(
      lambda dt: M.ResNet(widths, dtype=dt), images, policy,
      lambda logits: optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean(), mutable=True),
  }


def measure(args) -> list[dict]:
  rows = []
  for dtype in args.dtypes:
    policy = f"p=f32,c={'f16' if dtype == 'float16' else 'bf16'},o=f32"
    for name, case in cases(args.quick).items():
      if args.models and name not in args.models:
        continue
      params, losses = case(policy)
      found = {"model": name, "dtype": dtype}
      for variant in VARIANTS:
        found[f"saved_{variant}"] = saved_bytes(losses[variant], params)
        if args.compile:
          found[f"temp_{variant}"] = temp_bytes(losses[variant], params)
      rows.append(found)
      print_row(found, args.compile)
  return rows


WIDTHS = (8, 8, 8, 8, 9, 9)


def header(compile_: bool) -> None:
  print(row("model", 11, ["dtype", *VARIANTS, "ac/hand", "ac/f32"], [9, *WIDTHS]))
  if compile_:
    print("  (second line: XLA:CPU temp MiB of the compiled value-and-grad)")
  print("-" * (11 + 10 + sum(w + 1 for w in WIDTHS)))


def print_row(r: dict, compile_: bool) -> None:
  s = {v: r[f"saved_{v}"] for v in VARIANTS}
  ratios = [f"{s['autocast'] / s['hand']:.3f}", f"{s['autocast'] / s['float32']:.3f}"]
  cells = [r["dtype"], *[f"{s[v] / MIB:.2f}" for v in VARIANTS], *ratios]
  print(row(r["model"], 11, cells, [9, *WIDTHS]), flush=True)
  if compile_:
    t = {v: r[f"temp_{v}"] for v in VARIANTS}
    cells = ["temp", *[f"{t[v] / MIB:.2f}" for v in VARIANTS],
             f"{t['autocast'] / t['hand']:.3f}", f"{t['autocast'] / t['float32']:.3f}"]
    print(row("", 11, cells, [9, *WIDTHS]), flush=True)


def trace_cost(layers: int, rounds: int, quick: bool) -> None:
  """Median trace+lower seconds of value_and_grad of an unrolled GPT, plain and autocast."""
  d, heads, seq = (32, 2, 16) if quick else (256, 4, 128)
  x = jnp.ones((2, seq, d), jnp.float32)
  model = M.Stack("gpt", d, heads, layers)
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  loss = lambda apply: lambda p: jnp.mean(apply({"params": p}, x) ** 2)  # noqa: E731
  fns = {"plain": lambda: loss(model.apply),
         "autocast": lambda: loss(jmp_scaler.autocast(model.apply, "p=f32,c=f16,o=f32"))}
  times: dict[str, list[float]] = {k: [] for k in fns}
  for r in range(rounds):
    for name in (fns if r % 2 == 0 else reversed(list(fns))):
      jax.clear_caches()
      t0 = time.perf_counter()
      jax.jit(jax.value_and_grad(fns[name]())).lower(params)
      times[name].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  ratios = [a / p for a, p in zip(times["autocast"], times["plain"], strict=True)]
  print(f"\n## trace + lower of value_and_grad, unrolled GPT x{layers} (d={d}, seq {seq}), "
        f"{rounds} rounds interleaved")
  print(f"plain {med['plain']:.3f} s, autocast {med['autocast']:.3f} s: ratio of medians "
        f"{med['autocast'] / med['plain']:.3f}, median of per-round ratios "
        f"{statistics.median(ratios):.3f}")


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="tiny sizes (the test suite's run)")
  p.add_argument("--models", type=lambda s: s.split(","), default=None,
                 help="comma-separated subset of: " + ", ".join(cases(True)))
  p.add_argument("--dtypes", type=lambda s: s.split(","), default=None,
                 help="float16,bfloat16 (the default; --quick: float16)")
  p.add_argument("--compile", action="store_true", help="also XLA's compiled temp bytes")
  p.add_argument("--trace", action="store_true", help="also the trace cost of autocast")
  p.add_argument("--trace-layers", type=int, default=48)
  p.add_argument("--trace-rounds", type=int, default=5)
  args = p.parse_args(argv)
  args.dtypes = args.dtypes or (["float16"] if args.quick else ["float16", "bfloat16"])
  for dtype in args.dtypes:
    if dtype not in HALF:
      p.error(f"--dtypes takes float16 and bfloat16, got {dtype!r}")
  print(f"jax {jax.__version__}; saved residuals in MiB (arguments excluded); "
        f"ratios autocast/hand and autocast/float32")
  header(args.compile)
  rows = measure(args)
  worst = max(r["saved_autocast"] / r["saved_hand"] for r in rows)
  tf = [r["saved_autocast"] / r["saved_float32"] for r in rows if r["model"] in TRANSFORMERS]
  print(f"\nworst autocast/hand {worst:.3f}; worst autocast/float32 on the transformers "
        f"{max(tf) if tf else float('nan'):.3f}")
  if args.trace:
    trace_cost(args.trace_layers if not args.quick else 4, args.trace_rounds, args.quick)
  return rows


if __name__ == "__main__":
  main()
