"""The README's and docs/'s code blocks: every python block runs, every block that takes or
applies scaled gradients takes them the one way (``jmp_scaler.value_and_grad``) and runs, and
every output the documents show is what their programs print (tests/_docs.py: a ``text`` block
after the program, or ``# ->`` comments), compared with the ``docs`` run's output.

Also what the documents state about the code where a list can drift: docs/autocast.md's rule
table against the rule names the code accepts, and the site's home page."""

import ast
import io
import pathlib
import re
import tokenize

import pytest

from jmp_scaler.precision import _composites, _rules
from tests import _docs
from tests._subprocess import output
from tests.test_example_outputs import HAND_SCALED

DOCUMENTS = ["README.md", *_docs.DOCS, *sorted(set(_docs.ELSEWHERE) - {"README.md"})]
# A loss multiplied by the scale by hand, inside a loss function.
BY_HAND = re.compile(r"\*\s*(state\.loss_scale|(jmp_scaler\.)?get_scale\()")
# What feeds a scaler: scaled gradients taken, or handed to a chain holding one.
FEEDS = re.compile(r"value_and_grad\(|apply_gradients\(|optimizer\.update\(|tx\.update\(grads")


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_every_python_block_is_a_program_that_runs(doc):
  blocks = _docs.blocks(doc)
  assert blocks or doc == "docs/performance.md"
  for lang, code in blocks:
    if lang == "python" and not _docs.is_before(code):
      assert code.startswith(("import ", "from ")), code[:120]  # complete: the docs run runs it
  # ... and the docs run (tests/test_examples.py) or the test named in ELSEWHERE runs them.
  assert doc in _docs.DOCS or doc in _docs.ELSEWHERE


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_every_block_that_feeds_a_scaler_runs_and_scales_the_one_way(doc):
  for lang, code in _docs.blocks(doc):
    if _docs.is_before(code):
      continue  # another library's code, the start of a migration
    assert not HAND_SCALED.search(code), HAND_SCALED.search(code).group(0)
    assert not BY_HAND.search(code), BY_HAND.search(code).group(0)
    if FEEDS.search(code):
      assert lang == "python", f"a fragment that feeds a scaler does not run:\n{code[:300]}"
      assert "jmp_scaler.value_and_grad(" in code, code[:300]


def test_the_rules_catch_a_fragment_and_a_hand_scaled_gradient():
  assert _docs.blocks("docs/scale_out.md")  # the parser finds fences, indented ones included
  assert any(c.startswith("import jax") for lang, c in _docs.blocks("docs/flax.md")
             if "restore_on_skip" in c)  # fmt: skip
  assert FEEDS.search("state = state.apply_gradients(grads=grads)")
  assert HAND_SCALED.search("g = jax.grad(lambda p: loss_fn(p, x, y) * scale)(full)")
  assert BY_HAND.search("    return jnp.mean(state.apply_fn(p, x) ** 2) * state.loss_scale")


# ---------------------------------------------------------------- what the programs print


#: The programs that print and show no output in a checked form, each with the reason.
UNSHOWN = {
    ("docs/migration.md", 0): "its `# step ...` lines: tests/test_example_outputs.py checks them",
    ("docs/migration.md", 1): "its `# [...]` line: tests/test_jmp.py checks it",
    ("docs/equinox.md", 0): "a training log it does not show: tests/test_equinox.py checks it",
}
#: The documents that show what a program prints.
SHOWING = [d for d in DOCUMENTS if any(p.shown is not None for p in _docs.checked(d))]


