"""The XLA flags and compile options the suite asks for, as the installed XLA accepts them.

XLA removes flags between releases (``--xla_cpu_use_fusion_emitters`` is gone from jax 0.12's
XLA), and an unknown flag in ``XLA_FLAGS`` aborts the process at the first use of a device,
before a test can say why (pytest-xdist then reports only ``node down``); as a compile option
it fails the compile (``No such compile option``). So the suite asks for :data:`WANTED` once,
in a subprocess, drops what that XLA refuses and says so in one line (:func:`note`), and every
flag string and ``compiler_options`` dict of the tests comes from here. A successful probe is
cached per jaxlib version and interpreter in the temporary directory (one probe per machine,
about a second; a failed one is asked again next session), and handed to pytest-xdist's
workers and the suite's subprocesses in the environment.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile

#: What the suite asks XLA for, and why: its programs are small and many, compiling them is most
#: of its time, and most of a compile is LLVM optimising code that runs for microseconds. The
#: HLO passes and the IEEE arithmetic are the same with and without them (XLA:CPU never enables
#: fast-math; the tests that count copies, conditionals and kernels read the HLO).
WANTED = {
  "xla_backend_optimization_level": "0",  # no LLVM optimisation
  "xla_llvm_disable_expensive_passes": "true",
  # XLA:CPU's older loop emitters compile in a third of the time (jax <= 0.10's XLA only: the
  # flag is gone from jax 0.12's, where the fusion emitters are the only ones).
  "xla_cpu_use_fusion_emitters": "false",
  # Each program's LLVM module compiled whole: split in parts for threads it costs some 10%
  # more CPU, and the suite's two processes already fill both cores.
  "xla_cpu_parallel_codegen_split_count": "1",
}
#: XLA:CPU's own defaults for the same options: a test that must see the code users get compiles
#: with these (tests/test_ecosystem.py's bit-for-bit Adam).
DEFAULTS = {
  "xla_backend_optimization_level": "2",
  "xla_llvm_disable_expensive_passes": "false",
  "xla_cpu_use_fusion_emitters": "true",
}
_ENV = "JMP_SCALER_TEST_XLA"  # the probe's answer, handed to workers and subprocesses
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_PROBE = "import jax; jax.devices(); jax.jit(lambda x: x + 1)(1.0).block_until_ready()"


def _flags(names) -> str:
  return " ".join(f"--{n}={WANTED[n]}" for n in names)


def _probe() -> dict:
  """Runs a tiny program under the wanted flags, dropping each one XLA names as unknown."""
  names, refused, failure = list(WANTED), [], ""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  for _ in range(len(WANTED) + 1):
    try:
      run = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**env, "XLA_FLAGS": _flags(names)},
        capture_output=True, text=True, timeout=600,
      )
    except subprocess.TimeoutExpired:  # a stalled machine: XLA's defaults, said in the note
      return {"accepted": [], "refused": names, "failure": "the probe timed out (600 s)"}
    if run.returncode == 0:
      return {"accepted": names, "refused": refused, "failure": failure}
    unknown = [n for n in names if any(f"--{n}" in m for m in _UNKNOWN.findall(run.stderr))]
    if not unknown:  # it failed for another reason: XLA's defaults, and the reason in the note
      failure = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1][:200]
      return {"accepted": [], "refused": names, "failure": failure}
    refused += unknown
    names = [n for n in names if n not in unknown]
  return {"accepted": [], "refused": list(WANTED), "failure": "the probe did not settle"}


def _cache_path() -> str:
  try:
    jaxlib = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    jaxlib = "none"
  key = json.dumps([jaxlib, sys.executable, sorted(WANTED.items())])
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  return os.path.join(tempfile.gettempdir(), f"jmp_scaler_xla_{jaxlib}_{digest}.json")


def answer() -> dict:
  """The probe's answer: ``accepted`` and ``refused`` flag names, ``failure`` (or "")."""
  if _ENV in os.environ:
    return json.loads(os.environ[_ENV])
  path = _cache_path()
  try:
    with open(path) as f:
      result = json.load(f)
  except (OSError, ValueError):
    result = _probe()
    if not result["failure"]:  # a failed probe (a broken install, a stall) is asked again
      tmp = f"{path}.{os.getpid()}"
      with open(tmp, "w") as f:
        json.dump(result, f)
      os.replace(tmp, path)  # whole or not at all: a concurrent reader never sees half
  os.environ[_ENV] = json.dumps(result)
  return result


def flags() -> str:
  """The accepted flags as an ``XLA_FLAGS`` string."""
  return _flags(answer()["accepted"])


def _value(text: str):
  return {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)


def compile_options() -> dict:
  """``jax.jit(..., compiler_options=...)``: the :data:`WANTED` options this XLA accepts."""
  return {n: _value(WANTED[n]) for n in answer()["accepted"]}


def default_options() -> dict:
  """XLA's :data:`DEFAULTS` for the options this XLA accepts, as ``compiler_options``."""
  return {n: _value(v) for n, v in DEFAULTS.items() if n in answer()["accepted"]}


def note() -> str:
  """One line on what the suite could not ask for (empty when XLA took every flag)."""
  result = answer()
  if result["failure"]:
    return f"XLA flags: none (XLA's defaults): the probe failed with: {result['failure']}"
  if result["refused"]:
    return (f"XLA flags: {', '.join(result['refused'])} unknown to this XLA, left out "
            "(its defaults apply there)")
  return ""
