"""The README's and docs/'s code blocks: every python block runs, and every block that takes or
applies scaled gradients takes them the one way (``jmp_scaler.value_and_grad``) and runs."""

import re

import pytest

from tests import _docs
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
