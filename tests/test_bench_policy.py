"""benchmarks/bench_policy.py runs and prints its table (quick mode; not a timed test)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_policy_quick_prints_both_policies():
  out = subprocess.run(
      [sys.executable, "benchmarks/bench_policy.py", "--quick"], cwd=ROOT, capture_output=True,
      text=True, timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [line.split() for line in out.stdout.splitlines()[2:]]
  assert [r[0] for r in rows] == ["p=f32,c=bf16,o=f32", "f32"]
  for row in rows:
    base, scaled, ratio = map(float, row[1:])
    assert base > 0 and scaled > 0 and ratio > 0