def prints(code: str) -> bool:
  tokens = [t for t in tokenize.generate_tokens(io.StringIO(code).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]  # fmt: skip
  pairs = zip(tokens, tokens[1:], strict=False)
  return any(a.string == "print" and b.string == "(" for a, b in pairs)


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_every_output_shown_is_a_program_s_and_every_program_that_prints_shows_it(doc):
  fences = _docs.fences(doc)
  for k, f in enumerate(fences):
    if f.lang == _docs.OUTPUT:  # ```text: the output of the program right before it
      assert k and _docs.is_program(fences[k - 1]), (
        f"{doc}:{f.line}: a ```{_docs.OUTPUT} block is the output of the program before it "
        "(no other block between): tests/_docs.py")  # fmt: skip
    elif not _docs.is_program(f):
      assert _docs.ARROW not in f.code, f"{doc}:{f.line}: `{_docs.ARROW}` outside a program"
  for i, program in enumerate(_docs.checked(doc)):  # raises where both forms show an output
    if (doc, i) in UNSHOWN:
      assert prints(program.code) and program.shown is None, (doc, i, UNSHOWN[doc, i])
    elif prints(program.code):
      assert program.shown is not None, (
        f"{doc}:{program.line}: this program prints: show what in a ```{_docs.OUTPUT} block "
        f"after it or in `{_docs.ARROW}` comments (tests/_docs.py), where the docs run checks it")
  prose = re.sub(r"^([ \t]*)```.*?^\1```", "", (_docs.ROOT / doc).read_text(), flags=re.S | re.M)
  quoted = re.search(r"\bprints `[^`]*`", prose)
  assert not quoted, f"{doc}: {quoted.group(0)}: an output quoted in the prose is not checked"


def test_the_output_checks_catch_a_drift_and_take_wildcards_and_wrapping(tmp_path, monkeypatch):
  assert len(SHOWING) >= 5 and "docs/diagnostics.md" in SHOWING and "README.md" in SHOWING
  assert _docs.mismatch("loss 0.058... vs 3.51297\n", "loss 0.0589106 vs 3.51297\n") is None
  assert _docs.mismatch("At scale 1, 16.7% flush\nto zero\n", "At scale 1, 16.7% flush to zero") \
    is None  # fmt: skip
  stale = "  embed   4.03e-04    3.89e+01        0.0%  float32\n"  # what diagnostics.md showed
  got = "  embed   4.03e-04    1.00e+00        0.0%  float16\n"
  assert "Expected:" in _docs.mismatch(stale, got) and "Got:" in _docs.mismatch(stale, got)
  assert _docs.mismatch("1 0\n", "1 0\n1\n") is not None  # the whole output, not a prefix
  assert _docs.arrows('print(x)  # -> 1 0\ns = "# -> in a string"\n# -> two\n') == ["1 0", "two"]
  text = "== block 0 of a.md\n1\n== block 2 of a.md\nx\n\nran 3 blocks of a.md\nnoise\n"
  assert _docs.outputs(text) == {("a.md", 0): "1\n", ("a.md", 2): "x\n\n"}
  monkeypatch.setattr(_docs, "ROOT", tmp_path)
  (tmp_path / "x.md").write_text("```python\nimport sys\nprint(1)  # -> 1\n```\n\n"
                                  "```text\n1\n```\n")
  with pytest.raises(ValueError, match="shows its output twice"):
    _docs.checked("x.md")


@pytest.mark.slow
@pytest.mark.runs("docs")
@pytest.mark.parametrize("doc", SHOWING)
def test_what_a_document_shows_a_program_print_is_what_it_prints(doc):
  printed = _docs.outputs(output("docs"))  # the docs run: every program, once
  for i, program in enumerate(_docs.checked(doc)):
    if program.shown is None:
      continue
    assert (doc, i) in printed, f"the docs run did not run block {i} of {doc}"
    diff = _docs.mismatch(program.shown, printed[doc, i])
    assert diff is None, (
      f"{doc}: the program at line {program.line} does not print what {program.form} shows "
      f"(`...` stands for any text, whitespace for any whitespace: tests/_docs.py):\n{diff}")


# ---------------------------------------------------------------- autocast's rule table

NUMBERS = {w: n for n, w in enumerate("zero one two three four five six seven eight nine ten "
                                      "eleven twelve".split())}  # fmt: skip


def _rule_table_section() -> str:
  text = (_docs.ROOT / "docs" / "autocast.md").read_text()
  return text.split("\n## The rule table\n")[1].split("\n### Rules by module path\n")[0]


def _rules_values(text: str) -> set[str]:
  """The rule names given as values in the ``rules={...}`` dicts of ``text``."""
  found = set()
  for m in re.finditer(r"rules=\{", text):
    depth, end = 0, m.end() - 1
    for end in range(m.end() - 1, len(text)):
      depth += {"{": 1, "}": -1}.get(text[end], 0)
      if depth == 0:
        break
    found |= set(re.findall(r'(?:"|\))\s*:\s*"(\w+)"', text[m.end():end]))
  return found


def test_the_rule_table_lists_the_rules_the_code_accepts_and_counts_them():
  section = _rule_table_section()
  table = re.findall(r'^\| `"(\w+)"`', section, re.M)
  with pytest.raises(ValueError, match="must be one of") as refused:
    _rules.rule_table({"dot_general": "no_such_rule"})
  accepted = ast.literal_eval(re.search(r"must be one of (\(.*?\)) or", str(refused.value))[1])
  assert sorted(table) == sorted(set(table)) == sorted(accepted)
  assert set(table) == {*_rules.RULES, *_rules.BLOCK_RULES}
  for rule in table:  # each name the table gives is taken (by the matmul, as the fp8 ones)
    _rules.rule_table({"dot_general": rule})
  counts = re.findall(r"one of the (\w+) rules|one of (\w+) rules", section)
  assert len(counts) == 2, counts  # the table's sentence and the overrides'
  assert all(NUMBERS[a or b] == len(table) for a, b in counts), (counts, len(table))
  # Every rule the documents' code gives is the table's (or a function's: "activation", ...).
  used = set().union(*(_rules_values((_docs.ROOT / d).read_text()) for d in DOCUMENTS))
  assert {"mxfp8", "nvfp4", "compute", "activation"} <= used
  assert used <= set(table) | set(_composites.COMPOSITE_RULES), used - set(table)
  # The error the overrides quote is the code's.
  quoted = re.search(r'`rules=\{"tanhh": "float32"\}` raises `ValueError: (.*?)`', section, re.S)
  with pytest.raises(ValueError) as typo:
    _rules.rule_table({"tanhh": "float32"})
  assert " ".join(quoted[1].split()) == str(typo.value)


def test_a_table_that_misses_a_rule_fails_the_check():
  # The control: the table as it was (seven rules, no "mxfp8" or "nvfp4").
  section = _rule_table_section()
  old = [r for r in re.findall(r'^\| `"(\w+)"`', section, re.M) if r not in _rules.BLOCK_RULES]
  assert set(old) != {*_rules.RULES, *_rules.BLOCK_RULES} and NUMBERS["seven"] == len(old)


# ---------------------------------------------------------------- the site's home page


def test_the_home_page_runs_a_quick_start_and_links_every_guide():
  index = (_docs.ROOT / "docs" / "index.md").read_text()
  (program,) = _docs.checked("docs/index.md")  # the docs run runs it, its output checked
  assert program.shown is not None and "jmp_scaler.TrainState" in program.code
  assert "jmp_scaler.value_and_grad" in program.code and "autocast" in program.code
  assert "README" not in index  # the site has no README page
  guides = {p.stem for p in pathlib.Path(_docs.ROOT / "docs").glob("*.md")} - {"index"}
  assert guides <= set(re.findall(r"\]\((\w+)\.md", index)), guides
