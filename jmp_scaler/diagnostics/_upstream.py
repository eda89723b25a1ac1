"""Is the same function finite in float32, and which upstream rounding broke the operation?

When the operation :func:`jmp_scaler.find_nonfinite` found is not finite in float32 either, on
the inputs it had, those inputs may themselves be float16's work: a probability that underflowed
to 0 before a ``log``, an ``eps=1e-8`` that is 0 in float16 before a division. This module
answers it with the function itself: ``fn`` is traced again on its arguments widened to float32
(so a Python constant such as optax's ``eps`` keeps its value), its jaxpr is evaluated with every
half-precision value computed in float32 (:func:`._walk.capture` with ``widen``), and the
origin's counterpart in it (:func:`match`: the same primitive at the same line, the same number
of times before it) is run again. The origin's ancestors in its level (:func:`ancestors`) are
captured in both runs, and the first one that float16 made different (:func:`find_culprit`: a
constant rounded to 0, a value rounded to 0, a value clipped at the largest half-precision
number) is the upstream operation named in the advice (:func:`culprit_advice`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_scaler._leaves import is_half
from jmp_scaler.diagnostics import _walk as W
from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _primitives as P
from jmp_scaler.jaxcompat import _source as S

#: How many ancestors of the origin (nearest first) are captured and compared.
MAX_ANCESTORS = 48


def key(eqn: Any) -> tuple:
  """What identifies an equation across two traces of one function: its primitive (a jit's
  function name), where it was traced, and its name stack."""
  name = eqn.primitive.name
  label = P.jit_name(eqn) if name in P.JIT_NAMES else ""
  return name, label, S.summarize(eqn), S.name_stack(eqn)


def _counterpart(a: Any, index: int, b: Any) -> int | None:
  """The index in jaxpr ``b`` of equation ``index`` of jaxpr ``a`` (the same :func:`key`, the
  same number of times before it), or None."""
  want = key(a.eqns[index])
  rank = sum(key(e) == want for e in a.eqns[:index])
  for j, e in enumerate(b.eqns):
    if key(e) == want:
      if rank == 0:
        return j
      rank -= 1
  return None


def match(a: Any, path: Sequence[W.Step], b: Any,
          extra: Sequence[int]) -> tuple[list[W.Step], dict[int, int]]:  # fmt: skip
  """``path`` (in the closed jaxpr ``a``) followed in the closed jaxpr ``b``, and the indices
  ``extra`` of the origin's level mapped to ``b``'s (those with a counterpart). Raises
  LookupError where an equation of the path has none."""
  level_a, level_b = J.closed(a).jaxpr, J.closed(b).jaxpr
  out: list[W.Step] = []
  for step in path:
    j = _counterpart(level_a, step.index, level_b)
    if j is None:
      raise LookupError(f"{level_a.eqns[step.index].primitive.name} at "
                        f"{S.summarize(level_a.eqns[step.index])} has no counterpart")
    out.append(W.Step(j, step.kind, step.at))
    if step.kind != "op":
      level_a = J.closed(W.sub_jaxpr(level_a.eqns[step.index], step)).jaxpr
      level_b = J.closed(W.sub_jaxpr(level_b.eqns[j], step)).jaxpr
  mapped = {i: _counterpart(level_a, i, level_b) for i in extra}
  return out, {i: j for i, j in mapped.items() if j is not None}


def ancestors(level: Any, index: int, limit: int = MAX_ANCESTORS) -> list[int]:
  """The equations of ``level`` (an open jaxpr) whose outputs flow into equation ``index``,
  nearest first up to ``limit``, returned in program order."""
  made = {v: i for i, e in enumerate(level.eqns) for v in e.outvars}
  found: list[int] = []
  todo = [v for v in level.eqns[index].invars if not J.is_literal(v)]
  while todo and len(found) < limit:
    v = todo.pop(0)
    i = made.get(v)
    if i is None or i in found:
      continue
    found.append(i)
    todo.extend(u for u in level.eqns[i].invars if not J.is_literal(u))
  return sorted(found)


@dataclasses.dataclass(frozen=True)
class Culprit:
  """The first upstream operation float16 made different: ``kind`` is ``"constant"`` (a
  constant rounded to 0), ``"underflow"`` (a value rounded to 0 below the half dtype's
  smallest number), ``"rounding"`` (rounded to 0 above it: cancellation) or ``"clipped"``."""

  kind: str
  eqn: Any
  name: str  #: the primitive, or ``jit <function>`` for a call
  dtype: str  #: the half dtype
  detail: str
  library: str  #: the library whose code holds it (``"optax"``), or ""


def _library(eqn: Any) -> str:
  for frame in S.frames(eqn):
    for lib in ("optax", "flax", "equinox"):
      if f"{os.sep}{lib}{os.sep}" in frame.file:
        return lib
  return ""


def _name(eqn: Any) -> str:
  name = eqn.primitive.name
  if name in P.JIT_NAMES:
    return f"{P.jit_name(eqn)} (a jitted function)"
  if name in P.CUSTOM_NAMES:  # jax.nn.softmax is one custom_jvp from jax 0.12.1 on
    fn = J.function_name(P.call_body(eqn))
    return f"{fn} (a {name.removesuffix('_call')} function)" if fn else name
  return name


def _float(a: Any) -> np.ndarray:
  return np.asarray(a).astype(np.float64)


def _constant(ea: Any, eb: Any) -> Culprit | None:
  for va, vb in zip(ea.invars, eb.invars, strict=False):
    if not (J.is_literal(va) and J.is_literal(vb)):
      continue
    dtype = np.asarray(va.val).dtype
    if not is_half(dtype) or np.asarray(va.val).size != 1:
      continue
    half, wide = float(_float(va.val).reshape(())), float(_float(vb.val).reshape(()))
    if half == 0.0 and wide != 0.0:
      tiny = float(jnp.finfo(dtype).smallest_subnormal)
      return Culprit("constant", ea, _name(ea), str(dtype),
                     f"the constant {wide:.3g} is 0 in {dtype} (its smallest positive number "
                     f"is {tiny:.3g})", _library(ea))  # fmt: skip
    if math.isinf(half) and math.isfinite(wide):
      return Culprit("clipped", ea, _name(ea), str(dtype),
                     f"the constant {wide:.3g} is inf in {dtype}", _library(ea))
  return None


def _changed(ea: Any, half_outs: Sequence[Any], wide_outs: Sequence[Any],
             bad: np.ndarray) -> Culprit | None:  # fmt: skip
  """How float16 changed an output of ``ea``: rounded to 0, or clipped; an output shaped like
  the origin's counts only at the elements the origin made non-finite (``bad``)."""
  for v, ha, wb in zip(ea.outvars, half_outs, wide_outs, strict=False):
    dtype = getattr(v.aval, "dtype", None)
    if dtype is None or not is_half(dtype):
      continue
    h, w = _float(ha), _float(wb)
    if h.shape != w.shape:
      continue
    finite = np.isfinite(w) & (bad if bad.shape == w.shape else True)
    zeroed = (h == 0) & (w != 0) & finite
    if zeroed.any():
      lost = np.abs(w[zeroed])
      tiny = float(jnp.finfo(dtype).smallest_subnormal)
      kind = "underflow" if lost.max() < tiny else "rounding"
      span = (f"{lost.min():.3g}" if lost.min() == lost.max() else
              f"{lost.min():.3g} to {lost.max():.3g}")  # fmt: skip
      count = f"{int(zeroed.sum())} of {h.size} elements"
      what = (f"its result underflows to 0 in {dtype} ({count}; float32 gives {span}, below "
              f"{dtype}'s smallest positive {tiny:.3g})" if kind == "underflow" else
              f"its result rounds to 0 in {dtype} ({count}, float32 gives up to "
              f"{lost.max():.3g}: a difference of nearly equal numbers)")  # fmt: skip
      return Culprit(kind, ea, _name(ea), str(dtype), what, _library(ea))
    top = float(jnp.finfo(dtype).max)
    clipped = np.isfinite(h) & (np.abs(h) >= top) & finite & (np.abs(w) > top)
    if clipped.any():
      return Culprit("clipped", ea, _name(ea), str(dtype),
                     f"its result is clipped at {dtype}'s largest {top:g} (float32 gives up to "
                     f"{float(np.abs(w[clipped]).max()):.4g})", _library(ea))  # fmt: skip
  return None


