"""What the dtypes a traced function already holds mean under :func:`autocast`.

``autocast`` sees a jaxpr, in which a cast that jnp, ``jax.nn`` or Flax inserted
looks like one the user wrote. Before the jaxpr is evaluated again, one pass over
it decides two things, from the dtypes it was traced with:

* **Round trips.** A cast to a half-precision dtype ``D`` of a value that the
  function computed from ``D`` values it had widened (``x16 -> float32 -> reduce ->
  float16``: how ``jnp.sum``, ``jnp.var``, ``jax.nn.softmax``, Flax's norms and a
  hand-written ``x.astype(jnp.float32) ... .astype(x.dtype)`` ask for a float32 op on
  half-precision values) is not applied: the op is float32 under autocast, and its
  result stays float32, as PyTorch's float32 ops return float32. Every other cast
  is applied as written (``w.astype(jnp.float16)``, a deliberate rounding).
* **Float32-fed ops.** An op that follows its inputs (``"promote"``) and whose
  floating result is used only by float32 ops (an op under the ``"float32"`` rule,
  a cast to float32 or wider, the output cast to a float32 ``output_dtype``, another
  such op) runs in float32 itself: the ``sub`` and ``abs`` of an L1 loss, the ``mul``
  of ``addcmul``. Uses with no floating result (comparisons) do not count, nor does a
  composite under the ``"float32"`` rule (a softmax, a norm), which widens its input itself:
  the scaling of attention scores before the softmax stays in the compute dtype, as in
  PyTorch; data movement (``reshape``, ``broadcast_in_dim``, ``select_n``, ...) passes the
  use on without being cast.

It also finds two kinds of ops that are one op to ``torch.autocast`` but several in a
jaxpr: activation functions (:mod:`._composites`: each call is one op, in its input's
dtype) and **bias adds**: the ``add`` of a matmul's result (through data movement) and a
vector broadcast to its shape (a Dense or Conv layer's bias: ``torch.nn.Linear``'s ``addmm``
adds it in the compute dtype) runs in the matmul's dtype, not promoted to the float32 of
the stored bias.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_scaler._leaves import is_half
from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.precision import _rules as R
from jmp_scaler.precision._composites import Finder, Group

NONE: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class Plan:
  """The decisions for one jaxpr, given what its caller knows of its inputs and outputs.

  Attributes:
    float32: indices of the equations run in float32 (float32-fed ops).
    round_trips: indices of the casts not applied (the ends of round trips).
    widened: value -> the half dtypes it was computed from by widening.
    feeds_float32: for each input, whether only float32 ops use it.
    calls_fed: index of a call-like equation -> which of its outputs only float32 ops use.
    groups: the first member's index -> each activation's :class:`~._composites.Group`; it
      runs in float32 if its first member is in ``float32`` (its results feed float32 ops).
    bias_adds: index of a bias add -> which of its inputs is the matmul's result.
    fills: the values that are a scalar broadcast to a shape (``jnp.where(mask, x,
      jnp.finfo(x.dtype).min)``'s fill, ``jnp.full_like``): PyTorch's zero-dim tensors, which
      do not drive promotion against a dimensioned value (:func:`._autocast._is_weak`).
  """

  float32: frozenset[int]
  round_trips: frozenset[int]
  widened: Mapping[Any, frozenset]
  feeds_float32: tuple[bool, ...]
  calls_fed: Mapping[int, tuple[bool, ...]]
  groups: Mapping[int, Group] = dataclasses.field(default_factory=dict)
  bias_adds: Mapping[int, int] = dataclasses.field(default_factory=dict)
  fills: frozenset = NONE


def _floating(v: Any) -> bool:
  return jnp.issubdtype(v.aval.dtype, jnp.floating)


def _size(dtype: Any) -> int:
  return np.dtype(dtype).itemsize


def _is_convert(eqn: Any) -> bool:
  return eqn.primitive.name == "convert_element_type"


def _vector(v: Any) -> bool:
  """A non-literal value with at most one dimension longer than 1 (a bias, a scale)."""
  return not J.is_literal(v) and sum(d != 1 for d in v.aval.shape) <= 1


class Planner:
  """Plans jaxprs under a rule table; the plans of shared bodies (jnp's jits) are cached."""

  def __init__(self, table: Mapping[str, str], body_of: Callable[[Any], Any],
               given: frozenset[str] = frozenset(), finder: Finder | None = None):  # fmt: skip
    """``given``: the primitives the user gave a rule; they are never run in float32 for
    feeding float32 ops (``rules={"mul": "promote"}`` switches that off for ``mul``).
    ``finder``: the activations' finder (none: every primitive decided alone)."""
    self.table, self.given = table, given
    self.finder = finder or Finder({})
    self.body_of = lambda eqn: None if self.finder.jit_composite(eqn) else body_of(eqn)
    self._trips: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    self._fed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    self._bias: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    self._fills: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  def rule(self, eqn: Any) -> str:
    rule = self.table.get(eqn.primitive.name)
    if rule is None:
      rule = R.KEEP if eqn.primitive.multiple_results else R.PROMOTE
    return rule

  def plan(self, jaxpr: Any, widened_in: Sequence | None = None,
           fed_out: Sequence[bool] | None = None) -> Plan:  # fmt: skip
    """The plan of ``jaxpr`` whose inputs were widened from ``widened_in`` (per input) and
    whose outputs only float32 ops use where ``fed_out`` says so (both: none if not given)."""
    widened_in = tuple(widened_in) if widened_in is not None else (NONE,) * len(jaxpr.invars)
    fed_out = tuple(fed_out) if fed_out is not None else (False,) * len(jaxpr.outvars)
    trips = self._trips.setdefault(jaxpr, {})
    if widened_in not in trips:
      trips[widened_in] = self._round_trips(jaxpr, widened_in)
    if jaxpr not in self._bias:
      self._bias[jaxpr] = self._bias_adds(jaxpr)
      self._fills[jaxpr] = frozenset(
        e.outvars[0] for e in jaxpr.eqns
        if e.primitive.name == "broadcast_in_dim" and not np.shape(e.invars[0].aval)
        and _floating(e.outvars[0]))
    fed = self._fed.setdefault(jaxpr, {})
    if fed_out not in fed:
      fed[fed_out] = self._float32_fed(jaxpr, fed_out)
    (round_trips, widened), (float32, feeds, calls) = trips[widened_in], fed[fed_out]
    groups = self.finder.groups(jaxpr)
    return Plan(float32, round_trips, widened, feeds, calls, groups, self._bias[jaxpr],
                self._fills[jaxpr])

  # -------------------------------------------------------------- round trips

  def _round_trips(self, jaxpr: Any, widened_in: tuple) -> tuple[frozenset, dict]:
    widened: dict[Any, frozenset] = dict(zip(jaxpr.invars, widened_in, strict=True))
    get = lambda v: NONE if J.is_literal(v) else widened.get(v, NONE)
    trips: set[int] = set()
    for i, eqn in enumerate(jaxpr.eqns):
      ins = NONE.union(*(get(v) for v in eqn.invars if _floating(v)))
      if _is_convert(eqn):
        outs = [self._through_cast(eqn, ins, trips, i)]
      elif self.rule(eqn) in R.MATMUL:
        outs = [NONE] * len(eqn.outvars)  # a matmul's result is new, in the compute dtype
      elif (body := self.body_of(eqn)) is not None:
        inner = self.plan(body, [get(v) for v in eqn.invars])
        outs = [NONE if J.is_literal(v) else inner.widened.get(v, NONE)
                for v in body.outvars]  # fmt: skip
      else:
        outs = [ins] * len(eqn.outvars)
      widened.update((v, w) for v, w in zip(eqn.outvars, outs, strict=True) if _floating(v))
    return frozenset(trips), widened

  @staticmethod
  def _through_cast(eqn: Any, ins: frozenset, trips: set, i: int) -> frozenset:
    src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
      return NONE
    if is_half(src) and not is_half(dst):
      return ins | {np.dtype(src)}  # widened from src
    if is_half(dst) and _size(dst) < _size(src):
      if np.dtype(dst) in ins:
        trips.add(i)  # the end of a round trip: not applied, the value stays as it is
        return ins
      return NONE  # narrowed as written
    return ins

  # -------------------------------------------------------------- bias adds

  def _bias_adds(self, jaxpr: Any) -> dict[int, int]:
    """Each ``add`` of a matmul's result and a broadcast vector -> the matmul operand's index.

    A matmul's result stays one through data movement (``reshape``, ``transpose``, ...); a
    bias is a value of rank 0 or 1 (after dropping unit dimensions) broadcast to the other
    operand's shape, through data movement, casts and ``pvary`` (inside ``shard_map``, a
    replicated bias added to a per-device result is marked varying first). An attention
    mask (rank 2) is not one, nor is an ``add`` the user gave a rule (it keeps that rule).
    """
    matmul: set[Any] = set()
    small: set[Any] = set()  # values that are a broadcast vector (or the vector itself)
    found = {}
    for i, eqn in enumerate(jaxpr.eqns):
      name = eqn.primitive.name
      ins = [v for v in eqn.invars if not J.is_literal(v)]
      if self.rule(eqn) in R.MATMUL:
        matmul.update(eqn.outvars)
      elif (name in R.MOVES or name == "pvary") and len(eqn.outvars) == 1 and ins:
        if ins[0] in matmul and name != "broadcast_in_dim":
          matmul.add(eqn.outvars[0])
        if ins[0] in small or (name in ("broadcast_in_dim", "reshape")
                               and _vector(eqn.invars[0])):  # fmt: skip
          small.add(eqn.outvars[0])
      elif _is_convert(eqn) and ins and ins[0] in small:
        small.add(eqn.outvars[0])
      elif name == "add" and name not in self.given and len(ins) == 2 and all(
          _floating(v) for v in ins):  # fmt: skip
        a, b = ins
        shape = eqn.outvars[0].aval.shape
        for k, (m, s) in enumerate(((a, b), (b, a))):
          if m in matmul and m.aval.shape == shape and s in small and len(shape) >= 1:
            found[i] = k
            break
    return found

  # -------------------------------------------------------------- float32-fed ops

  def _float32_fed(self, jaxpr: Any, fed_out: tuple[bool, ...]) -> tuple:
    uses: dict[Any, list[tuple[int, int]]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for k, v in enumerate(eqn.invars):
        if not J.is_literal(v):
          uses.setdefault(v, []).append((i, k))
    returned: dict[Any, bool] = {}
    for v, f in zip(jaxpr.outvars, fed_out, strict=True):
      if not J.is_literal(v):
        returned[v] = returned.get(v, True) and f
    float32: set[int] = set()
    groups = self.finder.groups(jaxpr)
    group_of = {i: g for g in groups.values() for i in g.members}
    bias_adds = self._bias[jaxpr]  # in the matmul's dtype whatever uses them (addmm)
    moves: set[int] = set()  # data movement whose result only float32 ops use
    calls_in: dict[int, tuple[bool, ...]] = {}  # which inputs of a call only float32 ops use
    calls_out: dict[int, tuple[bool, ...]] = {}

    def uses_in_float32(i: int, k: int) -> bool | None:  # None: no floating result
      eqn = jaxpr.eqns[i]
      if i in group_of:  # an activation: one op, float32 if its results feed float32 ops
        if group_of[i].rule == R.FLOAT32:
          return None  # widens its input itself: no reason to compute the input in float32
        return group_of[i].members[0] in float32
      if not any(_floating(v) for v in eqn.outvars):
        return None
      if i in float32 or i in moves or self.rule(eqn) == R.FLOAT32:
        return True
      if _is_convert(eqn):
        return _size(eqn.outvars[0].aval.dtype) >= max(4, _size(eqn.invars[0].aval.dtype))
      return i in calls_in and calls_in[i][k]

    def fed(v: Any) -> bool:
      if not _floating(v) or returned.get(v) is False:
        return False
      verdicts = [uses_in_float32(i, k) for i, k in uses.get(v, ())]
      if v in returned:
        verdicts.append(True)
      return True in verdicts and False not in verdicts

    for i in reversed(range(len(jaxpr.eqns))):
      eqn = jaxpr.eqns[i]
      if i in group_of:
        g = group_of[i]
        if i == g.members[-1]:  # every use of its results comes later: decided already
          floats = [v for v in g.outputs if _floating(v)]
          if g.rule == R.FLOAT32 or (floats and all(fed(v) for v in floats)):
            float32.add(g.members[0])
        continue
      if (body := self.body_of(eqn)) is not None:
        calls_out[i] = tuple(fed(v) for v in eqn.outvars)
        calls_in[i] = self.plan(body, fed_out=calls_out[i]).feeds_float32
      elif (
        self.rule(eqn) in R.FOLLOWING and eqn.primitive.name not in self.given
        and i not in bias_adds and not _is_convert(eqn) and len(eqn.outvars) == 1
        and not J.has_sub_jaxprs(eqn) and fed(eqn.outvars[0])
      ):  # fmt: skip
        (moves if eqn.primitive.name in R.MOVES else float32).add(i)
    feeds = tuple(fed(v) for v in jaxpr.invars)
    return frozenset(float32), feeds, calls_out
