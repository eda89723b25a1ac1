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
from jax.extend.core import Literal

try:
  from jax._src.interpreters.partial_eval import DynamicJaxprTracer
except ImportError:  # pragma: no cover - a JAX that moved it: every walk is "unknown"
  DynamicJaxprTracer = None  # type: ignore[assignment, misc]

__all__ = ["Reach", "reaches", "selected_constants"]

_JIT_NAMES = ("jit", "pjit")

#: Primitives whose one operand's values are its result's (a constant broadcast to a mask's
#: shape, reshaped, converted to a floating dtype at least as wide).
_VALUE_PRESERVING = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p",
    "convert_element_type"})


class Reach(NamedTuple):
  """What the walk from some traced values found (:func:`reaches`)."""

  known: bool  #: every value was a tracer whose computation could be walked
  target: bool  #: ``target`` is among the values they were computed from
  others: bool  #: one of ``others`` is among them


def _is_walkable(x: Any) -> bool:
  return (DynamicJaxprTracer is not None and isinstance(x, DynamicJaxprTracer)
          and hasattr(x, "parent"))


def _outer(t: Any) -> Any:
  """The value an input of a nested trace stands for (an outer tracer or array, a literal's
  value), or ``None`` for an input of the traced function."""
  frame = getattr(getattr(t, "_trace", None), "frame", None)
  consts = getattr(frame, "constvar_to_val", None)
  var = getattr(t, "val", None)
  if consts is None or var is None:
    return None
  try:
    return consts.get(var)
  except TypeError:  # a Literal (unhashable): a constant folded into the equation
    return getattr(var, "val", None)


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



#: Primitives whose result holds, element by element, one of their operands' values: a
#: constant among those operands may be among its values (a mask ``jnp.where`` chooses).
_SELECTING = frozenset({"select_n", "max", "min", "clamp", "concatenate", "pad"})


class _Node(NamedTuple):
  """A value being walked: a tracer, or a variable of a call's body with the nodes its
  inputs stand for (``outer``) and its constants."""

  tracer: Any = None
  var: Any = None
  jaxpr: Any = None
  outer: tuple = ()
  consts: tuple = ()


def selected_constants(x: Any, limit: int = 64) -> list:
  """The constants of the traced function that some elements of ``x`` (a tracer) may hold.

  Walks back from ``x`` through value-preserving ops (broadcast, reshape, convert) and ops
  that choose among their operands' values (``select_n``, ``max``, ``min``, ``clamp``,
  ``concatenate``, ``pad``), into the bodies of ``jit`` calls (``jnp.where`` is one), and
  returns the concrete constants it reaches (a literal, a closed-over array): what
  ``jnp.where(mask, scores, -2.38e38)`` holds where the mask is false. Stops at any other
  op (an arithmetic result is no constant's) and after ``limit`` values. A concrete ``x`` is
  its own constant.
  """
  found: list = []
  stack = [_Node(tracer=x)]
  for _ in range(limit):
    if not stack:
      break
    node = stack.pop()
    if node.tracer is not None:
      t = node.tracer
      if not isinstance(t, jax.core.Tracer):
        found.append(t)
        continue
      if not _is_walkable(t):
        continue
      parent = t.parent
      if parent is None:
        outer = _outer(t)
        if outer is not None:
          stack.append(_Node(tracer=outer))
        continue
      ins = [_Node(tracer=i) for i in getattr(parent, "in_tracers", ())]
      out_index = _index(getattr(parent, "outvars", ()), t.val)
      stack.extend(_step(parent, ins, out_index))
    else:
      stack.extend(_var_step(node))
  return found


def _index(outvars: Any, var: Any) -> int | None:
  for i, v in enumerate(outvars):
    if v is var:
      return i
  return None


def _step(eqn: Any, ins: list, out_index: int | None) -> list:
  """The nodes an output of ``eqn`` (its ``out_index``-th) may take its values from."""
  name = getattr(getattr(eqn, "primitive", None), "name", None)
  if name in _VALUE_PRESERVING and len(ins) == 1:
    return ins
  if name == "select_n":
    return ins[1:]
  if name in _SELECTING:
    return ins
  if name in _JIT_NAMES and out_index is not None:
    body = eqn.params.get("jaxpr")
    inner = getattr(body, "jaxpr", body)
    if inner is None or not hasattr(inner, "outvars"):
      return []
    return [_Node(var=inner.outvars[out_index], jaxpr=inner, outer=tuple(ins),
                  consts=tuple(getattr(body, "consts", ())))]
  return []


def _var_step(node: _Node) -> list:
  """The nodes a variable of a call's body may take its values from."""
  var, jaxpr = node.var, node.jaxpr
  if isinstance(var, Literal):
    return [_Node(tracer=var.val)]
  for i, v in enumerate(jaxpr.invars):
    if v is var:
      return [node.outer[i]] if i < len(node.outer) else []
  for i, v in enumerate(jaxpr.constvars):
    if v is var:
      return [_Node(tracer=node.consts[i])] if i < len(node.consts) else []
  for eqn in jaxpr.eqns:
    out_index = _index(eqn.outvars, var)
    if out_index is not None:
      ins = [_Node(var=v, jaxpr=jaxpr, outer=node.outer, consts=node.consts)
             for v in eqn.invars]
      return _step(eqn, ins, out_index)
  return []
