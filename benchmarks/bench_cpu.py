"""What a loss scaler costs per training step, jmp_scaler against its peers.

Runs, in one process and in interleaved rounds, the same fp16-compute step
(float32 master parameters, Adam) under each variant:

  none          no scaler, no skip (the baseline)
  trainstate    jmp_scaler.TrainState.apply_gradients (dynamic_scale in the chain)
  optax         jmp_scaler.skip_nonfinite(chain(dynamic_scale(), adam)) + apply_updates
  flax          flax DynamicScale.value_and_grad + jnp.where over params and opt_state
  apply_if_finite  optax.apply_if_finite(adam), static loss scale (optax has no dynamic one)
  jmp           jmp DynamicLossScale + jmp.all_finite + jmp.select_tree (skipped if
                jmp is not installed)

Each round runs ``--steps`` steps of every variant (rotating their order), so
all variants see the same machine load; the table gives the median step time
over rounds and the median over rounds of (variant time / no-scaler time in
the same round), with its interquartile range as a noise figure. Every step
donates its state, the timed calls run under ``jax.transfer_guard("disallow")``
(no host transfer inside a step), and all timed steps are finite (checked).
Afterwards one overflowing step per variant checks the skip (not timed).

  python benchmarks/bench_cpu.py                  # MLP 4 x 1024 and transformer block
  python benchmarks/bench_cpu.py --model mlp --rounds 21 --steps 20
  python benchmarks/bench_cpu.py --quick          # tiny sizes, a few seconds
  python benchmarks/bench_cpu.py --hlo /tmp/hlo   # also dump each compiled step's HLO
  python benchmarks/bench_cpu.py --profile /tmp/tr # and where each step's time goes
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import dynamic_scale as flax_ds

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
try:
  import jmp_scaler
except ImportError:  # run from a checkout that is not installed
  sys.path.insert(1, os.path.dirname(_HERE))
  import jmp_scaler

import _models  # noqa: E402

try:
  import jmp
  from jmp._src import loss_scale as _jmp_loss_scale
except ImportError:  # jmp is not a dependency of jmp_scaler
  jmp = None
else:
  # Compatibility shim for jmp 0.0.4 under recent JAX: ``DynamicLossScale``'s
  # ``__post_init__`` calls ``jax.eval_shape`` on its leaves, which fails when
  # ``jit(...).lower`` unflattens the state with ``ArgInfo`` placeholders.
  _jmp_warn = _jmp_loss_scale.warn_if_not_floating

  def _tolerant_warn(x, var_name):
    try:
      _jmp_warn(x, var_name)
    except TypeError:
      pass

  _jmp_loss_scale.warn_if_not_floating = _tolerant_warn

SCALE = 2.0**10  # initial (or static) loss scale of every variant: low enough that
# every timed step is finite (the common case; checked), the cost does not depend on it
LR = 1e-3


@dataclasses.dataclass(frozen=True)
class Variant:
  """A way to run the step: ``state = step(state, batch)``."""

  name: str
  init: Callable[[Any], Any]  # params -> state
  step: Callable[[Any, Any], Any]  # (state, batch) -> state
  params: Callable[[Any], Any]  # state -> params
  scale: Callable[[Any], Any] | None = None  # state -> current loss scale


def variants(model) -> list[Variant]:
  """The variants, each built the way its library documents it."""
  adam = optax.adam(LR)
  loss = model.loss
  first = lambda s: s[0]  # noqa: E731

  def none_step(state, batch):
    params, opt_state = state
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  tx = optax.chain(jmp_scaler.dynamic_scale(init_scale=SCALE), adam)

  def ts_step(state, batch):
    scaled = lambda p: state.apply_fn(p, batch) * state.loss_scale  # noqa: E731
    return state.apply_gradients(grads=jax.grad(scaled)(state.params))

  skip_tx = jmp_scaler.skip_nonfinite(tx)

  def optax_step(state, batch):
    params, opt_state = state
    s = jmp_scaler.get_scale(opt_state)
    grads = jax.grad(lambda p: loss(p, batch) * s)(params)
    updates, opt_state = skip_tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def flax_step(state, batch):
    params, opt_state, ds = state
    ds, is_fin, _, grads = ds.value_and_grad(loss)(params, batch)
    updates, new_opt = adam.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = functools.partial(jnp.where, is_fin)
    return (
        jax.tree.map(keep, new_params, params),
        jax.tree.map(keep, new_opt, opt_state),
        ds,
    )

  aif = optax.apply_if_finite(adam, max_consecutive_errors=5)

  def aif_step(state, batch):
    params, opt_state = state
    grads = jax.grad(lambda p: loss(p, batch) * SCALE)(params)
    grads = jax.tree.map(lambda g: g * (1.0 / SCALE), grads)
    updates, opt_state = aif.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def jmp_step(state, batch):
    params, opt_state, ls = state
    grads = jax.grad(lambda p: ls.scale(loss(p, batch)))(params)
    grads = ls.unscale(grads)
    finite = jmp.all_finite(grads)
    ls = ls.adjust(finite)
    updates, new_opt = adam.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(
        finite, (new_params, new_opt), (params, opt_state)
    )
    return params, opt_state, ls

  out = [
      Variant("none", lambda p: (p, adam.init(p)), none_step, first),
      Variant(
          "trainstate",
          lambda p: jmp_scaler.TrainState.create(apply_fn=loss, params=p, tx=tx),
          ts_step,
          lambda s: s.params,
          lambda s: s.loss_scale,
      ),
      Variant(
          "optax", lambda p: (p, skip_tx.init(p)), optax_step, first,
          lambda s: jmp_scaler.get_scale(s[1]),
      ),
      Variant(
          "flax",
          lambda p: (p, adam.init(p), flax_ds.DynamicScale(scale=SCALE)),
          flax_step, first, lambda s: s[2].scale,
      ),
      Variant("apply_if_finite", lambda p: (p, aif.init(p)), aif_step, first),
  ]
  if jmp is not None:
    out.append(Variant(
        "jmp",
        lambda p: (p, adam.init(p), jmp.DynamicLossScale(jnp.asarray(SCALE, jnp.float32))),
        jmp_step, first, lambda s: s[2].loss_scale,
    ))
  return out


def hlo_stats(text: str) -> dict[str, int]:
  """Counts in a compiled module: ENTRY-level kernels and a few op kinds."""
  entry = text[text.index("\nENTRY"):]
  entry = entry[: entry.index("\n}")]
  trivial = ("parameter(", "get-tuple-element(", "tuple(", "constant(", "bitcast(")
  ops = [ln for ln in entry.splitlines()[1:] if "=" in ln and not any(t in ln for t in trivial)]
  count = lambda op: sum(f" {op}(" in ln for ln in text.splitlines())  # noqa: E731
  return {
      "kernels": len(ops),
      "fusions": count("fusion"),
      "conds": count("conditional"),
      "copies": count("copy"),
  }


def kernel_profile(fn, state, batch, steps, logdir):
  """Runs ``steps`` steps under ``jax.profiler``; returns ({kernel: ms per step}, state).

  Kernels are XLA's thunks (fusions, dots, copies, ...) named without their
  numeric suffix, so e.g. all of Adam's ``multiply_add_fusion.N`` add up; the
  times are summed over XLA:CPU's threads, so they can exceed the wall time.
  """
  with jax.profiler.trace(logdir):
    for _ in range(steps):
      state = fn(state, batch)
    jax.block_until_ready(state)
  path = max(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.trace.json.gz")),
             key=os.path.getmtime)
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  # Host-side events are Python frames ($...), C++ scopes (A::B) or CamelCase.
  kernels = sorted(
      (e for e in events if e.get("ph") == "X" and e.get("name", "")[:1].islower()
       and "::" not in e["name"] and not e["name"].startswith("end:")),
      key=lambda e: (e.get("pid"), e.get("tid"), e["ts"]))
  total = collections.Counter()
  where = lambda e: (e.get("pid"), e.get("tid"))  # noqa: E731
  for e, nxt in zip(kernels, kernels[1:] + [None], strict=True):
    if nxt is not None and where(nxt) == where(e) and nxt["ts"] < e["ts"] + e.get("dur", 0):
      continue  # a container (a conditional's span holds its branch's kernels)
    total[re.sub(r"\.\d+$", "", e["name"])] += e.get("dur", 0) / 1e3 / steps
  return total, state


@jax.jit
def _all_finite(tree):
  """Whether every element of every leaf is finite: one program, not two per leaf shape."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _bits(tree):
  return [np.asarray(x).view(np.uint8).tobytes() for x in jax.tree.leaves(tree)]


