"""Every example (and the docs' code) runs as a subprocess at a tiny size, and
shows what it claims.

The runs start together on first use, two at a time (the CI machine has two
cores), so the module costs about half the sum of the runs.
"""

import concurrent.futures
import functools
import pathlib
import re
import sys

import pytest

from tests._subprocess import start_runs, stdout_of

pytestmark = pytest.mark.slow  # every test waits for a subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_MATPLOTLIB = (  # runs an example with `import matplotlib` failing, as if not installed
    "import runpy, sys; sys.modules['matplotlib'] = None; path = sys.argv[1]; "
    "sys.argv = sys.argv[1:]; runpy.run_path(path, run_name='__main__')"
)
DOCS = (  # runs the complete blocks of each doc; "before" blocks start with a comment
    "import re, sys\n"
    "for doc in sys.argv[1:]:\n"
    "  text = open(doc).read()\n"
    "  blocks = [b for b in re.findall(r'```python\\n(.*?)```', text, flags=re.S)\n"
    "            if b.startswith('import ')]\n"
    "  for block in blocks:\n"
    "    exec(compile(block, doc, 'exec'), {})\n"
    "  print(f'ran {len(blocks)} blocks of {doc}')\n"
)


def _commands(out: pathlib.Path) -> dict[str, list[str]]:
  py = sys.executable
  return {  # longest first: two run at a time
      "digits": [py, "examples/digits.py", "--steps", "120", "--hidden", "32",
                 "--log-every", "20", "--growth-interval", "20", "--out", str(out / "plots")],
      "debugging": [py, "examples/debugging.py", "--steps", "60", "--window", "20"],
      "digits_no_mpl": [py, "-c", NO_MATPLOTLIB, "examples/digits.py", "--steps", "3",
                        "--hidden", "8", "--out", str(out / "no_plots")],
      "docs": [py, "-c", DOCS, "docs/migration.md", "docs/diagnostics.md"],
      "underflow": [py, "examples/underflow.py", "--steps", "40"],
      "clipping": [py, "examples/clipping.py", "--steps", "40"],
  }


@functools.cache
def _runs(out: pathlib.Path) -> dict[str, concurrent.futures.Future]:
  return start_runs(_commands(out))


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("examples")


def output(name: str, out: pathlib.Path) -> str:
  return stdout_of(_runs(out), name)


def table_rows(text: str) -> dict[str, list[str]]:
  """The digits table's rows, by run name (rich draws cells between '│')."""
  rows = {}
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip("│").split("│")]
    if len(cells) == 7 and cells[0] in ("f32", "bf16", "fp16"):
      rows[cells[0]] = cells
  return rows


def test_digits_table_has_three_runs_and_fp16_learns(out_dir):
  text = output("digits", out_dir)
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
    data = (out_dir / "plots" / png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_digits_runs_and_prints_its_table_without_matplotlib(out_dir):
  text = output("digits_no_mpl", out_dir)
  assert list(table_rows(text)) == ["f32", "bf16", "fp16"]
  assert "matplotlib is not installed: no plots" in text
  assert not (out_dir / "no_plots").exists()


def test_clipping_after_the_scaler_learns_and_before_it_does_not(out_dir):
  text = output("clipping", out_dir)
  rows = {m[1]: [float(v) for v in m[2].split()]
          for m in re.finditer(r"^(no clipping|scaler, clip|clip, scaler)\s+(.*)$", text, re.M)}
  loss, _, applied, max_applied, _ = rows["scaler, clip"]
  wrong_loss, _, wrong_applied, _, _ = rows["clip, scaler"]
  assert max_applied <= 1.0 + 1e-3 and applied == pytest.approx(1.0, abs=1e-3)
  assert wrong_applied < 1e-3  # the clipped scaled gradient, divided by the scale
  assert loss < 0.8 * wrong_loss


def test_debugging_session_finds_the_raw_feature_and_fixes_it(out_dir):
  text = output("debugging", out_dir)
  symptom = text.split("== 1.")[1].split("== 2.")[0]
  assert "ScaleWarning: loss scale collapsed" in symptom and "60 skipped (100%)" in symptom
  assert "first in tree order: inputs/price" in text
  assert re.search(r"^\s+price\s+0%\s+0%\s+[1-9][\d.]*%", text, re.M)  # price overflows fp16
  fixed = text.split("== 5.")[1]
  assert re.search(r"float16: loss \d+\.\d+; 60 steps, 0 skipped", fixed)


def test_underflow_unscaled_fp16_gradients_vanish_and_scaling_restores_them(out_dir):
  text = output("underflow", out_dir)
  rows = {m[1]: [float(v.rstrip("%")) for v in m[2].split()]
          for m in re.finditer(r"^(f32|fp16 no_scale|fp16 dynamic)\s+(.*)$", text, re.M)}
  f32, unscaled, scaled = rows["f32"], rows["fp16 no_scale"], rows["fp16 dynamic"]
  assert unscaled[2] > 50.0 and scaled[2] == 0.0 and f32[2] == 0.0  # % of aux grads == 0
  assert scaled[1] == pytest.approx(f32[1], rel=0.02)  # scaled fp16 follows float32
  assert scaled[1] < unscaled[1]
  assert "perturbations/recon" in text and "bfloat16" in text



def test_complete_code_blocks_of_the_docs_run(out_dir):
  text = output("docs", out_dir)
  assert "ran 4 blocks of docs/migration.md" in text
  assert "ran 3 blocks of docs/diagnostics.md" in text
