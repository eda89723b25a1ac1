"""What a value being traced was computed from: the inputs its equations reach.

While ``jax.jit`` (``nnx.jit``, ``eqx.filter_jit``, ``shard_map``, ``make_jaxpr``...) traces
a function, each value is a ``DynamicJaxprTracer`` whose ``parent`` is the equation that made
it (``None`` for an input or a constant), and that equation's ``in_tracers`` are its operands.
Walking them backwards from the gradients tells whether the gradients were computed from the
loss scale and from the parameters: the scaler's check that it was handed gradients of the
*scaled* loss (:func:`jmp_scaler.scaling._scaler.check_scaled`).

A value closed over by a nested trace (an outer value read inside ``make_jaxpr``, a ``scan``
body, a ``cond`` branch) is an input of that trace, a constant whose value is the outer
tracer (``frame.constvar_to_val``): the walk goes on from it in the outer trace.

Version notes: ``DynamicJaxprTracer.parent`` and ``TracingEqn.in_tracers`` hold on jax 0.10.2
and 0.12 (``tests/test_unscaled.py`` asserts the walk on both ends). A tracer of another kind
(under ``vmap`` or ``jax.grad`` of the step itself) or a JAX without these attributes gives
"unknown", never a verdict: the check says nothing rather than something wrong.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import jax

try:
  from jax._src.interpreters.partial_eval import DynamicJaxprTracer
except ImportError:  # pragma: no cover - a JAX that moved it: every walk is "unknown"
  DynamicJaxprTracer = None  # type: ignore[assignment, misc]

__all__ = ["Reach", "reaches"]


class Reach(NamedTuple):
  """What the walk from some traced values found (:func:`reaches`)."""

  known: bool  #: every value was a tracer whose computation could be walked
  target: bool  #: ``target`` is among the values they were computed from
  others: bool  #: one of ``others`` is among them


def _is_walkable(x: Any) -> bool:
  return (DynamicJaxprTracer is not None and isinstance(x, DynamicJaxprTracer)
          and hasattr(x, "parent"))


def _outer(t: Any) -> Any:
  """The value an input of a nested trace stands for (an outer tracer or array), or ``None``."""
  frame = getattr(getattr(t, "_trace", None), "frame", None)
  consts = getattr(frame, "constvar_to_val", None)
  var = getattr(t, "val", None)
  if consts is None or var is None:
    return None
  try:
    return consts.get(var)
  except TypeError:  # a Literal (unhashable): a constant folded into the equation
    return None


def reaches(values: Iterable[Any], target: Any, others: Iterable[Any] = ()) -> Reach:
  """Whether ``values`` (tracers) were computed from ``target`` and from any of ``others``.

  Identity, not equality: ``target`` and ``others`` are the very tracers (or arrays closed
  over as constants) the function read. ``known`` is false when a value is not a tracer of
  a ``jit``-like trace (a concrete array, a ``vmap`` tracer): nothing can be said of it.
  """
  values = list(values)
  if not values or not all(_is_walkable(v) for v in values):
    return Reach(False, False, False)
  wanted = {id(x) for x in others}
  stack, seen, hit_other = values, set(), False
  while stack:
    t = stack.pop()
    if id(t) in seen:
      continue
    seen.add(id(t))
    if t is target:
      return Reach(True, True, hit_other)
    hit_other = hit_other or id(t) in wanted
    if not _is_walkable(t):
      continue  # a concrete constant, or a tracer of an outer trace of another kind
    parent = t.parent
    if parent is None:
      outer = _outer(t)
      if outer is not None:
        stack.append(outer)
      continue
    stack.extend(x for x in getattr(parent, "in_tracers", ()) if isinstance(x, jax.core.Tracer)
                 or x is target or id(x) in wanted)
  return Reach(True, False, hit_other)
