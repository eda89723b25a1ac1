"""Running the examples as subprocesses, two at a time, for the tests that read their output."""

import concurrent.futures
import functools
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def start_runs(commands: dict[str, list[str]]) -> dict[str, concurrent.futures.Future]:
  """Starts every command (two at a time: CI has two cores); returns their futures by name."""
  # Tiny runs are all compilation: spend less of it on LLVM optimisation.
  flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "120",
         "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
  # The longest run takes about 20 s alone; the margin covers a load of 10 on two cores.
  run = functools.partial(subprocess.run, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
  return {name: pool.submit(run, cmd) for name, cmd in commands.items()}


def stdout_of(runs: dict[str, concurrent.futures.Future], name: str) -> str:
  """The run's standard output, once it has succeeded (its output tails if not)."""
  proc = runs[name].result()
  assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc.stdout


def run_benchmark(script: str, *args: str) -> str:
  """Runs ``benchmarks/<script> *args`` on the CPU; returns its standard output once it succeeds.

  Benchmarks run with tiny sizes here, where compilation dominates: XLA:CPU's
  default codegen spends seconds per step, these flags a tenth of that.
  """
  flags = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=900)  # load 10: margin
  assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
  return proc.stdout
