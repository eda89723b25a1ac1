"""benchmarks/bench_policy.py runs and prints its table (quick mode; not a timed test)."""

import pytest

from tests._subprocess import output


@pytest.mark.slow
@pytest.mark.runs("bench_policy")
def test_bench_policy_quick_prints_both_policies():
  out = output("bench_policy")
  rows = [line.split() for line in out.splitlines()[2:]]
  assert [r[0] for r in rows] == ["p=f32,c=bf16,o=f32", "f32"]
  for row in rows:
    base, scaled, ratio = map(float, row[1:])
    assert base > 0 and scaled > 0 and ratio > 0
