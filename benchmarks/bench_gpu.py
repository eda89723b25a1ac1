"""Mixed precision on one GPU: fp32, bf16, fp16, and fp16 with jmp_scaler.

One command, nothing to install beyond jax[cuda], optax and flax (and this
package): a stack of pre-LN transformer blocks large enough to keep an H200
busy, float32 master parameters, Adam, every step donating its state. The
variants run in interleaved rounds (so they share the machine's state) and
the table gives each one's median step time and its ratio to bf16:

  fp32          float32 compute, no scaler
  bf16          bfloat16 compute, no scaler (the reference of the ratios)
  fp16          float16 compute, no scaler, no skip (what the scaler adds to)
  fp16+cond     jmp_scaler.TrainState, dynamic_scale(skip_mode="cond"): lax.cond skip
  fp16+select   jmp_scaler.TrainState, dynamic_scale(skip_mode="select"): jnp.where skip
  fp16+optax    jmp_scaler.skip_nonfinite(chain(dynamic_scale(), adam)) +
                optax.apply_updates (skip_mode "auto": select on GPU)

  fp8           bfloat16 compute, the four projections of every block (qkv, out, up,
                down) as jmp_scaler.fp8_dot_general (per-tensor current scaling);
                attention einsums, LayerNorm and softmax as in bf16; no scaler

With ``--block-scaled`` (issue 39) the run is bf16, fp8 and the block-scaled variants only:

  mxfp8         the same four projections as jmp_scaler.block_scaled_dot_general with
                MxFp8Recipe() (1x32 blocks, E8M0 scales, RCEIL)
  nvfp4         the same with Nvfp4Recipe() (E2M1, 16x16 weight tiles, the random Hadamard
                transform on wgrad, stochastic rounding of the gradient)

and the block report counts the ``__op$block_scaled_dot`` custom calls of each lowered step
(jax >= 0.11: 3 per projection) and the compiled custom calls. The speed is Blackwell's
(compute capability 10 and up): on any other GPU XLA dequantises the operands and runs an
ordinary dot, and the report says the speed is unmeasured.

The scaled variants against ``fp16`` are the scaler's cost; ``fp16+select``
against ``fp16+cond`` says whether a fused select beats ``lax.cond`` (whose
predicate may travel to the host every step) on this GPU; ``fp8`` against
``bf16`` is what fp8 GEMMs buy. Compilation counts against ``--budget``: timing
stops after the round that passes it.

After the table, the fp8 report: the fp8 ``dot_general`` sites of the lowered fp8
step (3 per projection: forward, dgrad, wgrad) against the fp8 GEMMs of its
compiled HLO (``__cublas$lt$matmul$f8`` custom calls, and dots of fp8 operands
left to a Triton GEMM fusion). A site XLA:GPU did not make an fp8 GEMM fell back
to a 16-bit dot silently (``TurnF8DotIntoF16Dot``); XLA:CPU has no fp8 GEMM.

  python benchmarks/bench_gpu.py            # stays within --budget 240 s (+ start-up)
  python benchmarks/bench_gpu.py --quick    # tiny sizes, runs on a CPU too
  python benchmarks/bench_gpu.py --fp8-check   # bf16 and fp8 only, d=2048 blocks, under
      # 5 minutes on an H200; exits 1 on a GPU where an fp8 site is not an fp8 GEMM
  python benchmarks/bench_gpu.py --block-scaled   # bf16, fp8, mxfp8, nvfp4
  python benchmarks/bench_gpu.py --hlo /tmp/hlo_gpu   # also keep each step's HLO: look
      # for `conditional`, and for `copy` of Adam's mu/nu in fp16+select
"""

from __future__ import annotations

import argparse
import os
import re
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
  sys.path.insert(1, os.path.dirname(_HERE))
  import jmp_scaler

import _models  # noqa: E402

SCALE = 2.0**12  # initial loss scale: every timed step should be finite (checked)


