"""An equation's source information: where in the user's code it was traced, and its context.

``eqn.source_info`` (a ``SourceInfo``: ``traceback``, ``name_stack``) and ``eqn.ctx`` (its
mesh and configuration context) are the same in jax 0.10 and 0.12; the frames of a traceback
are jaxlib's (``file_name``, ``function_name``, ``line_num``).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from jmp_scaler.jaxcompat._errors import missing

try:
  from jax.extend import source_info_util
except ImportError as e:  # pragma: no cover
  raise missing(f"source_info_util ({e})", "jax.extend") from e


class Frame(NamedTuple):
  file: str
  line: int
  function: str

  def __str__(self) -> str:
    return f"{self.file}:{self.line} ({self.function})"


def summarize(eqn: Any) -> str:
  """JAX's one-line summary of where ``eqn`` was traced (``file:line:col (function)``)."""
  return source_info_util.summarize(eqn.source_info)


def summary_location(eqn: Any) -> tuple[str, int]:
  """The file and line of :func:`summarize`, or ``("<unknown>", 0)``."""
  m = re.match(r"(.*):(\d+):\d+ \(.*\)$", summarize(eqn))
  return (m.group(1), int(m.group(2))) if m else ("<unknown>", 0)


@contextlib.contextmanager
def user_context(eqn: Any, with_ctx: bool = False) -> Iterator[None]:
  """Equations bound inside carry ``eqn``'s source information (so errors and later
  interpreters point at the user's line); with ``with_ctx``, also its context (mesh)."""
  info = eqn.source_info
  ctx = getattr(eqn, "ctx", None) if with_ctx else None
  manager = ctx.manager if ctx is not None else contextlib.nullcontext()
  with source_info_util.user_context(info.traceback, name_stack=info.name_stack), manager:
    yield


def frames(eqn: Any) -> list[Frame]:
  """The frames of ``eqn``'s traceback, innermost first (empty when it has none)."""
  tb = getattr(eqn.source_info, "traceback", None)
  if tb is None:
    return []
  return [Frame(f.file_name, f.line_num, f.function_name) for f in tb.frames]


def raw_frames(eqn: Any) -> list:
  """jaxlib's frames of ``eqn``'s traceback (``function_name``, ``file_name``, ``line_num``),
  innermost first, without copying them: for scans of every equation of a large jaxpr."""
  tb = getattr(eqn.source_info, "traceback", None)
  return [] if tb is None else tb.frames


def _package_dirs(modules: Sequence[Any]) -> tuple[str, ...]:
  dirs = []
  for module in modules:
    path = getattr(module, "__file__", None)
    if path:
      dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
  return tuple(dirs)


def user_frames(eqn: Any, excluded_modules: Sequence[Any]) -> list[Frame]:
  """The frames of ``eqn``'s traceback outside the packages of ``excluded_modules`` (jax,
  flax, ...) and outside the standard library's ``contextlib``/``functools``, innermost
  first: the user's line, then the lines that called it."""
  dirs = _package_dirs(excluded_modules)
  found = []
  for frame in frames(eqn):
    path = os.path.abspath(frame.file) if not frame.file.startswith("<") else frame.file
    if path.startswith(dirs) or os.path.basename(path) in ("contextlib.py", "functools.py"):
      continue
    found.append(frame)
  return found


_WRAPPERS = re.compile(r"[A-Za-z_]+\(|\)")


def module_path(stacks: Sequence[str]) -> str:
  """The name stacks of nested calls (outermost first) as one path of scope names, without
  differentiation's ``jvp(...)`` and ``transpose(...)``: ``"Model/Block_3/Dense_0"``."""
  return "/".join(p for s in stacks for p in _WRAPPERS.sub("", s).split("/") if p)


def name_stack(eqn: Any) -> str:
  """``eqn``'s name stack as JAX prints it: the ``jax.named_scope`` names around it, wrapped
  in ``jvp(...)`` and ``transpose(...)`` by differentiation (``transpose(jvp(loss))``)."""
  return str(getattr(eqn.source_info, "name_stack", ""))
