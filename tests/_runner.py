"""Runs several of tests/_subprocess.py's runs one after another in this one process.

``python tests/_runner.py SPEC.json``: SPEC lists ``{"argv", "out"}`` entries, each a
command as the shell would run it without ``python`` in front (a script and its arguments,
or ``-c CODE ARGS``). Each runs as ``python`` would run it (``__main__``, ``sys.argv``,
the script's folder first on ``sys.path``), with its standard output and error written to
``OUT/stdout`` and ``OUT/stderr`` and its exit status to ``OUT/returncode``. A failing run
(an exception, or ``SystemExit`` with a non-zero status) is recorded and the next one runs.

A process imports jax, flax and optax once (about 4 CPU seconds) instead of once per run,
and runs share nothing else that a script can see: each gets fresh module globals, its own
warning filters, and the ``sys.modules`` entries it blocks (``sys.modules[name] = None``,
as the run without matplotlib does) are removed after it.
"""

import contextlib
import json
import os
import pathlib
import runpy
import sys
import traceback
import warnings


def _status(exc: SystemExit) -> int:
  if exc.code is None:
    return 0
  return exc.code if isinstance(exc.code, int) else 1


def run_one(argv: list[str], where: pathlib.Path) -> int:
  """Runs ``argv`` as ``python`` would, its output in ``where``; returns its exit status."""
  where.mkdir(parents=True, exist_ok=True)
  blocked = {k for k, v in sys.modules.items() if v is None}
  path = list(sys.path)
  with (open(where / "stdout", "w") as out, open(where / "stderr", "w") as err,
        contextlib.redirect_stdout(out), contextlib.redirect_stderr(err),
        warnings.catch_warnings()):
    status = 0
    try:
      if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
      else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
      status = _status(exc)
    except BaseException:  # noqa: BLE001 - recorded as the run's failure, as python would
      traceback.print_exc()
      status = 1
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      sys.path[:] = path
      for name in [k for k, v in sys.modules.items() if v is None and k not in blocked]:
        del sys.modules[name]
  write_status(where, status)
  return status


def write_status(where: pathlib.Path, status: int):
  """``where/returncode``, whole or not at all (another process may be polling for it)."""
  (where / ".returncode").write_text(str(status))
  os.replace(where / ".returncode", where / "returncode")


def main():
  spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
  for entry in spec:
    run_one(entry["argv"], pathlib.Path(entry["out"]))


if __name__ == "__main__":
  main()
