"""Where a loss scaler sits in its chain: it must see the scaled gradients first.

A transformation before the scaler acts on the *scaled* gradients: a clip then cuts the
true gradients at ``max_norm / scale`` (the seed's clip-before-unscale trap), ``optax.zero_nans``
hides the overflow the scaler must see. A scaler inside ``optax.masked`` or
``optax.partition`` unscales only its part of the gradients; the rest reach the
optimizer multiplied by the scale. None of these fails: each trains on wrong updates.

Optax's combinators keep their transformations in closures and call them from their own
``init``, so the scaler's ``init`` finds its place by reading the frames that called it:
the ``init`` of ``optax.chain`` (which transformation of the chain is being initialised),
of ``optax.named_chain`` (which name) and of ``optax.masked`` (which ``optax.partition``
builds on). The frames are recognised by their code objects, taken from optax's own
functions at first use, so no file name or line is assumed; their locals are read by the
names optax 0.2.5 to 0.2.8 give them (``tests/test_scaler_position.py`` holds each).
"""

from __future__ import annotations

import functools
import sys
from types import CodeType, FrameType
from typing import Any

import optax


@functools.cache
def _codes() -> dict[str, CodeType]:
  """The code objects of optax's combinators' ``init`` functions."""
  identity = optax.identity()
  return {
    "chain": optax.chain(identity).init.__code__,
    "named_chain": optax.named_chain(("a", identity)).init.__code__,
    "masked": optax.masked(identity, {}).init.__code__,
  }


def _label(fn: Any) -> str:
  """``scale_by_adam`` for ``scale_by_adam.<locals>.init_fn``; a stateless one (a clip, most
  of optax's elementwise transformations share ``init_empty_state``) says so."""
  name = getattr(fn, "__qualname__", None) or type(fn).__name__
  name = name.split(".<locals>")[0]
  return "a stateless transformation (a clip?)" if name == "init_empty_state" else name


def _chain_position(frame: FrameType, child: FrameType | None) -> tuple[int, list[str]] | None:
  """(index, labels of the transformations before it) of the element ``child`` runs."""
  fns = frame.f_locals.get("init_fns")
  current = child.f_locals.get("fn") if child is not None else None
  if fns is None or current is None:
    return None
  index = next((i for i, f in enumerate(fns) if f is current), None)
  return None if index is None else (index, [_label(f) for f in fns[:index]])


def _named_position(frame: FrameType) -> tuple[int, list[str]] | None:
  transforms, name = frame.f_locals.get("transforms"), frame.f_locals.get("name")
  if transforms is None or name is None:
    return None
  names = [n for n, _ in transforms]
  index = names.index(name) if name in names else None
  return None if index is None else (index, [repr(n) for n in names[:index]])


def check_head(what: str) -> None:
  """Raises if the scaler being initialised is not first where the scaled gradients arrive.

  Called from the scaler's ``init``: every optax chain (and ``named_chain``) around it must
  be initialising it, or the combinator holding it, in first position; no ``optax.masked``
  or ``optax.partition`` may hold it.

  Raises:
    ValueError: naming the position, the transformations before the scaler, and the fix.
  """
  codes = _codes()
  frame: FrameType | None = sys._getframe(2)  # the caller of the scaler's init_fn
  child: FrameType | None = None
  while frame is not None:
    code = frame.f_code
    if code is codes["masked"]:
      raise ValueError(
        f"{what} is inside optax.masked or optax.partition (optax.multi_transform): it would "
        "unscale only its part of the gradients, and every other parameter would get the "
        "scaled gradients (65536 times too large at the default scale). Put the scaler at "
        "the head of the whole chain: optax.chain(jmp_scaler.dynamic_scale(), "
        "optax.partition(...))"
      )
    position, combinator = None, ""
    if code is codes["chain"]:
      position, combinator = _chain_position(frame, child), "optax.chain"
    elif code is codes["named_chain"]:
      position, combinator = _named_position(frame), "optax.named_chain"
    if position is not None and position[0] > 0:
      index, before = position
      raise ValueError(
        f"{what} is at position {index} (counting from 0) of an {combinator}, after "
        f"{', '.join(before)}, which act on the scaled gradients (a clip would cut the true "
        "gradients at max_norm / scale; a NaN filter would hide the overflow the scaler must "
        "see). The scaler must head the chain: optax.chain(jmp_scaler.dynamic_scale(), "
        "optax.clip_by_global_norm(...), optax.adam(...)) clips the true gradients"
      )
    child, frame = frame, frame.f_back
  return None
