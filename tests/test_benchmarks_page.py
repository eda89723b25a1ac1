"""BENCHMARKS.md stays one page of current figures, each with the command that produced it.

Figures that newer runs supersede go to docs/performance.md ("Earlier figures") or to
CHANGELOG.md with the change that moved them; git keeps the rest."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "BENCHMARKS.md"
MAX_LINES = 300


def test_benchmarks_md_is_at_most_300_lines():
  n = len(PAGE.read_text().splitlines())
  assert n <= MAX_LINES, (
    f"BENCHMARKS.md has {n} lines (at most {MAX_LINES}): keep the current figures, move the "
    "superseded ones to docs/performance.md's 'Earlier figures' or CHANGELOG.md")


def test_every_section_names_its_script_and_gives_a_command_for_it():
  sections = re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]
  assert sections
  for section in sections:
    title = section.splitlines()[0]
    script = re.search(r"`(bench_\w+\.py)`", title)
    assert script, f"section {title!r} names no benchmarks/ script"
    assert (ROOT / "benchmarks" / script[1]).is_file(), title
    assert f"python benchmarks/{script[1]}" in section, f"section {title!r} gives no command"