def _fp8_mm(x, w):
  """``x @ w`` as an fp8 GEMM."""
  return jmp_scaler.fp8_dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def _block_mm(recipe):
  """``x @ w`` as a block-scaled GEMM with ``recipe``."""
  return lambda x, w: jmp_scaler.block_scaled_dot_general(
      x, w, (((x.ndim - 1,), (0,)), ((), ())), recipe=recipe)


def fp8_loss(model, params, batch, compute_dtype=jnp.bfloat16, mm=_fp8_mm):
  """``model.loss`` (a ``_models.Transformer``) with its projections as fp8 GEMMs.

  The same blocks line for line, but ``x @ w`` is ``_fp8_mm(x, w)`` for qkv, out,
  up and down; the attention einsums stay in ``compute_dtype`` (as TE keeps them). ``mm``
  replaces ``_fp8_mm`` (the block-scaled variants).
  """
  p = _models._cast(params, compute_dtype)
  h = batch["x"].astype(compute_dtype)
  for blk in p["blocks"]:
    x = _models._layer_norm(h, blk["ln1"])
    b, t, d = x.shape
    hd = d // model.heads
    qkv = (mm(x, blk["qkv"]["w"]) + blk["qkv"]["b"]).reshape(b, t, 3, model.heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
    causal = jnp.tril(jnp.ones((t, t), bool))
    w = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1).astype(x.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)
    h = h + mm(o, blk["out"]["w"]) + blk["out"]["b"]
    u = mm(_models._layer_norm(h, blk["ln2"]), blk["up"]["w"]) + blk["up"]["b"]
    h = h + mm(jax.nn.gelu(u), blk["down"]["w"]) + blk["down"]["b"]
  return jnp.mean(jnp.square(h.astype(jnp.float32) - batch["y"]))


def fp8_report(lowered_text: str, compiled_text: str) -> dict:
  """The fp8 sites of a lowered step and the fp8 GEMMs of its compiled HLO."""
  sites = len(re.findall(r"stablehlo\.dot_general [^\n]*: \(tensor<[^>]*xf8E[^>]*>, "
                         r"tensor<[^>]*xf8E[^>]*>\)", lowered_text))
  cublas = compiled_text.count('custom_call_target="__cublas$lt$matmul$f8"')
  triton = len(re.findall(r"= [^\n]* dot\(f8e", compiled_text))  # fp8 dots inside fusions
  return {"sites": sites, "cublas_f8": cublas, "triton_f8": triton}