def find_culprit(level_a: Any, level_b: Any, order: Sequence[int], mapped: dict[int, int],
                 half: dict[int, list], wide: dict[int, list], origin: tuple[int, int],
                 bad: np.ndarray) -> Culprit | None:  # fmt: skip
  """The first equation of ``order`` (indices of ``level_a``, the origin's ancestors in program
  order) that float16 made different from its float32 counterpart (``mapped`` into
  ``level_b``): a constant rounded to 0, or an output rounded to 0 or clipped (``half`` and
  ``wide`` hold the outputs of both runs; an output shaped like the origin's counts only where
  the origin's output, ``bad``, is not finite). A constant rounded to 0 (the origin's own
  included) is named before any output: what follows from it is its doing."""
  pairs = [(i, mapped[i]) for i in order if i in mapped]
  for i, j in [*pairs, origin]:  # a constant rounded to 0 first: the root of what follows
    found = _constant(level_a.eqns[i], level_b.eqns[j])
    if found is not None:
      return found
  for i, j in pairs:
    if i in half and j in wide:
      found = _changed(level_a.eqns[i], half[i], wide[j], bad)
      if found is not None:
        return found
  return None


def culprit_advice(c: Culprit, where: str, origin: str, phase: str, scale: float | None,
                   in_backward: bool, autocast: str | None,
                   inside: str | None = None) -> str:  # fmt: skip
  """The next step for a ``c`` at ``where`` that broke the ``origin`` primitive (under the
  ``autocast`` policy, if any; ``inside`` the library function called at ``where``)."""
  short = {"constant": "rounds a constant to 0", "underflow": "underflows to 0",
           "rounding": "rounds to 0", "clipped": "clips a value"}[c.kind]
  head = (f"the same function in float32 is finite: the {c.name} at {where}, upstream of this "
          f"{origin}, {short} in {c.dtype}. ")  # fmt: skip
  if c.kind == "constant" and c.library == "optax":
    return head + ("An optax optimizer on float16 (or bfloat16) parameters: keep its state and "
                   "arithmetic in float32: float32 master weights (a policy with param=float32), "
                   "or jmp_scaler.adam, whose moments and update are float32 whatever the "
                   "parameters' dtype")  # fmt: skip
  if c.kind == "constant":
    return head + (f"Compute this in float32 (.astype(jnp.float32) before the {c.name}), or "
                   f"use a constant {c.dtype} can hold")  # fmt: skip
  if origin in ("log", "log1p") and ("softmax" in c.name or c.name in ("exp", "div")):
    return head + ("A log of a softmax: compute it as one operation in float32, "
                   "jax.nn.log_softmax(logits.astype(jnp.float32)), which never takes the log "
                   "of 0")  # fmt: skip
  if c.kind == "underflow" and phase == "backward" and in_backward:
    return head + (f"A gradient that underflows at scale {scale:g}: a larger scale keeps it "
                   "(raise dynamic_scale's min_scale, the floor of the scale), or compute "
                   f"the {c.name} at {where} in float32")  # fmt: skip
  if inside is not None and c.kind != "constant":
    return head + (f"Call {inside} on float32 values at {where} (.astype(jnp.float32) on its "
                   "inputs), and cast its result back if you need it in half precision")
  if autocast is not None and c.name == c.eqn.primitive.name:
    return head + (f"Keep it in float32 under autocast ({autocast}): jmp_scaler.autocast(fn, "
                   f"policy, rules={{{c.name!r}: 'float32'}}) (every {c.name}), or "
                   f"jmp_scaler.full_precision around the code at {where} (this one)")
  return head + (f"Compute the {c.name} at {where} in float32 (cast its inputs with "
                 ".astype(jnp.float32))")
