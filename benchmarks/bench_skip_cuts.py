"""What each cut of the skip's HLO does to the compile, measured in one process.

The ``bench_sweep.py`` MLP with ``--leaves`` leaves (4.2 M parameters), float16 compute, Adam.
Each TrainState mode is compiled with the scaler's check and reciprocal as they were before
each cut, the earlier forms patched in while the step is traced (``FORMS`` keeps them):

  before     pre = where(scale > 2**63, 2**-64, 1); the check unscales by pre, then inv;
             the decision is min(int32 flags) > 0
  +divide    pre = 1 / where(scale > 2**63, 2**64, 1): XLA computes a division once and
             hands it to every kernel, where it recomputed the select in each of them
  +one       the check multiplies by one factor, pre * inv (the same decision at every scale)
  +all       the decision is all(int32 flags > 0): a bool the selects read as it is (c82d056)
  +group     leaves of up to 2**16 elements checked together, at most 2**19 elements a group
             (16 weights of 181x181 at 256 leaves), where only those of up to 2**14 were (now)

against the step without a scaler (``none``) and ``optax.apply_if_finite`` (``aif``). Every
compile starts from cleared caches; the rounds interleave the variants (rotating their
order), and each ratio is the median over rounds of (variant / none in the same round), of
the wall time (``compile``) and of the process CPU time (``cpu``: every thread; less moved
by other processes on a shared machine). ``lines``: the compiled module's length.

  python benchmarks/bench_skip_cuts.py                       # 256 leaves, 7 rounds
  python benchmarks/bench_skip_cuts.py --leaves 64 --rounds 3
  python benchmarks/bench_skip_cuts.py --forms before,+group --rounds 15   # the whole effect
  python benchmarks/bench_skip_cuts.py --quick               # 8 leaves, one round (smoke)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
try:
  import jmp_scaler  # noqa: F401
except ImportError:  # run from a checkout that is not installed
  sys.path.insert(1, os.path.dirname(_HERE))

import _models  # noqa: E402
import bench_sweep  # noqa: E402

from jmp_scaler._leaves import floating_leaves, math_dtype  # noqa: E402
from jmp_scaler.scaling import _scaler  # noqa: E402

_PATCHED = ("reciprocal", "all_finite", "_check_groups")
_NOW = {name: getattr(_scaler, name) for name in _PATCHED}


def _select_reciprocal(scale):
  """The reciprocal before the first cut: ``pre`` a select of two constants."""
  big = scale > 2.0**63
  pre = jnp.where(big, jnp.float32(2.0**-64), jnp.float32(1.0))
  return pre, 1.0 / (scale * pre)


def _groups_up_to_2_to_14(leaves):
  """The check's groups before the last cut: leaves of up to 2**14 elements, 32 a group (on
  one XLA:CPU device, where the check groups them)."""
  groups, small = [], {}
  for g in leaves:
    if g.size > 2**14:
      groups.append([g])
    else:
      small.setdefault(g.shape, []).append(g)
  for same in small.values():
    groups += [same[i : i + 32] for i in range(0, len(same), 32)]
  return groups


def _all_finite(one_factor: bool, combine: str):
  """The check with the two-factor or the one-factor unscaling, and its decision."""

  def all_finite(grads, state):
    pre, inv = _scaler.reciprocal(state.scale)
    one = pre * inv

    def isfinite(g):
      if one_factor:
        return jnp.isfinite((g.astype(math_dtype(g.dtype)) * one).astype(g.dtype))
      return jnp.isfinite(_scaler.unscale_leaf(g, pre, inv))

    flags = [jnp.all(functools.reduce(jnp.logical_and, map(isfinite, group)))
             for group in _scaler._check_groups(floating_leaves(grads))]  # fmt: skip
    ints = jnp.stack(flags).astype(jnp.int32)
    return jnp.min(ints) > 0 if combine == "min" else jnp.all(ints > 0)

  return all_finite


_OLD_GROUPS = {"_check_groups": _groups_up_to_2_to_14}
FORMS = {
    "before": {"reciprocal": _select_reciprocal, "all_finite": _all_finite(False, "min"),
               **_OLD_GROUPS},
    "+divide": {"all_finite": _all_finite(False, "min"), **_OLD_GROUPS},
    "+one": {"all_finite": _all_finite(True, "min"), **_OLD_GROUPS},
    "+all": _OLD_GROUPS,
    "+group": {},
}


@contextlib.contextmanager
def _form(name):
  for attr, fn in {**_NOW, **(FORMS[name] if name else {})}.items():
    setattr(_scaler, attr, fn)
  try:
    yield
  finally:
    for attr, fn in _NOW.items():
      setattr(_scaler, attr, fn)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--leaves", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated, of " +
                      ", ".join(FORMS))
  parser.add_argument("--quick", action="store_true", help="8 leaves of 64x64, one round")
  args = parser.parse_args(argv)
  params = 4 * 64 * 64 if args.quick else _models.DeepMLP.params
  if args.quick:
    args.leaves, args.rounds = 8, 1
  forms = args.forms.split(",")
  for form in forms:
    if form not in FORMS:
      parser.error(f"unknown form {form!r}; choose from {', '.join(FORMS)}")
  warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
  assert _scaler.GROUP_BELOW == 2**16, "run from a checkout with every cut"
  model = _models.DeepMLP(leaves=args.leaves, params=params)
  kp, kb = jax.random.split(jax.random.key(0))
  params = jax.jit(model.init)(kp)
  batch = jax.jit(model.batch_of)(kb)
  table = bench_sweep.variants(model)
  names = [("none", None), ("aif", None)] + [
      (mode, form) for form in forms for mode in ("ts_cond", "ts_select")]
  wall, cpu, lines = ({k: [] for k in names} for _ in range(3))
  for r in range(args.rounds):
    order = names[r % len(names):] + names[: r % len(names)]
    fresh = {k: jax.tree.map(jnp.copy, table[k[0]][0](jax.tree.map(jnp.copy, params)))
             for k in order}  # fmt: skip
    for k in order:
      step = table[k[0]][1]
      jax.clear_caches()
      with _form(k[1]):
        lowered = jax.jit(step, donate_argnums=0).lower(fresh.pop(k), batch)
      t0, c0 = time.perf_counter(), time.process_time()
      compiled = lowered.compile()
      wall[k].append(time.perf_counter() - t0)
      cpu[k].append(time.process_time() - c0)
      lines[k] = len(compiled.as_text().splitlines())
      print(f"  {k[0]} {k[1] or ''}: {wall[k][-1]:.2f} s, cpu {cpu[k][-1]:.2f} s, "
            f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
  base = ("none", None)
  print(f"\n## mlp{args.leaves}: {model}, {args.rounds} interleaved compile rounds, "
        f"jax {jax.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
  widths = [8, 11, 6, 11, 7, 7]
  head = _models.row("variant", 20, ["compile", "IQR", "cpu", "IQR", "comp s", "lines"], widths)
  print(head + "\n" + "-" * len(head))
  for k in names:
    w = np.asarray(wall[k]) / np.asarray(wall[base])
    c = np.asarray(cpu[k]) / np.asarray(cpu[base])
    iqr = lambda x: f"{np.percentile(x, 25):.2f}-{np.percentile(x, 75):.2f}"  # noqa: E731
    label = f"{k[0]} {k[1]}" if k[1] else k[0]
    print(_models.row(label, 20, [f"{np.median(w):.2f}", iqr(w), f"{np.median(c):.2f}", iqr(c),
                                  f"{np.median(wall[k]):.2f}", lines[k]], widths))


if __name__ == "__main__":
  main()
