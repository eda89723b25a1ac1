"""benchmarks/bench_bf16.py --quick runs, and its tables say what the docs claim."""

import pytest

from tests._subprocess import output as run_output

# A subprocess that compiles about twenty programs.
pytestmark = [pytest.mark.slow, pytest.mark.runs("bench_bf16")]


@pytest.fixture(scope="module")
def output():
  return run_output("bench_bf16")


def _table(text, number):
  """setup -> columns, for the rows of table ``number``."""
  block = text.split(f"\n{number}. ")[1]
  lines = block.splitlines()
  start = next(i for i, ln in enumerate(lines) if ln.startswith("---")) + 1
  rows = []
  for ln in lines[start:]:
    if not ln.strip() or ln.startswith("("):
      break
    rows.append(ln.split())
  return rows


def test_micro_test(output):
  rows = {r[0]: [float(v) for v in r[1:]] for r in _table(output, 1)}
  assert rows["rtn"][0] == 1.0  # round-to-nearest never moves
  assert 1.8 < rows["sr"][0] < 2.2 and rows["sr"][1] > 0  # about 2, with a spread over seeds
  assert abs(rows["kahan"][0] - 2.0) < 0.02  # Kahan lands on 2 deterministically
  assert rows["f32"][0] == pytest.approx(2.0, abs=1e-4)


def test_quality_table_has_every_task_and_setup(output):
  rows = _table(output, 2)
  assert {(r[0], r[1]) for r in rows} == {
      (t, s) for t in ("digits", "char-GPT") for s in ("f32", "rtn", "sr", "kahan")}
  for r in rows:
    assert float(r[2]) > 0 and 0 <= float(r[4]) <= 100  # loss, accuracy %


def test_bytes_per_parameter(output):
  table = {(r[0], r[1]): [float(v) for v in r[2:]] for r in _table(output, 3)}
  for task in ("digits", "char-GPT"):
    f32, sr, kahan = (table[task, s] for s in ("f32", "sr", "kahan"))
    assert f32[1] == 16.0 and sr[1] == 8.0 and kahan[1] == 10.0  # params + grads + state
    assert sr[2] < f32[2]  # the compiled step's arguments shrink too
    assert all(t[4] > 0 for t in (f32, sr, kahan))  # timed
