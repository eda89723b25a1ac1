"""Every example (and the docs' code) runs as a subprocess at a tiny size, and
shows what it claims.

The runs are ``tests/_subprocess.py``'s: they start with the session, in the
background, and ``tests/test_example_outputs.py`` reads the same runs.
"""

import re

import pytest

from tests import _docs
from tests._subprocess import output, run_dir

pytestmark = pytest.mark.slow  # every test waits for a subprocess


def table_rows(text: str) -> dict[str, list[str]]:
  """The digits table's rows, by run name (rich draws cells between '│')."""
  rows = {}
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip("│").split("│")]
    if len(cells) == 7 and cells[0] in ("f32", "bf16", "fp16"):
      rows[cells[0]] = cells
  return rows


@pytest.mark.runs("digits")
def test_digits_table_has_three_runs_and_fp16_learns():
  text = output("digits")
  rows = table_rows(text)
  assert list(rows) == ["f32", "bf16", "fp16"]
  assert [r[1] for r in rows.values()] == ["float32", "bfloat16", "float16"]
  for name, (_, _, loss, acc, steps_per_s, skipped, scale) in rows.items():
    assert float(acc.rstrip("%")) > 60.0, (name, acc)  # chance is 10%
    assert float(loss) < 1.5 and float(steps_per_s) > 0
    if name == "fp16":
      assert int(skipped) >= 0 and float(scale) >= 1.0, (skipped, scale)
    else:
      assert (skipped, scale) == ("-", "-")
  assert "fp16 scale monitor: 120 steps" in text
  for png in ("digits_loss.png", "digits_scale_fp16.png"):
    data = (run_dir("digits") / "plots" / png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.runs("digits_no_mpl")
def test_digits_runs_and_prints_its_table_without_matplotlib():
  text = output("digits_no_mpl")
  assert list(table_rows(text)) == ["f32", "bf16", "fp16"]
  assert "matplotlib is not installed: no plots" in text
  assert not (run_dir("digits_no_mpl") / "plots").exists()


@pytest.mark.runs("clipping")
def test_clipping_after_the_scaler_clips_true_gradients_and_before_it_is_refused():
  text = output("clipping")
  rows = {m[1]: [float(v) for v in m[2].split()]
          for m in re.finditer(r"^(no clipping|scaler, clip)\s+(.*)$", text, re.M)}
  _, _, applied, max_applied, _ = rows["scaler, clip"]
  assert max_applied <= 1.0 + 1e-3 and applied == pytest.approx(1.0, abs=1e-3)
  assert re.search(r"^clip, scaler\s+refused at init: the loss scaler is at position 1 "
                   r"\(counting from 0\) of an optax.chain", text, re.M)


@pytest.mark.runs("debugging")
def test_debugging_session_finds_the_raw_feature_and_fixes_it():
  text = output("debugging")
  symptom = text.split("== 1.")[1].split("== 2.")[0]
  assert "ScaleWarning: loss scale collapsed" in symptom and "60 skipped (100%)" in symptom
  assert "first in tree order: inputs/price" in text
  assert re.search(r"^\s+price\s+0%\s+0%\s+[1-9][\d.]*%", text, re.M)  # price overflows fp16
  fixed = text.split("== 5.")[1]
  assert re.search(r"float16: loss \d+\.\d+; 60 steps, 0 skipped", fixed)


@pytest.mark.runs("underflow")
def test_underflow_unscaled_fp16_gradients_vanish_and_scaling_restores_them():
  text = output("underflow")
  rows = {m[1]: [float(v.rstrip("%")) for v in m[2].split()]
          for m in re.finditer(r"^(f32|fp16 no_scale|fp16 dynamic)\s+(.*)$", text, re.M)}
  f32, unscaled, scaled = rows["f32"], rows["fp16 no_scale"], rows["fp16 dynamic"]
  assert unscaled[2] > 50.0 and scaled[2] == 0.0 and f32[2] == 0.0  # % of aux grads == 0
  assert scaled[1] == pytest.approx(f32[1], rel=0.02)  # scaled fp16 follows float32
  assert scaled[1] < unscaled[1]
  assert "perturbations/recon" in text and "bfloat16" in text



@pytest.mark.runs("docs")
def test_complete_code_blocks_of_the_docs_run():
  text = output("docs")
  for doc in _docs.DOCS:  # every program of every document (tests/_docs.py)
    assert f"ran {len(_docs.programs(doc))} blocks of {doc}" in text, doc
  assert "ran 5 blocks of docs/migration.md" in text and "ran 3 blocks of docs/flax.md" in text
  for doc in _docs.ELSEWHERE:  # another test runs them all; this run those that show an output
    programs = _docs.checked(doc)
    shown = sum(p.shown is not None for p in programs)
    assert f"ran the {shown} of {len(programs)} blocks that show an output of {doc}" in text
  # What each printed is compared with what its document shows in tests/test_docs.py.
