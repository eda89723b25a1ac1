"""Every subprocess the suite runs, by name, started together when the session starts.

A test that reads a subprocess's output is marked ``@pytest.mark.runs("name", ...)``
(and ``slow``) and calls :func:`output`. Once collection is done, ``conftest.py``
starts every run a selected test names, the costliest first, two at a time
(the CI machine has two cores), so they work in the background while the
in-process tests run, and a run that two test files read runs once. With
``-m "not slow"`` none starts. The runs of a group (``GROUPS``) share one process
(``tests/_runner.py`` runs them one after another, each as ``python`` would): jax, flax and
optax are imported once per group, not once per run.

Every run inherits the suite's XLA_FLAGS (``tests/conftest.py``: fast compiles, the
same HLO and arithmetic); a run's own flags are appended.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from tests import _runner

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable
# The longest run takes about a minute alone; the margin covers a load of 10 on two cores.
TIMEOUT = 900

GRADSCALER_BLOCK = 0  # the migration guide's first complete block: GradScaler's "after"
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


# The workers and the example set it themselves before importing jax, as they must when run
# alone; in one process (GROUPS) the first import is the one that counts.
EIGHT = "--xla_force_host_platform_device_count=8"


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
    # every program of docs/*.md, and those of the README that show an output (tests/_docs.py)
    "docs": Run((PY, "tests/_docs.py"), 15),
    # several devices in one process (tests/test_multidevice.py, test_scaler.py, test_fp8_*,
    # test_autocast_multidevice.py, test_low_precision.py)
    "md_worker": Run((PY, "tests/md_worker.py"), 19, EIGHT),
    "md_fp8_worker": Run((PY, "tests/md_fp8_worker.py"), 8, EIGHT),
    "md_autocast_worker": Run((PY, "tests/md_autocast_worker.py"), 14, EIGHT),
    "lp_worker": Run((PY, "tests/lp_worker.py"), 16, EIGHT),
    "data_parallel": Run((PY, "examples/data_parallel.py", "--devices", "8", "--steps", "3",
                          "--bad-step", "1", "--fsdp"), 6, EIGHT),
    # the benchmarks' smoke runs
    "bench_bf16": _bench("bench_bf16.py", "--quick", cost=23),
    "bench_sweep": _bench("bench_sweep.py", "--quick", "--models", "mlp8,gpt", cost=26),
    "bench_sweep_codegen": _bench("bench_sweep.py", "--codegen", "--quick", "--models", "mlp8",
                                  "--variants", "ts_select", cost=6),
    "bench_autocast_gpt": _bench("bench_autocast.py", "--model", "gpt", "--quick",
                                 "--gpt-steps", "60", cost=17),
    "bench_cpu": _bench("bench_cpu.py", "--quick", "--profile", "{dir}/trace", cost=17),
    "bench_gpu": _bench("bench_gpu.py", "--quick", cost=18),
    "bench_policy": _bench("bench_policy.py", "--quick", cost=7),
    "bench_find": _bench("bench_find.py", "--quick", cost=22),
    "bench_skip_cuts": _bench("bench_skip_cuts.py", "--quick", "--forms", "before,+group",
                              cost=5),
    "bench_memory": _bench("bench_memory.py", "--quick", cost=16),
    # needs google-tunix: in no group, and started only where tests/test_benchmarks.py finds it
    "bench_rl": _bench("bench_rl.py", "--quick", cost=20),
}


# Runs that share one process (tests/_runner.py runs them one after another, in this order):
# one import of jax, flax and optax (about 4 CPU seconds) instead of one per run. A run in
# no group has a process of its own. The runs of a group have the same XLA flags (they are
# set before jax is imported); the run without matplotlib goes before the one with it.
GROUPS: dict[str, tuple[str, ...]] = {
    "examples": ("digits_no_mpl", "digits", "debugging", "underflow", "clipping",
                 "checkpoint_resume", "accumulation", "docs"),
    "devices8": ("md_worker", "md_autocast_worker", "lp_worker", "md_fp8_worker",
                 "data_parallel"),
    "benchmarks": ("bench_bf16", "bench_sweep", "bench_autocast_gpt", "bench_cpu", "bench_gpu",
                   "bench_policy", "bench_sweep_codegen", "bench_find", "bench_skip_cuts",
                   "bench_memory"),
}


def _check_groups():
  seen: dict[str, str] = {}
  for group, members in GROUPS.items():
    for name in members:
      if name not in RUNS or name in seen:
        raise ValueError(f"GROUPS[{group!r}] names {name!r}: unknown, or in {seen.get(name)!r}")
      seen[name] = group
    flags = {RUNS[n].xla_flags for n in members}
    if len(flags) > 1:
      raise ValueError(f"GROUPS[{group!r}] mixes XLA flags {sorted(flags)}")


_check_groups()


RUNS_DIR = "JMP_SCALER_RUNS_DIR"  # the session's runs directory, for pytest-xdist's workers


class _Pool:
  """The runs of one session, each in a directory of its own, their results in files.

  The session's first process makes the directory (:meth:`open`, from ``pytest_configure``);
  every process that collects tests (the session itself, or each pytest-xdist worker) calls
  :meth:`start`, which runs the groups no other process has claimed (an ``O_EXCL`` file per
  group) and :meth:`stop` waits for them. Any process reads any run's result
  (:func:`output`): the files ``.out/NAME/{returncode,stdout,stderr}``, ``returncode``
  written last.
  """

  def __init__(self):
    self.tmp: pathlib.Path | None = None
    self.owner = False
    self.started: set[str] = set()
    self.executor: concurrent.futures.ThreadPoolExecutor | None = None

  def open(self):
    self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="jmp_scaler_runs_"))
    self.owner = True
    os.environ[RUNS_DIR] = str(self.tmp)

  def start(self, names):
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
      raise ValueError(f"@pytest.mark.runs names unknown runs {unknown}; known: {sorted(RUNS)}")
    if not names:
      return
    if self.tmp is None:
      self.tmp = pathlib.Path(os.environ[RUNS_DIR])
    self.started = set(names)
    jobs = [[n for n in members if n in names] for members in GROUPS.values()]
    grouped = {n for members in jobs for n in members}
    jobs = [m for m in jobs if m] + [[n] for n in sorted(names) if n not in grouped]
    for members in sorted(jobs, key=lambda m: -sum(RUNS[n].cost for n in m)):
      try:  # claimed by this process, or already by another one
        os.close(os.open(self.tmp / f".claim-{'+'.join(members)}", os.O_CREAT | os.O_EXCL))
      except FileExistsError:
        continue
      if self.executor is None:
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=2)
      self.executor.submit(self._run, members)

  def _out(self, name: str) -> pathlib.Path:
    assert self.tmp is not None
    return self.tmp / ".out" / name

  def _run(self, names: list[str]):
    """Runs ``names`` in one process (tests/_runner.py), which writes each one's result; a
    run it did not finish gets the process's status and output as its result."""
    spec = []
    for name in names:
      self.dir(name).mkdir()
      argv = [a.replace("{dir}", str(self.dir(name))) for a in RUNS[name].argv]
      assert argv[0] == PY, argv
      spec.append({"argv": argv[1:], "out": str(self._out(name))})
    spec_file = self.tmp / f".spec-{names[0]}.json"
    spec_file.write_text(json.dumps(spec))
    flags = f"{os.environ.get('XLA_FLAGS', '')} {RUNS[names[0]].xla_flags}".strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "120", "XLA_FLAGS": flags}
    try:
      proc = subprocess.run([PY, str(ROOT / "tests" / "_runner.py"), str(spec_file)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
      why = f"ended with status {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    except BaseException as exc:  # noqa: BLE001 - a timeout, say: every waiting test sees it
      why = f"failed: {exc!r}"
    for name in names:
      out = self._out(name)
      if not (out / "returncode").exists():  # the process died before or during it
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "stderr", "a") as f:
          f.write(f"\n-- the process running {names} {why}")
        _runner.write_status(out, -1)

  def result(self, name: str) -> subprocess.CompletedProcess:
    """Run ``name``'s result, once it is there (whichever process runs it)."""
    if name not in self.started:
      raise AssertionError(
          f"run {name!r} was not started: mark the test @pytest.mark.runs({name!r})")
    out = self._out(name)
    deadline = time.monotonic() + TIMEOUT * len(GROUPS) + 60
    while not (out / "returncode").exists():
      if time.monotonic() > deadline:
        raise AssertionError(f"run {name!r} has no result after {TIMEOUT * len(GROUPS)} s")
      time.sleep(0.2)
    code = int((out / "returncode").read_text())
    return subprocess.CompletedProcess(RUNS[name].argv, code, (out / "stdout").read_text(),
                                       (out / "stderr").read_text())

  def dir(self, name: str) -> pathlib.Path:
    assert self.tmp is not None
    return self.tmp / name

  def stop(self):
    """Waits for the runs this process started. Alone, it first drops those not begun (the
    session is over: ``-x``, say); a pytest-xdist worker runs them all, for the others."""
    if self.executor is not None:
      alone = "PYTEST_XDIST_WORKER" not in os.environ
      self.executor.shutdown(wait=True, cancel_futures=alone)

  def close(self):
    if self.owner and self.tmp is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)


POOL = _Pool()


def output(name: str) -> str:
  """The standard output of run ``name``, once it has succeeded (its output tails if not)."""
  proc = POOL.result(name)
  assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc.stdout


def run_dir(name: str) -> pathlib.Path:
  """The directory run ``name`` wrote to (``{dir}`` in its command)."""
  return POOL.dir(name)
