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

The scaled variants against ``fp16`` are the scaler's cost; ``fp16+select``
against ``fp16+cond`` says whether a fused select beats ``lax.cond`` (whose
predicate may travel to the host every step) on this GPU. Compilation counts
against ``--budget``: timing stops after the round that passes it.

  python benchmarks/bench_gpu.py            # stays within --budget 240 s (+ start-up)
  python benchmarks/bench_gpu.py --quick    # tiny sizes, runs on a CPU too
  python benchmarks/bench_gpu.py --hlo /tmp/hlo_gpu   # also keep each step's HLO: look
      # for `conditional`, and for `copy` of Adam's mu/nu in fp16+select
"""

from __future__ import annotations

import argparse
import os
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


def variants(model, lr=1e-4):
  """name -> (init(params) -> state, step(state, batch) -> state, scale(state))."""
  adam = optax.adam(lr)

  def plain(dtype):
    def step(state, batch):
      params, opt_state = state
      grads = jax.grad(model.loss)(params, batch, dtype)
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
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
  parser.add_argument("--budget", type=float, default=240.0,
                      help="seconds, compilation included: no new round starts after it")
  parser.add_argument("--quick", action="store_true", help="tiny sizes (runs on a CPU)")
  parser.add_argument("--hlo", metavar="DIR", help="write each compiled step's HLO here")
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
  params = model.init(kp)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  batch = jax.device_put(model.batch_of(kb))
  vs = variants(model)
  start = time.perf_counter()
  fns, states, info = {}, {}, {}
  for name, (init, step, _) in vs.items():
    t0 = time.perf_counter()
    fns[name] = jax.jit(step, donate_argnums=0)
    state = init(jax.tree.map(jnp.copy, params))
    state = jax.block_until_ready(fns[name](state, batch))
    compiled = fns[name].lower(state, batch).compile()
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
  bf16, fp16 = np.asarray(times["bf16"]), np.asarray(times["fp16"])
  for name, (_, _, scale_of) in vs.items():
    t = np.asarray(times[name])
    finite = (scale_of is None or float(scale_of(states[name])) == SCALE)
    state = states[name]
    params_of = state.params if isinstance(state, jmp_scaler.TrainState) else state[0]
    finite = finite and all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params_of))
    print(f"{name:<17}{1e3 * np.median(t):>10.2f}"
          f"{(np.percentile(t, 75) - np.percentile(t, 25)) / np.median(t):>8.0%}"
          f"{np.median(t / bf16):>9.3f}{np.median(t / fp16):>9.3f}"
          f"{info[name]['temp'] / 2**20:>10.1f}{info[name]['compile_s']:>11.1f}  "
          f"{'yes' if finite else 'NO'}")
  stats = getattr(dev, "memory_stats", lambda: None)() or {}
  if "peak_bytes_in_use" in stats:
    print(f"peak device memory: {stats['peak_bytes_in_use'] / 2**30:.1f} GiB")


if __name__ == "__main__":
  main()