def run(name, model, rounds, steps, hlo_dir=None, vs=None, profile_dir=None, donate=True):
  """Benchmarks ``vs`` (default: every variant) on ``model``; prints, returns rows.

  The first variant is the baseline of the ratios; it must be named ``none``.
  """
  kp, kb = jax.random.split(jax.random.key(0))
  params = jax.jit(model.init)(kp)  # one program, not one per eager op
  batch = jax.jit(model.batch_of)(kb)
  vs = variants(model) if vs is None else vs
  traces = {v.name: 0 for v in vs}
  jitted, states, info = {}, {}, {}
  for v in vs:
    def counted(state, b, _v=v):
      traces[_v.name] += 1
      return _v.step(state, b)

    jitted[v.name] = jax.jit(counted, donate_argnums=0 if donate else ())
    state = v.init(jax.tree.map(jnp.copy, params))
    state = jax.block_until_ready(jitted[v.name](state, batch))  # compile + warm up
    compiled = jitted[v.name].lower(state, batch).compile()
    text = compiled.as_text()
    info[v.name] = {"temp": compiled.memory_analysis().temp_size_in_bytes, **hlo_stats(text)}
    if hlo_dir:
      os.makedirs(hlo_dir, exist_ok=True)
      with open(os.path.join(hlo_dir, f"{name}_{v.name}.hlo.txt"), "w") as f:
        f.write(text)
    states[v.name] = state

  times = {v.name: [] for v in vs}
  for r in range(rounds):
    for v in vs[r % len(vs):] + vs[: r % len(vs)]:
      fn, state = jitted[v.name], states[v.name]
      t0 = time.perf_counter()
      with jax.transfer_guard("disallow"):
        for _ in range(steps):
          state = fn(state, batch)
        jax.block_until_ready(state)
      times[v.name].append((time.perf_counter() - t0) / steps)
      states[v.name] = state

  profiles = {}
  for v in vs if profile_dir else ():
    logdir = os.path.join(profile_dir, f"{name}_{v.name}")
    profiles[v.name], states[v.name] = kernel_profile(
        jitted[v.name], states[v.name], batch, steps, logdir)

  bad = _models.poison(batch)
  rows = []
  base = np.asarray(times["none"])
  for v in vs:
    state = states[v.name]
    finite = bool(_all_finite(v.params(state)))
    scale0 = float(v.scale(state)) if v.scale else None
    timed_ok = finite and (scale0 is None or scale0 == SCALE)
    before = _bits(v.params(state))
    state = jitted[v.name](state, bad)
    kept = before == _bits(v.params(state))
    if v.scale:
      overflow = f"kept, scale {scale0:g}->{float(v.scale(state)):g}"
    else:
      overflow = "kept" if kept else "APPLIED"
      kept = kept or v.name == "none"
    if v.name != "none" and not kept:
      overflow = "APPLIED (bug)"
    t = np.asarray(times[v.name])
    ratios = t / base
    rows.append({
        "variant": v.name,
        "ms": 1e3 * float(np.median(t)),
        "spread": float((np.percentile(t, 75) - np.percentile(t, 25)) / np.median(t)),
        "ratio": float(np.median(ratios)),
        "ratio_iqr": (float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))),
        "ratio_of_medians": float(np.median(t) / np.median(base)),
        "traces": traces[v.name],
        "finite_timed": timed_ok,
        "overflow": overflow,
        **info[v.name],
    })
  _print_table(name, model, rounds, steps, rows)
  if profiles:
    print(f"\nkernel time, ms per step (jax.profiler, summed over threads; in {profile_dir})")
    for v_name, kernels in profiles.items():
      top = ", ".join(f"{k} {t:.1f}" for k, t in kernels.most_common(6))
      print(f"{v_name:<16}{sum(kernels.values()):>7.1f}  {top}")
  return rows


