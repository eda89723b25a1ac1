"""Every docstring example of every jmp_scaler module runs, as written.

The modules are listed from the package directory, not from a hand-kept list,
so a new module's examples run without touching this file. Each module is one
test; a failing example reports the module, the docstring and the line.
"""

import doctest
import importlib
import pkgutil

import pytest

import jmp_scaler

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(jmp_scaler.__path__, prefix="jmp_scaler.")
)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples(module_name):
  """The module's docstring tests, run in its globals as ``python -m doctest`` would.

  Objects imported from elsewhere are left to the module that defines them.
  """
  module = importlib.import_module(module_name)
  return [t for t in doctest.DocTestFinder().find(module) if t.examples]


def test_the_package_has_modules_and_examples():
  # Guards the mechanism itself: a listing that finds nothing would pass every test below.
  assert "jmp_scaler.scaling._scaler" in MODULES and "jmp_scaler.precision._policy" in MODULES
  assert all(name.count(".") <= 2 for name in MODULES), MODULES  # wings, not deeper
  total = sum(len(t.examples) for name in MODULES for t in _examples(name))
  assert total >= 20, total


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  failures = []
  for test in _examples(module_name):
    out = []
    result = runner.run(test, out=out.append, clear_globs=True)
    if result.failed:
      failures.append("".join(out))
  assert not failures, "\n".join(failures)
