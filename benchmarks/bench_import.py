"""What ``import jmp_scaler`` costs on top of the libraries it builds on.

Runs, each in a fresh Python process and in interleaved rounds (the order alternating from
round to round, so both see the same machine load):

  base        import jax, flax.linen, optax
  jmp_scaler  import jax, flax.linen, optax, jmp_scaler

Each process times its own imports (``time.perf_counter`` around them, so the interpreter's
start-up is left out; and ``time.process_time``, the CPU time, which other processes on the
machine move less) and prints the figures; the table gives the best and the median over rounds
of each, and their differences. The best is the figure to compare across changes (the least
disturbed by other processes); the median says how much the load moves it.

  python benchmarks/bench_import.py               # 11 rounds
  python benchmarks/bench_import.py --rounds 21
  python benchmarks/bench_import.py --modules     # also: what jmp_scaler alone pulls in
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import subprocess
import sys

BASE = "import jax, flax.linen, optax"
VARIANTS = {"base": BASE, "jmp_scaler": BASE + "; import jmp_scaler"}

# The child: the wall and CPU time of the imports, in seconds, on its last line of output.
_CHILD = ("import time\nt0, c0 = time.perf_counter(), time.process_time()\n{stmt}\n"
          "print(time.perf_counter() - t0, time.process_time() - c0)\n")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
  """The environment of the children: this checkout importable even if not installed."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
  return env


def time_import(stmt: str) -> tuple[float, float]:
  """Wall and CPU seconds ``stmt`` takes in a fresh interpreter (start-up left out)."""
  out = subprocess.run([sys.executable, "-c", _CHILD.format(stmt=stmt)], env=_env(),
                       capture_output=True, text=True, check=True).stdout  # fmt: skip
  wall, cpu = out.strip().splitlines()[-1].split()
  return float(wall), float(cpu)


def measure(rounds: int) -> dict[str, list[tuple[float, float]]]:
  """Each variant's (wall, CPU) times over ``rounds`` interleaved rounds (one warm-up round
  first, not counted: it fills the file system cache and writes the bytecode)."""
  times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
  for stmt in VARIANTS.values():
    time_import(stmt)
  names = list(VARIANTS)
  for r in range(rounds):
    for name in names if r % 2 == 0 else names[::-1]:
      times[name].append(time_import(VARIANTS[name]))
  return times


def new_modules() -> list[str]:
  """The top-level packages ``import jmp_scaler`` loads on top of the base imports."""
  code = (f"import sys; {BASE}; before = set(sys.modules); import jmp_scaler; "
          "print(sorted({m.split('.')[0] for m in set(sys.modules) - before}))")
  out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                       text=True, check=True).stdout  # fmt: skip
  return eval(out.strip().splitlines()[-1])  # noqa: S307 - a list of names we printed


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=11, help="rounds (at least 5)")
  parser.add_argument("--modules", action="store_true",
                      help="also list the top-level packages jmp_scaler imports on top")
  args = parser.parse_args()
  if args.rounds < 5:
    parser.error("--rounds must be at least 5")
  times = measure(args.rounds)
  stats = {}  # name -> (best wall, median wall, best cpu, median cpu)
  for name, pairs in times.items():
    wall, cpu = [p[0] for p in pairs], [p[1] for p in pairs]
    stats[name] = (min(wall), statistics.median(wall), min(cpu), statistics.median(cpu))
  diff = tuple(a - b for a, b in zip(stats["jmp_scaler"], stats["base"], strict=True))
  print(f"import time, {args.rounds} interleaved rounds, fresh processes "
        f"(python {sys.version.split()[0]}, jax {importlib.metadata.version('jax')}), seconds:")
  labels = {"base": BASE, "jmp_scaler": "the same + import jmp_scaler"}
  width = max(map(len, labels.values()))
  head = ("wall best", "wall median", "cpu best", "cpu median")
  print(f"  {'':<{width}}" + "".join(f"  {h:>11}" for h in head))
  for name, label in labels.items():
    print(f"  {label:<{width}}" + "".join(f"  {x:11.3f}" for x in stats[name]))
  print(f"  {'difference':<{width}}" + "".join(f"  {x:11.3f}" for x in diff))
  if args.modules:
    print(f"top-level packages jmp_scaler adds: {', '.join(new_modules()) or 'none'}")


if __name__ == "__main__":
  main()
