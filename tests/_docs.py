"""The code blocks of the README and docs/: which run, and how (tests/test_docs.py, and the
``docs`` run of tests/_subprocess.py).

A ```` ```python ```` block is a complete program (it starts with ``import`` or ``from``, after
the indentation of a list item is removed) and runs as written, or it is a "before" block: the
code of another library a migration starts from (its first line is a ``# before`` comment).
Fragments that illustrate an API are plain ```` ``` ```` blocks; none of them takes or applies
scaled gradients (tests/test_docs.py holds both rules).
"""

import os
import pathlib
import re
import sys
import tempfile
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Documents whose programs another test runs, in process (with its own assertions).
ELSEWHERE = {"README.md": "tests/test_readme.py", "docs/equinox.md": "tests/test_equinox.py"}
#: The documents whose programs the ``docs`` run runs.
DOCS = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                    if str(p.relative_to(ROOT)) not in ELSEWHERE))  # fmt: skip
_FENCE = re.compile(r"^([ \t]*)```(\w*)\n(.*?)^\1```", re.S | re.M)


def blocks(path: str) -> list[tuple[str, str]]:
  """``(language, code)`` of every fenced block of ``path``, list indentation removed."""
  text = (ROOT / path).read_text()
  return [(m.group(2), textwrap.dedent(m.group(3))) for m in _FENCE.finditer(text)]


def is_before(code: str) -> bool:
  return code.lstrip().startswith("# before")


def programs(path: str) -> list[str]:
  """The complete programs of ``path``: its python blocks but the "before" ones."""
  return [c for lang, c in blocks(path) if lang == "python" and not is_before(c)]


def main(paths: list[str]) -> None:
  """Runs the programs of ``paths`` one by one, each in a namespace of its own, in a temporary
  directory (a program may write a checkpoint)."""
  here = os.getcwd()
  with tempfile.TemporaryDirectory(prefix="jmp_scaler_docs_") as tmp:
    os.chdir(tmp)
    try:
      for doc in paths:
        runnable = programs(doc)
        for i, code in enumerate(runnable):
          print(f"== block {i} of {doc}", flush=True)
          exec(compile(code, str(ROOT / doc), "exec"), {"__name__": "__docs__"})  # noqa: S102
        print(f"ran {len(runnable)} blocks of {doc}", flush=True)
    finally:
      os.chdir(here)


if __name__ == "__main__":
  main(sys.argv[1:] or list(DOCS))
