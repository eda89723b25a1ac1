"""The code blocks of the README and docs/: which run, and how (tests/test_docs.py, and the
``docs`` run of tests/_subprocess.py).

A ```` ```python ```` block is a complete program (it starts with ``import`` or ``from``, after
the indentation of a list item is removed) and runs as written, or it is a "before" block: the
code of another library a migration starts from (its first line is a ``# before`` comment).
Fragments that illustrate an API are plain ```` ``` ```` blocks; none of them takes or applies
scaled gradients (tests/test_docs.py holds both rules).

**What a program prints is shown in one of two checked forms**, and nowhere else (not in a
plain block, not quoted in the prose):

* a ```` ```text ```` block, the first block after the program (prose may come between): the
  program's whole standard output;
* ``# -> `` comments in the program, after a ``print`` call or on lines of their own: each one
  line of the output, in order, the lines of all of them its whole standard output (a
  ``print`` in a loop: its lines after the loop).

A program that prints shows its output so, unless ``UNSHOWN`` in tests/test_docs.py names it
with the reason.

The ``docs`` run runs every program as ``example.py`` (the name its printed source locations
show: ``example.py:5 (loss_fn)``), in a temporary directory, and tests/test_docs.py compares
what each printed with what its document shows, as doctest compares a docstring's example
(:data:`FLAGS`): ``...`` stands for any text (a timing, digits that differ between jax
versions, the middle of a long line), and a run of whitespace, line breaks included, matches
any other (a long line may be wrapped, a table's columns realigned). The README's and
docs/equinox.md's programs run in tests of their own (:data:`ELSEWHERE`); the ``docs`` run runs
those of them that show an output, for the comparison.
"""

import dataclasses
import doctest
import io
import linecache
import os
import pathlib
import re
import sys
import tempfile
import textwrap
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Documents whose programs another test runs, in process (with its own assertions).
ELSEWHERE = {"README.md": "tests/test_readme.py", "docs/equinox.md": "tests/test_equinox.py"}
#: The documents whose programs the ``docs`` run runs.
DOCS = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                    if str(p.relative_to(ROOT)) not in ELSEWHERE))  # fmt: skip
_FENCE = re.compile(r"^([ \t]*)```(\w*)\n(.*?)^\1```", re.S | re.M)
#: The name every program runs as: what the source locations it prints show.
FILENAME = "example.py"
#: How a program's output is matched with the one its document shows: doctest's ``...``
#: wildcard, and any run of whitespace for any other.
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: The comment that shows a line of a program's output.
ARROW = "# ->"
#: The language of the block that shows a program's output.
OUTPUT = "text"
_HEADER = re.compile(r"^== block (\d+) of (\S+)$")
_RAN = re.compile(r"^ran .* of (\S+)$")


@dataclasses.dataclass(frozen=True)
class Fence:
  lang: str
  code: str  #: list indentation removed
  line: int  #: the line of the document the fence opens on (counting from 1)


def fences(path: str) -> list[Fence]:
  """Every fenced block of ``path``, in order."""
  text = (ROOT / path).read_text()
  return [Fence(m.group(2), textwrap.dedent(m.group(3)), text.count("\n", 0, m.start()) + 1)
          for m in _FENCE.finditer(text)]  # fmt: skip


def blocks(path: str) -> list[tuple[str, str]]:
  """``(language, code)`` of every fenced block of ``path``, list indentation removed."""
  return [(f.lang, f.code) for f in fences(path)]


def is_before(code: str) -> bool:
  return code.lstrip().startswith("# before")


def is_program(fence: Fence) -> bool:
  return fence.lang == "python" and not is_before(fence.code)


def programs(path: str) -> list[str]:
  """The complete programs of ``path``: its python blocks but the "before" ones."""
  return [f.code for f in fences(path) if is_program(f)]


