"""What the scaler costs as the number of parameter leaves grows (issue 14).

A family of residual MLPs with the same parameter count (about 4.2 M) and 8,
64, 256 or 1024 leaves, plus a GPT-style decoder (4 layers, d=256, seq 128, batch 2):
float32 master parameters, float16 compute, Adam. Every variant runs the same
step; the table compares each one with the no-scaler step:

  none          no scaler, no skip (the baseline of every ratio)
  ts_cond       jmp_scaler.TrainState, dynamic_scale(skip_mode="cond")
  ts_select     jmp_scaler.TrainState, dynamic_scale(skip_mode="select")
  ts_select16   ts_select, the gradients taken of the float16 copies of the parameters
                and promoted to float32 (bit-identical here: every leaf is used in float16)
  skip          jmp_scaler.skip_nonfinite(chain(dynamic_scale(), adam)) (skip_mode auto)
  accumulate    jmp_scaler.accumulate_gradients(chain(dynamic_scale(), adam), every_k=1)
  aif           optax.apply_if_finite(adam), static loss scale (optax has no dynamic one)
  bare          chain(dynamic_scale(bare=True), adam) without a skip wrapper

and, on request only (``--variants``):

  ts_select_perleaf  ts_select with one finiteness reduction per leaf, as before small
                     leaves of one shape were checked together (issue 14, fourth pass)

Columns: ``step`` is the median over rounds of (variant / none in the same
round); the rounds interleave the variants (rotating their order), so all of
them see the same machine load, and ``IQR`` is the spread of that ratio over
rounds. ``lower`` and ``compile`` are the ``jit(...).lower`` and ``.compile()``
times over none's, medians over ``--compile-rounds`` rounds (caches cleared before
each) of the ratio in the same round, ``cpu`` the same ratio of the compile's CPU
time (``time.process_time``: every thread of the process; less moved by other
processes on a shared machine than the wall time), ``comp s`` the median compile
time in seconds, ``temp``
the compiled step's temporary memory in MiB (``memory_analysis``), ``+temp``
its excess over none's, ``kernels`` the ops of the compiled entry computation,
``conds`` / ``selects`` / ``reduces`` the ``conditional`` / ``select`` / ``reduce``
instructions in the whole compiled module and ``lines`` its length. Every
timed step is finite (``finite``: finite parameters, and the scale never backed
off) and one overflowing step per variant checks the skip afterwards.

  python benchmarks/bench_sweep.py                    # the whole sweep (~10 min on 2 cores)
  python benchmarks/bench_sweep.py --models mlp256 --variants none,ts_select
  python benchmarks/bench_sweep.py --quick            # tiny sizes, a smoke test
  python benchmarks/bench_sweep.py --hlo /tmp/hlo     # keep each compiled step's HLO
  python benchmarks/bench_sweep.py --codegen          # where each compile's time goes

``--fresh N`` times nothing else: the compile a user meets, the first one in a fresh
process. For each of N rounds every variant (rotating order) starts a new Python process that
imports jax, builds the model and its state (their small programs compiled first, as in a
training script) and then lowers and compiles the step once; the table gives the medians
over rounds of each variant's lower and compile time over none's in the same round, and of
the compile's CPU time. ``--compile-rounds`` measures later compiles in one process instead
(after ``jax.clear_caches``); three successive compiles of one step there are within 10% of
each other, so the two agree but for the load, which a median of three rounds does not
average away (BENCHMARKS.md, "The cost as the leaf count grows").

  python benchmarks/bench_sweep.py --models mlp256 --variants ts_cond,ts_select,aif --fresh 7

``--codegen`` times nothing else: it compiles each step once under ``jax.profiler``
and prints, from XLA:CPU's trace, the distinct kernels it compiled (identical fused
kernels are compiled once), the time spent generating them (fusion emitter, then
LLVM) and in the HLO passes, and the whole compile. One compile each: read the
kernel counts, which do not depend on the load, before the times.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile
import time
import warnings

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

SCALE = 2.0**10  # every timed step is finite at this scale (checked)
LR = 1e-4
VARIANTS = ("none", "ts_cond", "ts_select", "ts_select16", "skip", "accumulate", "aif", "bare")
ON_REQUEST = ("ts_select_perleaf",)


def _scaler(mode="auto"):
  try:
    return jmp_scaler.dynamic_scale(init_scale=SCALE, skip_mode=mode, bare=True)
  except TypeError:  # a version without the `bare` keyword
    return jmp_scaler.dynamic_scale(init_scale=SCALE, skip_mode=mode)


def variants(model):
  """name -> (init(params) -> state, step(state, batch) -> state, params(state), scale)."""
  adam = optax.adam(LR)
  loss = model.loss
  out = {}

  def none_step(state, batch):
    params, opt_state = state
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = adam.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  out["none"] = (lambda p: (p, adam.init(p)), none_step, lambda s: s[0], None)

  def train_state(mode):
    tx = optax.chain(_scaler(mode), adam)

    def step(state, batch):
      grads = jax.grad(lambda p: loss(p, batch) * state.loss_scale)(state.params)
      return state.apply_gradients(grads=grads)

    init = lambda p: jmp_scaler.TrainState.create(apply_fn=loss, params=p, tx=tx)  # noqa: E731
    return init, step, lambda s: s.params, lambda s: s.loss_scale

  out["ts_cond"] = train_state("cond")
  out["ts_select"] = train_state("select")
  init, _, get_params, get_scale = out["ts_select"]

  def c16_step(state, batch):  # gradients of the float16 copies, promoted to float32
    p16 = jax.tree.map(lambda p: p.astype(jnp.float16), state.params)
    g16 = jax.grad(lambda p: loss(p, batch) * state.loss_scale.astype(jnp.float16))(p16)
    return state.apply_gradients(grads=jax.tree.map(lambda g: g.astype(jnp.float32), g16))

  out["ts_select16"] = (init, c16_step, get_params, get_scale)

  def perleaf_step(state, batch):  # traced with the grouping of small leaves turned off
    from jmp_scaler.scaling import _scaler

    grouped = getattr(_scaler, "one_cpu_device", None)
    if grouped is None:  # a version that checks every leaf on its own anyway
      return out["ts_select"][1](state, batch)
    _scaler.one_cpu_device = lambda: False
    try:
      return out["ts_select"][1](state, batch)
    finally:
      _scaler.one_cpu_device = grouped

  out["ts_select_perleaf"] = (init, perleaf_step, get_params, get_scale)

  def optax_style(tx):
    def step(state, batch):
      params, opt_state = state
      s = jmp_scaler.get_scale(opt_state)
      grads = jax.grad(lambda p: loss(p, batch) * s)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return (lambda p: (p, tx.init(p)), step, lambda s: s[0],
            lambda s: jmp_scaler.get_scale(s[1]))

  out["skip"] = optax_style(jmp_scaler.skip_nonfinite(optax.chain(_scaler(), adam)))
  out["accumulate"] = optax_style(
      jmp_scaler.accumulate_gradients(optax.chain(_scaler(), adam), every_k=1))
  out["bare"] = optax_style(optax.chain(_scaler(), adam))
  aif = optax.apply_if_finite(adam, max_consecutive_errors=5)

  def aif_step(state, batch):
    params, opt_state = state
    grads = jax.grad(lambda p: loss(p, batch) * SCALE)(params)
    grads = jax.tree.map(lambda g: g * (1.0 / SCALE), grads)
    updates, opt_state = aif.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  out["aif"] = (lambda p: (p, aif.init(p)), aif_step, lambda s: s[0], None)
  return out


def hlo_stats(text: str) -> dict[str, int]:
  """Counts in a compiled module (see the module docstring)."""
  entry = text[text.index("\nENTRY"):]
  entry = entry[: entry.index("\n}")]
  trivial = ("parameter(", "get-tuple-element(", "tuple(", "constant(", "bitcast(")
  kernels = [ln for ln in entry.splitlines()[1:] if "=" in ln and not any(t in ln for t in trivial)]
  lines = text.splitlines()
  count = lambda op: sum(f" {op}(" in ln for ln in lines)  # noqa: E731
  return {"kernels": len(kernels), "conds": count("conditional"), "selects": count("select"),
          "reduces": count("reduce"), "lines": len(lines)}


@jax.jit
def _all_finite(tree):
  """Whether every element of every leaf is finite: one program, not two per leaf shape."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _bits(tree):
  return [np.asarray(x).view(np.uint8).tobytes() for x in jax.tree.leaves(tree)]


