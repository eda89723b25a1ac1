"""The README stays true: its complete examples run, its Quick start matches CI."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang):
  return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_complete_python_examples_run():
  complete = [b for b in _blocks("python") if b.startswith("import ")]
  assert len(complete) >= 2
  for block in complete:
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own README


def test_quick_start_has_two_commands_and_ci_runs_the_test_command_verbatim():
  quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
  commands = [c for c in _blocks("bash") if c in quick][0].strip().splitlines()
  assert len(commands) == 2
  assert "examples/digits.py" in commands[0] and "pytest" in commands[1]
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert commands[1] in ci


def test_the_readme_is_recipes_starting_with_an_exact_skip_step():
  assert len(README.splitlines()) <= 250
  first = _blocks("python")[0]
  # The first code a newcomer sees skips exactly: TrainState (or skip_nonfinite/NNXOptimizer),
  # never the bare chain head alone, and takes the scaled gradients the one way.
  assert "jmp_scaler.TrainState" in first and "apply_gradients" in first
  assert "jmp_scaler.value_and_grad" in first and "autocast" in first
  for block in _blocks("python"):
    assert "* scale" not in block and "get_scale(" not in block.split("assert")[0]
