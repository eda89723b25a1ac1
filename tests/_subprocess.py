"""Every subprocess the suite runs, by name, started together when the session starts.

A test that reads a subprocess's output is marked ``@pytest.mark.runs("name", ...)``
(and ``slow``) and calls :func:`output`. Once collection is done, ``conftest.py``
starts every run a selected test names, the costliest first, two at a time
(the CI machine has two cores), so they work in the background while the
in-process tests run, and a run that two test files read runs once. With
``-m "not slow"`` none starts.

Every run inherits the suite's XLA_FLAGS (``tests/conftest.py``: fast compiles, the
same HLO and arithmetic); a run's own flags are appended.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable
# The longest run takes about a minute alone; the margin covers a load of 10 on two cores.
TIMEOUT = 900

GRADSCALER_BLOCK = 0  # the migration guide's first complete block: GradScaler's "after"
DOCS = (  # runs the complete blocks of each doc ("before" blocks start with a comment)
    "import re, sys\n"
    "for doc in sys.argv[1:]:\n"
    "  text = open(doc).read()\n"
    "  blocks = [b for b in re.findall(r'```python\\n(.*?)```', text, flags=re.S)\n"
    "            if b.startswith('import ')]\n"
    "  for i, block in enumerate(blocks):\n"
    "    print(f'== block {i} of {doc}', flush=True)\n"
    "    exec(compile(block, doc, 'exec'), {})\n"
    "  print(f'ran {len(blocks)} blocks of {doc}')\n"
)
NO_MATPLOTLIB = (  # runs an example with `import matplotlib` failing, as if not installed
    "import runpy, sys; sys.modules['matplotlib'] = None; path = sys.argv[1]; "
    "sys.argv = sys.argv[1:]; runpy.run_path(path, run_name='__main__')"
)


@dataclasses.dataclass(frozen=True)
class Run:
  """A command (``{dir}`` stands for the run's own empty directory) and its XLA flags."""

  argv: tuple[str, ...]
  cost: float  #: CPU seconds measured alone (order of start: costliest first)
  xla_flags: str = ""  #: appended to the suite's XLA_FLAGS


def _bench(script: str, *args: str, cost: float) -> Run:
  return Run((PY, f"benchmarks/{script}", *args), cost)


RUNS: dict[str, Run] = {
    # examples (tests/test_examples.py, test_example_outputs.py, test_accumulate.py,
    # test_checkpoint.py)
    "digits": Run((PY, "examples/digits.py", "--steps", "120", "--hidden", "32", "--log-every",
                   "20", "--growth-interval", "7", "--out", "{dir}/plots"), 18),
    "digits_no_mpl": Run((PY, "-c", NO_MATPLOTLIB, "examples/digits.py", "--steps", "3",
                          "--hidden", "8", "--out", "{dir}/plots"), 17),
    "debugging": Run((PY, "examples/debugging.py", "--steps", "60", "--window", "20"), 20),
    "underflow": Run((PY, "examples/underflow.py", "--steps", "40"), 17),
    "clipping": Run((PY, "examples/clipping.py", "--steps", "40"), 13),
    "checkpoint_resume": Run((PY, "examples/checkpoint_resume.py", "--steps", "40", "--dir",
                              "{dir}/ckpt"), 9),
    "accumulation": Run((PY, "examples/accumulation.py", "--steps", "4", "--every-k", "4"), 6),
    "docs": Run((PY, "-c", DOCS, "docs/migration.md", "docs/diagnostics.md"), 15),
    # several devices in one process (tests/test_multidevice.py, test_scaler.py, test_fp8_*,
    # test_autocast_multidevice.py, test_low_precision.py)
    "md_worker": Run((PY, "tests/md_worker.py"), 19),
    "md_fp8_worker": Run((PY, "tests/md_fp8_worker.py"), 8),
    "md_autocast_worker": Run((PY, "tests/md_autocast_worker.py"), 14),
    "lp_worker": Run((PY, "tests/lp_worker.py"), 16),
    "data_parallel": Run((PY, "examples/data_parallel.py", "--devices", "4", "--steps", "3",
                          "--bad-step", "1", "--fsdp"), 6),
    # the benchmarks' smoke runs
    "bench_bf16": _bench("bench_bf16.py", "--quick", cost=63),
    "bench_sweep": _bench("bench_sweep.py", "--quick", "--models", "mlp8,gpt", cost=39),
    "bench_sweep_codegen": _bench("bench_sweep.py", "--codegen", "--quick", "--models", "mlp8",
                                  "--variants", "ts_select", cost=7),
    "bench_autocast_gpt": _bench("bench_autocast.py", "--model", "gpt", "--quick",
                                 "--gpt-steps", "60", cost=26),
    "bench_cpu": _bench("bench_cpu.py", "--quick", "--profile", "{dir}/trace", cost=20),
    "bench_gpu": _bench("bench_gpu.py", "--quick", cost=20),
    "bench_policy": _bench("bench_policy.py", "--quick", cost=9),
}


class _Pool:
  """The runs of one session: futures by name, each run in a directory of its own."""

  def __init__(self):
    self.futures: dict[str, concurrent.futures.Future] = {}
    self.tmp: pathlib.Path | None = None
    self.executor: concurrent.futures.ThreadPoolExecutor | None = None

  def start(self, names):
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
      raise ValueError(f"@pytest.mark.runs names unknown runs {unknown}; known: {sorted(RUNS)}")
    if not names:
      return
    self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="jmp_scaler_runs_"))
    self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    for name in sorted(names, key=lambda n: -RUNS[n].cost):
      self.futures[name] = self.executor.submit(self._run, name)

  def _run(self, name: str) -> subprocess.CompletedProcess:
    run, where = RUNS[name], self.dir(name)
    where.mkdir()
    flags = f"{os.environ.get('XLA_FLAGS', '')} {run.xla_flags}".strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "120", "XLA_FLAGS": flags}
    argv = [a.replace("{dir}", str(where)) for a in run.argv]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)

  def dir(self, name: str) -> pathlib.Path:
    assert self.tmp is not None
    return self.tmp / name

  def stop(self):
    if self.executor is not None:
      for f in self.futures.values():
        f.cancel()
      self.executor.shutdown(wait=True)
    if self.tmp is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)


POOL = _Pool()


def output(name: str) -> str:
  """The standard output of run ``name``, once it has succeeded (its output tails if not)."""
  if name not in POOL.futures:
    raise AssertionError(f"run {name!r} was not started: mark the test @pytest.mark.runs({name!r})")
  proc = POOL.futures[name].result()
  assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc.stdout


def run_dir(name: str) -> pathlib.Path:
  """The directory run ``name`` wrote to (``{dir}`` in its command)."""
  return POOL.dir(name)