def _print_table(name, model, rounds, steps, rows):
  base_temp = max(rows[0]["temp"], 1)
  print(f"\n## {name}: {model}")
  print(f"{rounds} rounds x {steps} steps, jax {jax.__version__} {jax.default_backend()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"ratio = median over rounds of (variant / none in the same round)")
  heads = ["median ms", "spread", "ratio", "IQR", "r(med)", "temp MiB", "temp/none", "traces",
           "kernels", "conds", "copies"]
  widths = [9, 7, 6, 12, 7, 9, 9, 6, 7, 5, 6]
  head = _models.row("variant", 16, heads, widths) + "  finite  overflow step"
  print(head)
  print("-" * len(head))
  for r in rows:
    iqr = f"{r['ratio_iqr'][0]:.2f}-{r['ratio_iqr'][1]:.2f}"
    cells = [f"{r['ms']:.2f}", f"{r['spread']:.0%}", f"{r['ratio']:.3f}", iqr,
             f"{r['ratio_of_medians']:.3f}", f"{r['temp'] / 2**20:.2f}",
             f"{r['temp'] / base_temp:.3f}", r["traces"], r["kernels"], r["conds"], r["copies"]]
    print(_models.row(r["variant"], 16, cells, widths)
          + f"  {'yes' if r['finite_timed'] else 'NO':<6}  {r['overflow']}")
  sys.stdout.flush()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--steps", type=int, default=None,
                      help="steps per variant per round (default: 10 mlp, 3 transformer)")
  parser.add_argument("--model", choices=["mlp", "transformer", "all"], default="all")
  parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
  parser.add_argument("--hlo", metavar="DIR", help="write each compiled step's HLO here")
  parser.add_argument("--no-donate", action="store_true",
                      help="do not donate the state to the step (every variant alike)")
  parser.add_argument("--profile", metavar="DIR",
                      help="trace each variant with jax.profiler and print its top kernels")
  args = parser.parse_args(argv)
  if args.quick:
    models = {"mlp": (_models.MLP(width=64, classes=10, batch=8), 3),
              "transformer": (_models.Transformer(d=32, heads=2, ff=64, seq=16, batch=2), 3)}
    rounds = min(args.rounds, 3)
  else:
    models = {"mlp": (_models.MLP(), 10), "transformer": (_models.Transformer(), 3)}
    rounds = args.rounds
  if jmp is None:
    print("jmp is not installed: its variant is left out (pip install jmp)")
  warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
  for name, (model, steps) in models.items():
    if args.model in (name, "all"):
      run(name, model, rounds, args.steps or steps, args.hlo, profile_dir=args.profile,
          donate=not args.no_donate)


if __name__ == "__main__":
  main()