def run(name, model, names, rounds, steps, hlo_dir=None, compile_rounds=3):
  """Benchmarks the variants ``names`` (the first must be ``none``) on ``model``."""
  kp, kb = jax.random.split(jax.random.key(0))
  params = jax.jit(model.init)(kp)  # one program, not one per eager op
  batch = jax.jit(model.batch_of)(kb)
  table = variants(model)
  fns, states, info = {}, {}, {}
  lowers, compiles = {v: [] for v in names}, {v: [] for v in names}
  cpus = {v: [] for v in names}
  for r in range(compile_rounds):
    order = names[r % len(names):] + names[: r % len(names)]
    # Copies: init may hand out one buffer for equal constants, and each is donated. Every
    # state of the round is made before the first clear_caches (eagerly, so its small
    # programs compile once a round, not once a variant).
    fresh = {v: jax.tree.map(jnp.copy, table[v][0](jax.tree.map(jnp.copy, params)))
             for v in order}
    for v in order:
      _, step, _, _ = table[v]
      state = fresh.pop(v)
      jax.clear_caches()  # trace, lower and compile from scratch every round
      t0 = time.perf_counter()
      lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
      t1, c1 = time.perf_counter(), time.process_time()
      compiled = lowered.compile()
      t2, c2 = time.perf_counter(), time.process_time()
      lowers[v].append(t1 - t0)
      compiles[v].append(t2 - t1)
      cpus[v].append(c2 - c1)
      print(f"  {name} {v}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s, "
            f"cpu {c2 - c1:.2f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
      if v in fns:
        continue
      text = compiled.as_text()
      info[v] = {"temp": compiled.memory_analysis().temp_size_in_bytes, **hlo_stats(text)}
      if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"{name}_{v}.hlo.txt"), "w") as f:
          f.write(text)
      fns[v] = compiled
      states[v] = jax.block_until_ready(compiled(state, batch))  # warm up
  for v in names:  # medians over rounds of the ratio to none in the same round
    info[v]["lower"] = float(np.median(np.asarray(lowers[v]) / np.asarray(lowers["none"])))
    info[v]["compile"] = float(np.median(np.asarray(compiles[v]) / np.asarray(compiles["none"])))
    info[v]["cpu"] = float(np.median(np.asarray(cpus[v]) / np.asarray(cpus["none"])))
    info[v]["compile_s"] = float(np.median(compiles[v]))

  times = {v: [] for v in names}
  order = list(names)
  for r in range(rounds):
    for v in order[r % len(order):] + order[: r % len(order)]:
      fn, state = fns[v], states[v]
      t0 = time.perf_counter()
      with jax.transfer_guard("disallow"):
        for _ in range(steps):
          state = fn(state, batch)
        jax.block_until_ready(state)
      times[v].append((time.perf_counter() - t0) / steps)
      states[v] = state

  bad = _models.poison(batch)
  base, rows = np.asarray(times["none"]), []
  for v in names:
    _, _, get_params, get_scale = table[v]
    state = states[v]
    finite = bool(_all_finite(get_params(state)))
    # ... and no timed step was skipped (a skipped step costs less): the scale never moved.
    finite = finite and (get_scale is None or float(get_scale(state)) == SCALE)
    before = _bits(get_params(state))
    state = fns[v](state, bad)
    kept = before == _bits(get_params(state))
    ratios = np.asarray(times[v]) / base
    rows.append({
        "variant": v, "ms": 1e3 * float(np.median(times[v])),
        "ratio": float(np.median(ratios)),
        "iqr": (float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))),
        "finite": finite, "kept": kept, **info[v],
    })
  _print_table(name, model, rounds, steps, rows)
  return rows