def arrows(code: str) -> list[str]:
  """The texts of the ``# -> `` comments of ``code``, in order (found by Python's tokenizer:
  never inside a string)."""
  tokens = tokenize.generate_tokens(io.StringIO(code).readline)
  return [t.string[len(ARROW):].removeprefix(" ") for t in tokens
          if t.type == tokenize.COMMENT and t.string.startswith(ARROW)]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Program:
  """A program of a document, and the output the document shows for it (None: none)."""

  code: str
  line: int  #: the line of the document its fence opens on
  shown: str | None
  form: str  #: where the document shows it: "the text block at line N", "its # -> comments"


def checked(path: str) -> list[Program]:
  """The programs of ``path`` (as :func:`programs`), each with the output it shows.

  Raises ValueError for a program that shows its output both ways."""
  found = fences(path)
  out = []
  for k, f in enumerate(found):
    if not is_program(f):
      continue
    after = found[k + 1] if k + 1 < len(found) else None
    lines = arrows(f.code)
    shown, form = None, ""
    if after is not None and after.lang == OUTPUT:
      shown, form = after.code, f"the {OUTPUT} block at line {after.line}"
    if lines:
      if shown is not None:
        raise ValueError(f"{path}: the program at line {f.line} shows its output twice: in "
                         f"{ARROW} comments and in {form}")  # fmt: skip
      shown, form = "".join(f"{line}\n" for line in lines), f"its {ARROW} comments"
    out.append(Program(f.code, f.line, shown, form))
  return out


def mismatch(shown: str, got: str) -> str | None:
  """None if ``got`` (a program's output) is what ``shown`` shows (:data:`FLAGS`), else
  doctest's account of the difference."""
  checker = doctest.OutputChecker()
  want = shown if shown.endswith("\n") else shown + "\n"
  if checker.check_output(want, got, FLAGS):
    return None
  return checker.output_difference(doctest.Example("", want), got, FLAGS)


def outputs(text: str) -> dict[tuple[str, int], str]:
  """What each program printed, by ``(document, index among its programs)``, read from the
  ``docs`` run's standard output (:func:`main`)."""
  out: dict[tuple[str, int], str] = {}
  key = None
  for line in text.splitlines(keepends=True):
    header, ran = _HEADER.match(line.rstrip("\n")), _RAN.match(line.rstrip("\n"))
    if header:
      key = (header.group(2), int(header.group(1)))
      out[key] = ""
    elif ran and key is not None and ran.group(1) == key[0]:
      key = None
    elif key is not None:
      out[key] += line
  return out


def run(code: str, where: str) -> None:
  """Runs ``code`` as the program ``example.py`` (its source registered for tracebacks) in a
  namespace of its own; an exception it raises names ``where``."""
  linecache.cache[FILENAME] = (len(code), None, code.splitlines(keepends=True), FILENAME)
  try:
    exec(compile(code, FILENAME, "exec"), {"__name__": "__docs__"})  # noqa: S102
  except BaseException as e:
    e.add_note(f"in {where}")
    raise


def main(paths: list[str]) -> None:
  """Runs the programs of ``paths`` one by one, each in a namespace of its own, in a temporary
  directory (a program may write a checkpoint); of a document in :data:`ELSEWHERE`, only those
  that show their output. Each program's output follows a line ``== block I of DOC``."""
  here = os.getcwd()
  with tempfile.TemporaryDirectory(prefix="jmp_scaler_docs_") as tmp:
    os.chdir(tmp)
    try:
      for doc in paths:
        runnable = checked(doc)
        some = doc in ELSEWHERE
        for i, program in enumerate(runnable):
          if some and program.shown is None:
            continue
          print(f"== block {i} of {doc}", flush=True)
          run(program.code, f"block {i} of {doc} (its fence at line {program.line})")
          sys.stdout.flush()
        if some:
          n = sum(p.shown is not None for p in runnable)
          print(f"ran the {n} of {len(runnable)} blocks that show an output of {doc}", flush=True)
        else:
          print(f"ran {len(runnable)} blocks of {doc}", flush=True)
    finally:
      os.chdir(here)


if __name__ == "__main__":
  main(sys.argv[1:] or [*DOCS, *ELSEWHERE])
