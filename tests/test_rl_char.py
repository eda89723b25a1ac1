"""``examples/rl_char.py --quick`` (issue 46): pre-training, then GRPO under bfloat16 and
float16 from the same weights; both tables complete, finite, float16's scale reported.

Skipped where google-tunix is not installed; about a minute on a 2-core CPU (slow).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)%\s+(\S+)%\s+(\S+)\s+(\d+)$")


@pytest.mark.slow
def test_rl_char_quick_runs_both_policies_and_reports_them(tmp_path):
  pytest.importorskip("tunix", reason="google-tunix is not installed: pip install -e '.[tunix]'")
  out = tmp_path / "rl_char.png"
  proc = subprocess.run(
      [sys.executable, "examples/rl_char.py", "--quick", "--out", str(out), "--cache-dir",
       str(tmp_path / "cache")], cwd=ROOT, capture_output=True, text=True, timeout=900,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  text = proc.stdout
  assert re.search(r"pre-trained \(20 float32 steps .*\): greedy accuracy [\d.]+%", text)
  runs = {}
  for name, policy in (("bf16", "p=f32,c=bf16,o=f32"), ("f16", "p=f32,c=f16,o=f32")):
    table = text.split(f"\n{name} ({policy})\n")[1].split("\n\n")[0]
    rows = [ROW.match(line) for line in table.splitlines()[1:]]
    assert [int(m[1]) for m in rows] == [1, 2, 3], table
    for m in rows:
      assert all(math.isfinite(float(v)) for v in m.groups()[1:7]), m[0]
      assert 0.0 <= float(m[2]) <= 1.0 and 0.0 <= float(m[5]) <= 100.0, m[0]
    runs[name] = rows
  assert {float(m[7]) for m in runs["bf16"]} == {1.0}  # no_scale
  assert all(float(m[7]) >= 1.0 for m in runs["f16"])  # the dynamic scale, reported
  summary = text.split("\nsummary")[1]
  for name in ("bf16", "f16"):
    cells = re.search(rf"^{name}\s+(.*)$", summary, re.M)[1].replace("%", "").split()
    assert len(cells) == 9 and all(math.isfinite(float(c)) for c in cells), cells
  if f"\nplot: {out}" in text:
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  else:
    assert "no plot: matplotlib is not installed" in text