def codegen(name, model, names):
  """One traced compile per variant: XLA:CPU's distinct kernels and where the time went."""
  kp, kb = jax.random.split(jax.random.key(0))
  params = jax.jit(model.init)(kp)  # one program, not one per eager op
  batch = jax.jit(model.batch_of)(kb)
  table = variants(model)
  heads = ["kernels", "emit ms", "llvm ms", "passes ms", "compile ms"]
  widths = [7, 8, 8, 9, 10]
  head = _models.row("variant", 18, heads, widths)
  print(f"\n## {name}: {model}, one compile each, jax {jax.__version__}, "
        f"load {os.getloadavg()[0]:.1f}\n{head}\n{'-' * len(head)}")
  for v in names:
    init, step, _, _ = table[v]
    jax.clear_caches()
    lowered = jax.jit(step, donate_argnums=0).lower(init(params), batch)
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      t0 = time.perf_counter()
      lowered.compile()
      ms = 1e3 * (time.perf_counter() - t0)
    found = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not found:
      raise SystemExit(f"jax.profiler wrote no perfetto trace under {trace_dir}")
    with gzip.open(found[0]) as f:
      events = json.load(f)
    events = [e for e in (events.get("traceEvents", []) if isinstance(events, dict) else events)
              if e.get("ph") == "X"]
    total = lambda pred, ev=events: sum(e["dur"] for e in ev if pred(e["name"])) / 1e3  # noqa: E731
    counts = [e.get("args", {}).get("num_compiled_functions")
              for e in events if e["name"] == "Codegen"]
    if not counts or None in counts:  # another XLA: a zero would look like a figure
      print(f"{v:<18}XLA:CPU's trace has no kernel count (jax {jax.__version__}): not read")
      continue
    kernels = sum(map(int, counts))
    cells = [kernels, f"{total(lambda n: n == 'FusionCompiler::Compile'):.0f}",
             f"{total(lambda n: n == 'Codegen'):.0f}",
             f"{total(lambda n: n.startswith('HLO passes ')):.0f}", f"{ms:.0f}"]
    print(_models.row(v, 18, cells, widths))
  sys.stdout.flush()


