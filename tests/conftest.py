import os
import sys

import pytest
from hypothesis import settings

from tests import _xla

# Tests run on the CPU with one device; multi-device tests start subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite's programs are small and many: compiling them is most of its time, so it asks XLA
# for fast compiles (tests/_xla.py: the same HLO and IEEE arithmetic; the whole suite passes with
# and without them), keeping only the flags the installed XLA accepts: an unknown flag in
# XLA_FLAGS aborts the process. They hold for this process, pytest-xdist's workers and every
# subprocess the suite starts (tests/_subprocess.py), and are set before any test imports jax.
# A test that must see XLA's default codegen passes compiler_options to its jax.jit
# (tests/test_ecosystem.py does for the bit-for-bit Adam).
if "jax" in sys.modules:
  raise RuntimeError("jax was imported before tests/conftest.py could set XLA_FLAGS")
FAST_COMPILE = _xla.flags()
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):  # pytest-xdist's workers inherit them
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

# Hypothesis profiles. "ci" (selected when CI is set, as CI runs with CI=true): the
# examples derive from each test's source, so a CI failure replays on any machine,
# and no example database carries state between runs. "dev": random examples, each
# failure printed with the `@reproduce_failure` blob that replays it. Choose one
# explicitly with `pytest --hypothesis-profile=ci`; `--hypothesis-seed=N` fixes the seed.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
PROFILE = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(PROFILE)


def pytest_report_header(config):
  profile = config.getoption("hypothesis_profile", None) or PROFILE
  lines = [f"hypothesis profile: {profile} (derandomize={settings.default.derandomize})"]
  return lines + [line for line in [_xla.note()] if line]


def pytest_collection_modifyitems(config, items):
  """The tests that read a subprocess's output go last, in their order: the in-process tests
  run first, while the subprocesses work in the background (``tests/_subprocess.py``)."""
  del config
  waits = [item.get_closest_marker("runs") is not None for item in items]
  pairs = list(zip(items, waits, strict=True))
  items[:] = [i for i, w in pairs if not w] + [i for i, w in pairs if w]


def pytest_configure(config):
  """The session's directory of runs (``tests/_subprocess.py``), made once: by the session, not
  by each of pytest-xdist's workers, which inherit it."""
  from tests import _subprocess

  if not hasattr(config, "workerinput"):
    _subprocess.POOL.open()


def pytest_unconfigure(config):
  from tests import _subprocess

  if not hasattr(config, "workerinput"):
    _subprocess.POOL.close()


def pytest_collection_finish(session):
  """Starts every subprocess that a selected test reads and no other process of the session
  has started (``tests/_subprocess.py``)."""
  from tests import _subprocess

  names = set()
  for item in session.items:
    for mark in item.iter_markers("runs"):
      if item.get_closest_marker("slow") is None:
        raise pytest.UsageError(f"{item.nodeid} waits for a subprocess: mark it slow too")
      names.update(mark.args)
  if not session.config.option.collectonly:
    _subprocess.POOL.start(names)


def pytest_sessionfinish(session):
  from tests import _subprocess

  _subprocess.POOL.stop()