@jax.jit
def _all_finite(tree):
  """Whether every element of every leaf is finite: one program, not two per leaf shape."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def variants(model, lr=1e-4):
  """name -> (init(params) -> state, step(state, batch) -> state, scale(state))."""
  adam = optax.adam(lr)

  def plain(dtype, loss=model.loss):
    def step(state, batch):
      params, opt_state = state
      grads = jax.grad(loss)(params, batch, dtype)
      updates, opt_state = adam.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return (lambda p: (p, adam.init(p)), step, None)

  def ts_step(state, batch):
    scaled = lambda p: state.apply_fn(p, batch, jnp.float16) * state.loss_scale  # noqa: E731
    return state.apply_gradients(grads=jax.grad(scaled)(state.params))

  def trainstate(mode):
    tx = optax.chain(jmp_scaler.dynamic_scale(init_scale=SCALE, skip_mode=mode), adam)
    init = lambda p: jmp_scaler.TrainState.create(apply_fn=model.loss, params=p, tx=tx)  # noqa: E731
    return (init, ts_step, lambda s: s.loss_scale)

  skip_tx = jmp_scaler.skip_nonfinite(
      optax.chain(jmp_scaler.dynamic_scale(init_scale=SCALE), adam))

  def optax_step(state, batch):
    params, opt_state = state
    s = jmp_scaler.get_scale(opt_state)
    grads = jax.grad(lambda p: model.loss(p, batch, jnp.float16) * s)(params)
    updates, opt_state = skip_tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return {
      "fp32": plain(jnp.float32),
      "bf16": plain(jnp.bfloat16),
      "fp16": plain(jnp.float16),
      "fp16+cond": trainstate("cond"),
      "fp16+select": trainstate("select"),
      "fp16+optax": (lambda p: (p, skip_tx.init(p)), optax_step,
                     lambda s: jmp_scaler.get_scale(s[1])),
      "fp8": plain(jnp.bfloat16, loss=lambda p, b, dt: fp8_loss(model, p, b, dt)),
      "mxfp8": plain(jnp.bfloat16, loss=lambda p, b, dt: fp8_loss(
          model, p, b, dt, _block_mm(jmp_scaler.MxFp8Recipe()))),
      "nvfp4": plain(jnp.bfloat16, loss=lambda p, b, dt: fp8_loss(
          model, p, b, dt, _block_mm(jmp_scaler.Nvfp4Recipe()))),
  }


def block_report(lowered: dict, compiled: dict, dev) -> list[str]:
  """Lines: each block-scaled variant's lowered custom calls and compiled custom calls."""
  lines = []
  for name in lowered:
    sites = lowered[name].count("__op$block_scaled_dot")
    targets = re.findall(r'custom_call_target="([^"]+)"', compiled[name])
    block = sorted({t for t in targets if "block" in t.lower() or "cudnn" in t.lower()})
    where = "" if jax.default_backend() == "gpu" else " (the custom call is CUDA's lowering)"
    lines.append(f"{name}: {sites} __op$block_scaled_dot lowered{where}; compiled custom calls "
                 f"{block or 'none (dequantised: ordinary dots)'}")
  cc = getattr(dev, "compute_capability", None)
  blackwell = jax.default_backend() == "gpu" and cc is not None and float(cc) >= 10
  if not blackwell:
    lines.append(f"block-scaled speed: unmeasured on {dev.device_kind} (needs Blackwell, compute "
                 "capability 10+: elsewhere XLA dequantises and runs an ordinary dot)")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
  parser.add_argument("--budget", type=float, default=240.0,
                      help="seconds, compilation included: no new round starts after it")
  parser.add_argument("--quick", action="store_true", help="tiny sizes (runs on a CPU)")
  parser.add_argument("--hlo", metavar="DIR", help="write each compiled step's HLO here")
  parser.add_argument("--block-scaled", action="store_true",
                      help="bf16, fp8, mxfp8 and nvfp4 only, with the block report")
  parser.add_argument("--fp8-check", action="store_true",
                      help="bf16 and fp8 only; exit 1 on a GPU where an fp8 site is no fp8 GEMM")
  args = parser.parse_args(argv)
  if args.quick:
    model = _models.Transformer(d=32, heads=2, ff=64, seq=16, batch=2, layers=2)
    rounds, steps = min(args.rounds, 2), min(args.steps, 2)
  else:
    model = _models.Transformer(d=2048, heads=16, ff=8192, seq=2048, batch=8, layers=4)
    rounds, steps = args.rounds, args.steps
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  print(f"model: {model}")
  kp, kb = jax.random.split(jax.random.key(0))
  params = jax.jit(model.init)(kp)  # one program, not one per eager op
  n_params = sum(x.size for x in jax.tree.leaves(params))
  batch = jax.jit(model.batch_of)(kb)
  vs = variants(model)
  if args.block_scaled:
    vs = {name: vs[name] for name in ("bf16", "fp8", "mxfp8", "nvfp4")}
  else:
    vs = {name: v for name, v in vs.items() if name not in ("mxfp8", "nvfp4")}
  if args.fp8_check:  # two compiles of d=2048 blocks: the whole check stays under 5 minutes
    vs = {name: vs[name] for name in ("bf16", "fp8")}
    args.budget = min(args.budget, 150.0)
  start = time.perf_counter()
  fns, states, info, texts, block_low, block_comp = {}, {}, {}, {}, {}, {}
  for name, (init, step, _) in vs.items():
    t0 = time.perf_counter()
    fns[name] = jax.jit(step, donate_argnums=0)
    state = init(jax.tree.map(jnp.copy, params))
    state = jax.block_until_ready(fns[name](state, batch))
    lowered = fns[name].lower(state, batch)
    compiled = lowered.compile()
    if name == "fp8":
      texts = {"lowered": lowered.as_text(), "compiled": compiled.as_text()}
    if name in ("mxfp8", "nvfp4"):
      block_low[name], block_comp[name] = lowered.as_text(), compiled.as_text()
    mem = compiled.memory_analysis()
    if args.hlo:
      os.makedirs(args.hlo, exist_ok=True)
      with open(os.path.join(args.hlo, f"{name}.hlo.txt"), "w") as f:
        f.write(compiled.as_text())
    info[name] = {"compile_s": time.perf_counter() - t0,
                  "temp": getattr(mem, "temp_size_in_bytes", 0)}
    states[name] = state
  print(f"{n_params / 1e6:.2f}M parameters, {model.batch * model.seq} tokens per step")

  names = list(vs)
  times = {n: [] for n in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[: r % len(names)]:
      state = states[name]
      t0 = time.perf_counter()
      with jax.transfer_guard("disallow"):
        for _ in range(steps):
          state = fns[name](state, batch)
        jax.block_until_ready(state)
      times[name].append((time.perf_counter() - t0) / steps)
      states[name] = state
    if time.perf_counter() - start > args.budget and r >= 1:
      break
  done = len(times["bf16"])
  print(f"{done} rounds x {steps} steps; ratio = median over rounds of "
        f"(variant / bf16 in the same round)")
  head = (f"{'variant':<17}{'median ms':>10}{'spread':>8}{'vs bf16':>9}{'vs fp16':>9}"
          f"{'temp MiB':>10}{'compile s':>11}  finite")
  print(head)
  print("-" * len(head))
  bf16 = np.asarray(times["bf16"])
  fp16 = np.asarray(times["fp16"]) if "fp16" in times else None  # not run by --fp8-check
  for name, (_, _, scale_of) in vs.items():
    t = np.asarray(times[name])
    finite = (scale_of is None or float(scale_of(states[name])) == SCALE)
    state = states[name]
    params_of = state.params if isinstance(state, jmp_scaler.TrainState) else state[0]
    finite = finite and bool(_all_finite(params_of))
    print(f"{name:<17}{1e3 * np.median(t):>10.2f}"
          f"{(np.percentile(t, 75) - np.percentile(t, 25)) / np.median(t):>8.0%}"
          f"{np.median(t / bf16):>9.3f}"
          f"{'-' if fp16 is None else f'{np.median(t / fp16):.3f}':>9}"
          f"{info[name]['temp'] / 2**20:>10.1f}{info[name]['compile_s']:>11.1f}  "
          f"{'yes' if finite else 'NO'}")
  stats = getattr(dev, "memory_stats", lambda: None)() or {}
  if "peak_bytes_in_use" in stats:
    print(f"peak device memory: {stats['peak_bytes_in_use'] / 2**30:.1f} GiB")
  r = fp8_report(texts["lowered"], texts["compiled"])
  gemms = r["cublas_f8"] + r["triton_f8"]
  speed = 1 / np.median(np.asarray(times["fp8"]) / bf16)  # the table's ratio, inverted
  print(f"\nfp8 report: {r['sites']} fp8 sites lowered ({4 * model.layers} projections x 3); "
        f"compiled: {r['cublas_f8']} cuBLASLt fp8 GEMMs + {r['triton_f8']} fp8 Triton dots "
        f"= {gemms} of {r['sites']}; fp8 throughput {speed:.3f}x bf16")
  if block_low:
    print("\nblock report:\n  " + "\n  ".join(block_report(block_low, block_comp, dev)))
  if jax.default_backend() == "gpu":
    if gemms < r["sites"]:
      print(f"FALLBACK: {r['sites'] - gemms} fp8 sites run as 16-bit dots")
      return 1
  else:
    print(f"({jax.default_backend()} has no fp8 GEMM: XLA upcasts the fp8 operands)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