def _print_table(name, model, rounds, steps, rows):
  base = rows[0]
  leaves = len(jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
  print(f"\n## {name}: {model} ({leaves} leaves)")
  print(f"{rounds} rounds x {steps} steps, jax {jax.__version__} {jax.default_backend()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; ratios to none")
  w = max(12, *(len(r['variant']) + 1 for r in rows))
  names = ["ms", "step", "IQR", "lower", "compile", "cpu", "comp s", "temp", "+temp", "kernels",
           "conds", "selects", "reduces", "lines"]
  widths = [8, 6, 11, 6, 7, 5, 7, 7, 6, 7, 5, 7, 7, 7]
  head = _models.row("variant", w, names, widths) + "  finite  overflow"
  print(head)
  print("-" * len(head))
  for r in rows:
    iqr = f"{r['iqr'][0]:.2f}-{r['iqr'][1]:.2f}"
    # none applies the overflow; bare runs Adam on zeros (documented); others must keep.
    moved = {"none": "APPLIED", "bare": "moved (bare)"}.get(r["variant"], "APPLIED (bug)")
    kept = "kept" if r["kept"] else moved
    cells = [f"{r['ms']:.2f}", f"{r['ratio']:.2f}", iqr, f"{r['lower']:.2f}",
             f"{r['compile']:.2f}", f"{r['cpu']:.2f}", f"{r['compile_s']:.2f}",
             f"{r['temp'] / 2**20:.1f}", f"{(r['temp'] - base['temp']) / 2**20:.1f}",
             r["kernels"], r["conds"], r["selects"], r["reduces"], r["lines"]]
    print(_models.row(r["variant"], w, cells, widths)
          + f"  {'yes' if r['finite'] else 'NO':<6}  {kept}")
  sys.stdout.flush()


def first_compile(model, variant: str) -> None:
  """In this (fresh) process: lower and compile ``variant``'s step once, and print the times."""
  kp, kb = jax.random.split(jax.random.key(0))
  params = jax.jit(model.init)(kp)
  batch = jax.jit(model.batch_of)(kb)
  init, step, _, _ = variants(model)[variant]
  state = init(params)
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
  t1, c1 = time.perf_counter(), time.process_time()
  lowered.compile()
  t2, c2 = time.perf_counter(), time.process_time()
  print(f"first_compile lower={t1 - t0:.4f} compile={t2 - t1:.4f} cpu={c2 - c1:.4f}", flush=True)


def fresh(name: str, names: list[str], rounds: int, quick: bool) -> None:
  """Medians over ``rounds`` of each variant's first compile (fresh process) over none's."""
  import subprocess

  found: dict[str, list[dict[str, float]]] = {v: [] for v in names}
  for r in range(rounds):
    for v in names[r % len(names):] + names[: r % len(names)]:
      argv = [sys.executable, os.path.abspath(__file__), "--first-compile", v, "--models", name]
      out = subprocess.run(argv + (["--quick"] if quick else []), capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
      line = next(ln for ln in out.splitlines() if ln.startswith("first_compile"))
      found[v].append({k: float(x) for k, x in (p.split("=") for p in line.split()[1:])})
      print(f"  {name} {v} round {r}: {line}, load {os.getloadavg()[0]:.1f}", file=sys.stderr,
            flush=True)
  print(f"\n## {name}: first compile in a fresh process, {rounds} rounds interleaved "
        "(medians of the per-round ratio to none)")
  widths = (7, 7, 7, 8)
  print(_models.row("variant", 12, ["lower", "compile", "cpu", "comp s"], widths))
  for v in names:
    ratio = {k: np.median([a[k] / b[k] for a, b in zip(found[v], found["none"], strict=True)])
             for k in ("lower", "compile", "cpu")}  # fmt: skip
    cells = [f"{ratio['lower']:.2f}", f"{ratio['compile']:.2f}", f"{ratio['cpu']:.2f}",
             f"{np.median([a['compile'] for a in found[v]]):.2f}"]
    print(_models.row(v, 12, cells, widths), flush=True)


def models(quick: bool) -> dict[str, object]:
  if quick:
    return {"mlp8": _models.DeepMLP(leaves=8, params=4096, batch=4),
            "mlp64": _models.DeepMLP(leaves=64, params=4096, batch=4),
            "gpt": _models.GPT(layers=1, d=16, heads=2, seq=8, batch=2, vocab=32)}
  return {f"mlp{n}": _models.DeepMLP(leaves=n) for n in (8, 64, 256, 1024)} | {
      "gpt": _models.GPT(layers=4, batch=2)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=None,
                      help="steps per variant per round (default: 3 mlp, 1 gpt)")
  parser.add_argument("--models", default="all", help="comma-separated, e.g. mlp8,gpt")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="comma-separated; none is always run first")
  parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
  parser.add_argument("--hlo", metavar="DIR", help="write each compiled step's HLO here")
  parser.add_argument("--compile-rounds", type=int, default=3,
                      help="times each step is traced, lowered and compiled (medians)")
  parser.add_argument("--codegen", action="store_true",
                      help="only where each compile's time goes (kernels, codegen, passes)")
  parser.add_argument("--fresh", type=int, default=0, metavar="N",
                      help="only the first compile in a fresh process, N rounds (medians)")
  parser.add_argument("--first-compile", metavar="VARIANT", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  zoo = models(args.quick)
  chosen = list(zoo) if args.models == "all" else args.models.split(",")
  names = ["none"] + [v for v in args.variants.split(",") if v and v != "none"]
  for v in names:
    if v not in VARIANTS + ON_REQUEST:
      parser.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS + ON_REQUEST)}")
  rounds = min(args.rounds, 2) if args.quick else args.rounds
  warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
  if args.first_compile:
    first_compile(zoo[chosen[0]], args.first_compile)
    return
  for name in chosen:
    if args.fresh:
      fresh(name, names, args.fresh, args.quick)
      continue
    if args.codegen:
      codegen(name, zoo[name], names)
      continue
    steps = args.steps or (1 if args.quick or name == "gpt" else 3)
    run(name, zoo[name], names, rounds, steps, args.hlo,
        1 if args.quick else args.compile_rounds)


if __name__ == "__main__":
  main()
