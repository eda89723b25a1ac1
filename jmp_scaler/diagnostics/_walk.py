"""Where in a jaxpr the first inf or NaN appears: the compiled passes behind ``find_nonfinite``.

An *origin* is an equation whose floating output holds inf or NaN while every input is finite.
Two passes find the first one and its inputs, each a single compiled program:

* :func:`probe` evaluates the jaxpr equation by equation inside ``jax.jit`` and records, for
  every equation that can make a non-finite value, whether it is an origin. Calls (``jit``,
  ``remat``, ``custom_jvp``/``custom_vjp`` functions, autocast and ``full_precision`` regions)
  are inlined; a ``scan`` or ``while`` loop keeps the record of its first iteration holding an
  origin, a ``cond`` the record of the branch it took, a ``shard_map`` that of the device whose
  first origin comes first (ties: the lowest index; a collective's inputs are every
  device's). :func:`first_origin` reads from the record the path to the first origin in
  program order.
* :func:`capture` evaluates the jaxpr again and returns the inputs of the equation at that
  path: at that iteration, in that branch, on that device.

Everything that is not an origin is evaluated by binding its primitive as it is, so both
programs compute what the function computes, with one reduction per floating value more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jmp_scaler._leaves import is_floating, is_half
from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _primitives as P
from jmp_scaler.jaxcompat import _types as T

#: Primitives whose output is finite exactly when their inputs are (they move values, or
#: repeat them): their finiteness is their inputs', and they need no reduction of their own.
#: (``lax.expand_dims`` traces to ``broadcast_in_dim``.)
SAME_VALUES = frozenset(("reshape", "transpose", "squeeze", "rev", "copy", "broadcast_in_dim"))
#: A device index larger than any mesh's: "no device holds an origin".
_NO_DEVICE = np.iinfo(np.int32).max


# ---------------------------------------------------------------- the record's layout


@dataclasses.dataclass
class Entry:
  """One equation's place in its level's record.

  Slots, from ``start``: ``"op"``: [origin]; ``"call"``: the body's record; ``"scan"``:
  [found, iteration, body record]; ``"while"``: [the condition's record before the first
  iteration, found, iteration, body record, the condition's record after that iteration];
  ``"cond"``: each branch's record in turn; ``"shard_map"``: [device or -1, body record].
  """

  index: int
  kind: str
  start: int
  children: tuple = ()


@dataclasses.dataclass
class Layout:
  """The record of one evaluation of ``jaxpr`` (closed): where each equation's slots are."""

  jaxpr: Any
  entries: list[Entry]
  size: int


@dataclasses.dataclass(frozen=True)
class Step:
  """One step of the path to an origin: equation ``index`` of a level, entered as ``kind``
  (``"op"``, ``"call"``, ``"scan"``, ``"while_cond0"``, ``"while_body"``, ``"while_cond"``,
  ``"cond"``, ``"shard_map"``) at iteration, branch or device ``at``.

  A frozen dataclass, not a NamedTuple: a field named ``index`` would shadow ``tuple.index``."""

  index: int
  kind: str
  at: int | None = None


def first_origin(layout: Layout, rec: np.ndarray, base: int = 0) -> list[Step] | None:
  """The path to the first origin recorded in ``rec`` (host values), in program order."""
  for e in layout.entries:
    s = base + e.start
    found: list[Step] | None = None
    if e.kind == "op":
      found = [Step(e.index, "op")] if rec[s] else None
    elif e.kind == "call":
      inner = first_origin(e.children[0], rec, s)
      found = [Step(e.index, "call"), *inner] if inner else None
    elif e.kind == "scan":
      if rec[s]:
        found = [Step(e.index, "scan", int(rec[s + 1])), *_inner(e.children[0], rec, s + 2)]
    elif e.kind == "while":
      cond0, body, cond = e.children
      inner = first_origin(cond0, rec, s)
      if inner:
        found = [Step(e.index, "while_cond0"), *inner]
      elif rec[s + cond0.size]:
        at, s = int(rec[s + cond0.size + 1]), s + cond0.size + 2
        inner = first_origin(body, rec, s)
        found = ([Step(e.index, "while_body", at), *inner] if inner else
                 [Step(e.index, "while_cond", at), *_inner(cond, rec, s + body.size)])
    elif e.kind == "cond":
      for b, branch in enumerate(e.children):
        inner = first_origin(branch, rec, s)
        if inner:
          found = [Step(e.index, "cond", b), *inner]
          break
        s += branch.size
    elif e.kind == "shard_map":
      if rec[s] >= 0:
        found = [Step(e.index, "shard_map", int(rec[s])), *_inner(e.children[0], rec, s + 1)]
    if found:
      return found
  return None


def _inner(layout: Layout, rec: np.ndarray, base: int) -> list[Step]:
  inner = first_origin(layout, rec, base)
  if inner is None:  # a loop or device said it found one: its body must hold it
    raise RuntimeError("jmp_scaler.find_nonfinite: a record names an origin its body lacks")
  return inner


def equations(layout: Layout, path: Sequence[Step]) -> list[Any]:
  """The equations along ``path``, outermost first (the last one is the origin)."""
  out = []
  for step in path:
    eqn = J.closed(layout.jaxpr).jaxpr.eqns[step.index]
    out.append(eqn)
    entry = next(e for e in layout.entries if e.index == step.index)
    if step.kind == "op":
      break
    if step.kind in ("call", "scan", "shard_map"):
      layout = entry.children[0]
    elif step.kind == "while_cond0":
      layout = entry.children[0]
    elif step.kind == "while_body":
      layout = entry.children[1]
    elif step.kind == "while_cond":
      layout = entry.children[2]
    else:  # cond
      assert step.at is not None, "a cond step names its branch"
      layout = entry.children[step.at]
  return out


# ---------------------------------------------------------------- helpers


def finite(x: Any) -> Any:
  """Whether every element of ``x`` is finite: a traced bool, or True for non-floating ``x``.

  Not ``isfinite(sum(x * 0))``, which compiles faster: XLA folds ``(y * 1000) * 0`` into
  ``y * 0``, and an overflow of ``y * 1000`` would go unseen.
  """
  if not is_floating(x) or not np.size(x):
    return True
  return jnp.all(jnp.isfinite(x))


def _widens(eqn: Any) -> bool:
  """A cast from a floating dtype to one whose range holds it (float16 to float32): its
  output is finite exactly when its input is."""
  if eqn.primitive.name != "convert_element_type":
    return False
  src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
  floating = lambda d: jnp.issubdtype(d, jnp.floating)  # noqa: E731
  return floating(src) and floating(dst) and jnp.finfo(dst).max >= jnp.finfo(src).max


def host_finite(x: Any) -> bool:
  """Whether every element of the host value ``x`` is finite (True for non-floating ``x``);
  bfloat16 and fp8 are widened to float64 first."""
  a = np.asarray(x)
  if not jnp.issubdtype(a.dtype, jnp.inexact):
    return True
  return bool(np.all(np.isfinite(a.astype(np.complex128 if a.dtype.kind == "c" else np.float64))))


def _or(a: Any, b: Any) -> Any:
  if a is False:
    return b
  if b is False:
    return a
  return jnp.logical_or(a, b)


def _as_bool(x: Any) -> jax.Array:
  return jnp.asarray(x, jnp.bool_)


def _vector(pieces: list) -> jax.Array:
  if not pieces:
    return jnp.zeros([0], jnp.int32)
  return jnp.concatenate([jnp.reshape(jnp.asarray(p, jnp.int32), [-1]) for p in pieces])


def _init_like(value: Any, like: Any) -> Any:
  """``value`` varying along the mesh axes the abstract value ``like`` varies along (a loop
  carry inside ``shard_map`` must keep its type from one iteration to the next)."""
  axes = tuple(sorted(T.varying_axes(like) - T.varying_axes(value), key=str))
  return T.mark_varying(value, axes) if axes else value


def _zeros(like: Any) -> Any:
  return _init_like(jnp.zeros(like.shape, like.dtype), like)


def _structs(xs: Sequence[Any]) -> list:
  return [T.struct(x) for x in xs]


def _manual_axes(p: P.ShardMap) -> tuple:
  return tuple(a for a in p.mesh.axis_names if a in p.axis_names)


def _device(axes: tuple) -> jax.Array:
  """This device's index along the manual mesh ``axes`` (row-major)."""
  return lax.axis_index(axes)


def _everywhere(flag: Any, axes: tuple) -> jax.Array:
  """Whether ``flag`` holds on every device along ``axes``."""
  flag = jnp.asarray(flag, jnp.int32)
  missing = tuple(a for a in axes if a not in T.varying_axes(flag))
  return lax.pmin(T.mark_varying(flag, missing) if missing else flag, axes) > 0


def _on_device(x: jax.Array, device: Any, index: jax.Array, axes: tuple) -> jax.Array:
  """The value ``x`` has on ``device`` (along ``axes``), on every device."""
  if x.dtype == jnp.bool_:
    return _on_device(x.astype(jnp.int32), device, index, axes).astype(jnp.bool_)
  if not (jnp.issubdtype(x.dtype, jnp.number)):
    raise ValueError(f"jmp_scaler.find_nonfinite cannot bring a {x.dtype} value out of shard_map")
  return lax.psum(jnp.where(index == device, x, jnp.zeros((), x.dtype)), axes)


# ---------------------------------------------------------------- the probe


class Level(NamedTuple):
  outs: list
  finite: list  #: each output's finiteness (traced bool or True)
  record: jax.Array  #: int32 vector, laid out by ``layout``
  any: Any  #: whether the record holds an origin (traced bool or False)
  layout: Layout
  found: Any  #: bool vector: whether each entry of ``layout`` holds an origin (None if none)

  def first(self) -> jax.Array:
    """The index of the first entry holding an origin, or a number larger than any."""
    if self.found is None:
      return jnp.int32(_NO_DEVICE)
    return jnp.where(jnp.any(self.found), jnp.argmax(self.found), _NO_DEVICE).astype(jnp.int32)


class _Flags:
  """The finiteness flags of one level's values, as slots of one vector built at its end: the
  origins of all its operations are then two gathers and a reduction, not a chain of scalar
  operations per equation (which made the compiled program several times larger)."""

  TRUE, FALSE = 0, 1

  def __init__(self):
    self.values: list = [True, False]
    self.ops: list[tuple[list[int], list[int]]] = []  #: (output slots, input slots) per op

  def slot(self, flag: Any) -> int:
    if flag is True or flag is False:
      return self.TRUE if flag else self.FALSE
    self.values.append(flag)
    return len(self.values) - 1

  def value(self, slot: int) -> Any:
    return self.values[slot]

  def all(self, slots: Sequence[int]) -> Any:
    """Whether every slot holds (True if they are all the constant True)."""
    slots = [s for s in slots if s != self.TRUE]
    if not slots:
      return True
    if self.FALSE in slots:
      return False
    if len(slots) == 1:
      return self.values[slots[0]]
    return jnp.all(jnp.stack([self.values[s] for s in slots]))

  def origins(self) -> jax.Array:
    """Each op's origin flag: an output not finite while every input is."""
    width = lambda k: max(1, max(len(op[k]) for op in self.ops))  # noqa: E731
    pad = lambda k: np.array([op[k] + [self.TRUE] * (width(k) - len(op[k]))  # noqa: E731
                              for op in self.ops], np.int32)
    flags = jnp.stack([jnp.asarray(v, jnp.bool_) for v in self.values])
    outs, ins = flags[pad(0)], flags[pad(1)]
    return jnp.logical_and(jnp.all(ins, axis=1), jnp.logical_not(jnp.all(outs, axis=1)))


class _Probe:
  """Evaluates jaxprs recording their origins (see the module docstring)."""

  def __init__(self):
    self.axes: tuple = ()  #: the manual mesh axes of the shard_map bodies around the level
    self.half = False  #: whether a value in a half-precision dtype was seen

  def run(self, closed: Any, args: Sequence[Any], known: Sequence[Any] | None = None,
          consts: Sequence[Any] | None = None) -> Level:
    """Evaluates ``closed`` on ``args`` (whose finiteness, where ``known``, is given), with
    ``consts`` in place of its constants if given."""
    closed = J.closed(closed)
    jaxpr = closed.jaxpr
    env: dict = {}
    flags = _Flags()
    fin: dict = {}  # var -> slot
    for v, x in zip(jaxpr.constvars, closed.consts if consts is None else consts, strict=True):
      env[v], fin[v] = x, flags.slot(finite(x))
    known = [None] * len(args) if known is None else known
    for v, x, k in zip(jaxpr.invars, args, known, strict=True):
      env[v], fin[v] = x, flags.slot(finite(x) if k is None else k)
    read = lambda v: J.read_literal(v, env)  # noqa: E731

    def slot_of(v):
      if J.is_literal(v):
        return flags.TRUE if host_finite(v.val) else flags.FALSE
      return fin[v]

    segments: list = []  # ("ops", [op numbers]) or ("sub", record, found)
    entries: list[Entry] = []
    size = 0
    for i, eqn in enumerate(jaxpr.eqns):
      ins = [read(v) for v in eqn.invars]
      in_slots = [slot_of(v) for v in eqn.invars]
      self.half = self.half or any(is_half(getattr(v.aval, "dtype", np.int32))
                                   for v in (*eqn.invars, *eqn.outvars))  # fmt: skip
      name = eqn.primitive.name
      body = P.inline_body(eqn)
      if body is not None:
        inner = self.run(body, ins, [flags.value(s) for s in in_slots])
        outs, out_fin = inner.outs, inner.finite
        sub = (Entry(i, "call", size, (inner.layout,)), inner.record, inner.any)
      elif name in _LOOPS:
        outs, rec, found, children = _LOOPS[name](self, eqn, ins,
                                                  [flags.value(s) for s in in_slots])
        out_fin = [finite(o) for o in outs]
        sub = (Entry(i, name, size, children), rec, found)
      elif name in SAME_VALUES or _widens(eqn):  # finite exactly when its inputs are
        outs = J.bind(eqn, ins)
        same = flags.all(in_slots)
        out_fin = [same if is_floating(o) else True for o in outs]
        sub = None
      else:
        outs = J.bind(eqn, ins)
        out_fin = [finite(o) for o in outs]
        sub = None
        out_slots = [flags.slot(f) for f in out_fin if f is not True]
        if out_slots:
          if self.axes and P.is_collective(eqn):  # its inputs are every device's
            in_slots = [flags.slot(_everywhere(flags.all(in_slots), self.axes))]
          entries.append(Entry(i, "op", size))
          if not segments or segments[-1][0] != "ops":
            segments.append(("ops", []))
          segments[-1][1].append(len(flags.ops))
          flags.ops.append((out_slots, [s for s in in_slots if s != flags.TRUE]))
          size += 1
      if sub is not None and np.size(sub[1]):
        entries.append(sub[0])
        segments.append(("sub", sub[1], sub[2]))
        size += int(np.shape(sub[1])[0])
      for v, o, f in zip(eqn.outvars, outs, out_fin, strict=True):
        env[v], fin[v] = o, flags.slot(f)
    outs = [read(v) for v in jaxpr.outvars]
    out_fin = [flags.value(slot_of(v)) for v in jaxpr.outvars]
    layout = Layout(closed, entries, size)
    if not segments:
      return Level(outs, out_fin, _vector([]), False, layout, None)
    origins = flags.origins() if flags.ops else None
    record, found = [], []
    for seg in segments:
      if seg[0] == "ops":
        assert origins is not None, "an ops segment is recorded only where flags.ops is not empty"
        part = origins[seg[1][0] : seg[1][-1] + 1]
        record.append(part)
        found.append(part)
      else:
        record.append(seg[1])
        found.append(jnp.reshape(_as_bool(seg[2]), [1]))
    found = jnp.concatenate(found)
    return Level(outs, out_fin, _vector(record), jnp.any(found), layout, found)


def _probe_scan(w: _Probe, eqn: Any, args: list, fins: list) -> tuple:
  p = P.scan(eqn)
  consts, init, xs = args[: p.num_consts], args[p.num_consts :][: p.num_carry], args[
    p.num_consts + p.num_carry :]
  n = p.num_carry
  known = [*fins[: p.num_consts], *[None] * (len(args) - p.num_consts)]  # constants: known
  seen: dict = {}

  def body(carry, x):
    row, _ = x
    level = w.run(p.body, [*consts, *carry, *row], known)
    seen["layout"] = level.layout
    return level.outs[:n], (level.outs[n:], level.record, _as_bool(level.any))

  index = jnp.arange(p.length, dtype=jnp.int32)
  carry, (ys, recs, anys) = lax.scan(body, list(init), (list(xs), index), length=p.length,
                                     reverse=p.reverse, unroll=p.unroll)  # fmt: skip
  layout = seen["layout"]
  if layout.size == 0 or p.length == 0:
    return [*carry, *ys], jnp.zeros([0], jnp.int32), False, (layout,)
  # The first iteration run: the lowest index, or the highest in a reversed scan.
  at = (p.length - 1 - jnp.argmax(anys[::-1])) if p.reverse else jnp.argmax(anys)
  found = jnp.any(anys)
  rec = _vector([found, at, recs[at]])
  return [*carry, *ys], rec, found, (layout,)


def _probe_while(w: _Probe, eqn: Any, args: list, fins: list) -> tuple:
  p = P.while_loop(eqn)
  nc, nb = p.cond_nconsts, p.body_nconsts
  cconsts, bconsts, init = args[:nc], args[nc : nc + nb], list(args[nc + nb :])
  cknown = [*fins[:nc], *[None] * len(init)]
  bknown = [*fins[nc : nc + nb], *[None] * len(init)]
  first = w.run(p.cond, [*cconsts, *init], [*fins[:nc], *fins[nc + nb :]])
  seen: dict = {}

  def iteration(carry):
    body = w.run(p.body, [*bconsts, *carry], bknown)
    cond = w.run(p.cond, [*cconsts, *body.outs], cknown)
    seen["layouts"] = (body.layout, cond.layout)
    rec = jnp.concatenate([body.record, cond.record])
    return body.outs, rec, _as_bool(_or(body.any, cond.any))

  shapes = jax.eval_shape(lambda c: iteration(c)[1:], _structs(init))
  layouts = (first.layout, *seen["layouts"])
  if shapes[0].shape[0] == 0:  # nothing in the loop can make a non-finite value
    rec = _vector([first.record, 0, 0]) if first.layout.size else _vector([])
    return J.bind(eqn, args), rec, first.any, layouts

  def body_fun(state):
    carry, count, found, at, rec = state
    outs, now, any_ = iteration(carry)
    new = jnp.logical_and(any_, jnp.logical_not(found))
    return (outs, count + 1, jnp.logical_or(found, any_), jnp.where(new, count, at),
            jnp.where(new, now, rec))  # fmt: skip

  def cond_fun(state):
    return J.run_closed(p.cond)(*cconsts, *state[0])[0]

  start = (init, jnp.int32(0), _init_like(jnp.bool_(False), shapes[1]),
           _init_like(jnp.int32(0), shapes[1]), _zeros(shapes[0]))  # fmt: skip
  outs, _, found, at, rec = lax.while_loop(cond_fun, body_fun, start)
  return list(outs), _vector([first.record, found, at, rec]), _or(first.any, found), layouts


def _probe_cond(w: _Probe, eqn: Any, args: list, fins: list) -> tuple:
  index, ops, known = args[0], list(args[1:]), fins[1:]
  branches = P.cond_branches(eqn)
  layouts, shapes = [], []
  for branch in branches:
    seen: dict = {}

    def traced(*xs, branch=branch, seen=seen):
      level = w.run(branch, xs, known)
      seen["layout"] = level.layout
      return level.record, _as_bool(level.any)

    shapes.append(jax.eval_shape(traced, *_structs(ops)))
    layouts.append(seen["layout"])
  if sum(layout.size for layout in layouts) == 0:
    return J.bind(eqn, args), jnp.zeros([0], jnp.int32), False, tuple(layouts)

  def make(b):
    def run(*xs):
      level = w.run(branches[b], xs, known)
      recs = [level.record if j == b else _zeros(shapes[j][0]) for j in range(len(branches))]
      flag = _init_like(_as_bool(level.any), shapes[b][1])
      for j in range(len(branches)):
        flag = _init_like(flag, shapes[j][1])
      return level.outs, _vector(recs), flag

    return run

  outs, rec, found = lax.switch(index, [make(b) for b in range(len(branches))], *ops)
  return list(outs), rec, found, tuple(layouts)


def _probe_shard_map(w: _Probe, eqn: Any, args: list, fins: list) -> tuple:
  del fins  # a finite array has finite shards, a non-finite one some finite shards
  p = P.shard_map(eqn)
  axes = _manual_axes(p)
  seen: dict = {}

  def body(*xs):
    outer, w.axes = w.axes, (*w.axes, *axes)
    try:
      level = w.run(p.body, xs)
    finally:
      w.axes = outer
    seen["layout"] = level.layout
    # The device whose first origin comes first in the body (ties: the lowest index).
    here, position = _device(axes), level.first()
    best = lax.pmin(position, axes)
    mine = jnp.logical_and(_as_bool(level.any), position == best)
    first = lax.pmin(jnp.where(mine, here, _NO_DEVICE), axes)
    rec = _on_device(level.record, first, here, axes)
    return (*level.outs, jnp.where(first == _NO_DEVICE, -1, first), rec)

  n_out = len(eqn.outvars)
  out_specs = (*p.out_specs, PartitionSpec(), PartitionSpec())
  outs = jax.shard_map(body, mesh=p.mesh, in_specs=p.in_specs, out_specs=out_specs,
                       axis_names=p.axis_names, check_vma=p.check_vma)(*args)  # fmt: skip
  layout = seen["layout"]
  if layout.size == 0:
    return list(outs[:n_out]), jnp.zeros([0], jnp.int32), False, (layout,)
  device, rec = outs[n_out], outs[n_out + 1]
  return list(outs[:n_out]), _vector([device, rec]), device >= 0, (layout,)


_LOOPS: dict[str, Callable] = {
  "scan": _probe_scan, "while": _probe_while, "cond": _probe_cond, "shard_map": _probe_shard_map,
}  # fmt: skip


#: XLA's backend (LLVM) optimisation off for the two programs: the same HLO, so the same
#: arithmetic, compiled in about a third of the time on CPU (their run time is negligible).
#: (Any values: XLA takes an int here, where jax's annotation of compile says str or bool.)
FAST_COMPILE: dict[str, Any] = {
  "xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
}  # fmt: skip


def _compiled(program: Callable, *args: Any) -> Any:
  """``jax.jit(program)(*args)``, compiled with :data:`FAST_COMPILE` where XLA accepts it."""
  lowered = jax.jit(program).lower(*args)
  try:
    compiled = lowered.compile(compiler_options=FAST_COMPILE)
  except Exception as e:  # noqa: BLE001 - an XLA that does not know an option: compile as usual
    if "option" not in str(e).lower():
      raise
    compiled = lowered.compile()
  return compiled(*args)


class Probed(NamedTuple):
  layout: Layout
  record: np.ndarray
  outputs_finite: list[bool]
  inputs_finite: list[bool]  #: the jaxpr's constants, then its inputs
  has_half: bool  #: whether any value of the program is float16, bfloat16 or fp8


def probe(closed: Any, args: Sequence[Any]) -> Probed:
  """Runs ``closed`` (a closed jaxpr) on ``args`` as one compiled program recording its
  origins; its constants are arguments of that program, not constants compiled into it."""
  closed = J.closed(closed)
  seen: dict = {}

  def program(consts, args):
    interp = _Probe()
    level = interp.run(closed, args, consts=consts)
    seen["layout"], seen["half"] = level.layout, interp.half
    in_fin = [jnp.asarray(finite(x)) for x in (*consts, *args)]
    return level.record, [jnp.asarray(f) for f in level.finite], in_fin

  rec, out_fin, in_fin = jax.device_get(_compiled(program, list(closed.consts), list(args)))
  return Probed(seen["layout"], np.asarray(rec), [bool(f) for f in out_fin],
                [bool(f) for f in in_fin], seen["half"])


# ---------------------------------------------------------------- the capture


def _widen_value(x: Any) -> Any:
  """``x`` as float32 if it is a half-precision floating value (float16, bfloat16, fp8)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or not is_half(dtype):
    return x
  return x.astype(jnp.float32) if isinstance(x, jax.Array) else np.asarray(x, np.float32)


#: The scatters whose body is one binary operation, by primitive: ``lax``'s function traces its
#: body for the operands' dtype (what a widened run needs: float32).
_SCATTERS: dict[str, Callable] = {"scatter-add": lax.scatter_add, "scatter-sub": lax.scatter_sub,
                                  "scatter-mul": lax.scatter_mul, "scatter-min": lax.scatter_min,
                                  "scatter-max": lax.scatter_max}


class _Capture:
  """Evaluates jaxprs and returns the inputs of the equation at the end of a path (and the
  outputs of the equations ``extra`` of its level, after them).

  With ``widen``, every half-precision value (arguments, constants, literals, results) is
  float32 instead: a cast to float16 is a cast to float32, a matmul's preferred type float32,
  a ``reduce_precision`` to float16's bits a no-op (:func:`P.float32_params`), and loops and
  calls are evaluated by this interpreter so that their bodies are widened too. With
  ``keep``, the outputs of the equations ``keep`` accepts, outside loops (calls inlined), are
  appended to ``kept`` as ``(equation, outputs)``.
  """

  def __init__(self, n_held: int, widen: bool = False, extra: Sequence[int] = (),
               keep: Callable[[Any], bool] | None = None, wide_scatters: bool = False):
    self.n_held = n_held  #: the origin's inputs that are not literals, and the extra outputs
    self.widen, self.extra, self.keep = widen, tuple(extra), keep
    #: with ``widen``, a scatter (``scatter-add``, ...: an indexing's gradient) in float32, by
    #: ``lax``'s own function with the equation's parameters, rather than in its half dtype
    self.wide_scatters = wide_scatters
    self.kept: list = []
    self.loops = 0  #: how many loop bodies the evaluation is inside
    self.calls: list = []  #: the call equations the evaluation is inside, outermost first
    #: the primitives with a body of their own (a scatter-add's update function, a custom
    #: reduction) computed in their half dtype even when widening, and those equations with
    #: the calls around them: only those that have a half-precision input (others are float32
    #: as they are)
    self.narrow: set[str] = set()
    self.narrowed: list[tuple[Any, tuple]] = []

  def _read(self, v: Any, env: dict) -> Any:
    x = J.read_literal(v, env)
    return _widen_value(x) if self.widen and J.is_literal(v) else x

  def _eval(self, eqn: Any, ins: list) -> list:
    """``eqn`` evaluated on ``ins``: bound as it is, or by this interpreter when widening or
    keeping values."""
    body = P.inline_body(eqn)
    if body is not None and (self.widen or self.keep is not None):
      self.calls.append(eqn)
      try:
        return self.run(body, ins, [])[0]
      finally:
        self.calls.pop()
    name = eqn.primitive.name
    if not self.widen:
      outs = J.bind(eqn, ins)
    elif name in ("scan", "while", "cond", "shard_map"):
      self.loops += 1
      try:
        if name == "scan":
          outs = self._scan(eqn, ins, None, [])[0]
        elif name == "while":
          outs = self._while(eqn, ins, None, [])[0]
        elif name == "cond":
          outs = self._cond(eqn, ins, None, [])[0]
        else:
          outs = self._shard_map(eqn, ins, None, [])[0]
      finally:
        self.loops -= 1
    elif J.has_sub_jaxprs(eqn):  # its body is typed for its dtypes: compute it in them
      like = [getattr(v.aval, "dtype", None) for v in eqn.invars]
      if self.wide_scatters and name in _SCATTERS:
        p = eqn.params
        outs = [_SCATTERS[name](*ins, p["dimension_numbers"], mode=p["mode"],
                                indices_are_sorted=p["indices_are_sorted"],
                                unique_indices=p["unique_indices"])]  # fmt: skip
      else:
        if any(d is not None and is_half(d) for d in like):
          self.narrow.add(name)
          self.narrowed.append((eqn, tuple(self.calls)))
        narrow = [x.astype(d) if d is not None and is_half(d) else x
                  for x, d in zip(ins, like, strict=True)]  # fmt: skip
        outs = [_widen_value(o) for o in J.bind(eqn, narrow)]
    else:
      outs = J.bind(eqn, ins, P.float32_params(eqn))
    if self.keep is not None and not self.loops and self.keep(eqn):
      self.kept.append((eqn, outs))
    return outs

  def eval_closed(self, closed: Any, args: Sequence[Any]) -> list:
    return self.run(closed, args, [])[0]

  def run(self, closed: Any, args: Sequence[Any], path: Sequence[Step],
          consts: Sequence[Any] | None = None) -> tuple[list, list]:
    closed = J.closed(closed)
    jaxpr = closed.jaxpr
    consts = closed.consts if consts is None else consts
    if self.widen:
      consts, args = [_widen_value(x) for x in consts], [_widen_value(x) for x in args]
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    step, rest = (path[0], path[1:]) if path else (None, [])
    captured: list = []
    extra: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
      ins = [self._read(v, env) for v in eqn.invars]
      if step is None or i != step.index:
        outs = self._eval(eqn, ins)
        if step is not None and step.kind == "op" and i in self.extra:
          extra[i] = outs
      elif step.kind == "op":
        captured = [x for x, v in zip(ins, eqn.invars, strict=True) if not J.is_literal(v)]
        outs = self._eval(eqn, ins)
      elif step.kind == "call":
        outs, captured = self.run(P.inline_body(eqn), ins, rest)
      elif step.kind == "scan":
        outs, captured = self._scan(eqn, ins, step.at, rest)
      elif step.kind.startswith("while"):
        outs, captured = self._while(eqn, ins, step, rest)
      elif step.kind == "cond":
        outs, captured = self._cond(eqn, ins, step.at, rest)
      else:
        outs, captured = self._shard_map(eqn, ins, step.at, rest)
      env.update(zip(eqn.outvars, outs, strict=True))
    for i in self.extra if step is not None and step.kind == "op" else ():
      captured = [*captured, *extra[i]]
    return [self._read(v, env) for v in jaxpr.outvars], captured

  def _scan(self, eqn, args, at, rest):
    p = P.scan(eqn)
    consts, init, xs = args[: p.num_consts], args[p.num_consts :][: p.num_carry], args[
      p.num_consts + p.num_carry :]
    n = p.num_carry
    if self.widen:
      consts, init, xs = ([_widen_value(x) for x in part] for part in (consts, init, xs))
    raw = lambda carry, row: self.run(p.body, [*consts, *carry, *row], rest)  # noqa: E731
    like = jax.eval_shape(raw, _structs(init), [T.row_struct(x) for x in xs])[1]

    def body(state, x):
      carry, held = state
      row, index = x
      outs, now = raw(carry, row)
      held = [jnp.where(index == at, a, b) for a, b in zip(now, held, strict=True)]
      return (outs[:n], held), outs[n:]

    index = jnp.arange(p.length, dtype=jnp.int32)
    (carry, held), ys = lax.scan(body, (list(init), [_zeros(s) for s in like]),
                                 (list(xs), index), length=p.length, reverse=p.reverse,
                                 unroll=p.unroll)  # fmt: skip
    return [*carry, *ys], held

  def _while(self, eqn, args, step, rest):
    p = P.while_loop(eqn)
    nc, nb = p.cond_nconsts, p.body_nconsts
    if self.widen:
      args = [_widen_value(x) for x in args]
    cconsts, bconsts, init = args[:nc], args[nc : nc + nb], list(args[nc + nb :])
    if step is not None and step.kind == "while_cond0":
      return self._while(eqn, args, None, [])[0], self.run(p.cond, [*cconsts, *init], rest)[1]
    in_body = step is None or step.kind == "while_body"

    def iteration(carry):
      if in_body:
        return self.run(p.body, [*bconsts, *carry], rest)
      outs = self.eval_closed(p.body, [*bconsts, *carry])
      return outs, self.run(p.cond, [*cconsts, *outs], rest)[1]

    like = jax.eval_shape(lambda c: iteration(c)[1], _structs(init))
    at = None if step is None else step.at

    def body_fun(state):
      carry, count, held = state
      outs, now = iteration(carry)
      held = [jnp.where(count == at, a, b) for a, b in zip(now, held, strict=True)]
      return outs, count + 1, held

    def cond_fun(state):
      return self.eval_closed(p.cond, [*cconsts, *state[0]])[0]

    outs, _, held = lax.while_loop(cond_fun, body_fun,
                                   (init, jnp.int32(0), [_zeros(s) for s in like]))
    return list(outs), held

  def _cond(self, eqn, args, at, rest):
    index, ops = args[0], list(args[1:])
    if self.widen:
      ops = [_widen_value(x) for x in ops]
    branches = P.cond_branches(eqn)
    target = lambda *xs: self.run(branches[at], xs, rest)  # noqa: E731
    like = jax.eval_shape(target, *_structs(ops))[1] if at is not None else []

    def make(b):
      if b == at:
        return target
      return lambda *xs: (self.eval_closed(branches[b], xs), [_zeros(s) for s in like])

    outs, held = lax.switch(index, [make(b) for b in range(len(branches))], *ops)
    return list(outs), held

  def _shard_map(self, eqn, args, at, rest):
    p = P.shard_map(eqn)
    axes = _manual_axes(p)
    n_held = self.n_held if rest else 0
    if self.widen:
      args = [_widen_value(x) for x in args]

    def body(*xs):
      outs, held = self.run(p.body, xs, rest)
      here = _device(axes)
      return (*outs, *[_on_device(h, at, here, axes) for h in held])

    n_out = len(eqn.outvars)
    out_specs = (*p.out_specs, *([PartitionSpec()] * n_held))
    outs = jax.shard_map(body, mesh=p.mesh, in_specs=p.in_specs, out_specs=out_specs,
                         axis_names=p.axis_names, check_vma=p.check_vma)(*args)  # fmt: skip
    return list(outs[:n_out]), list(outs[n_out:])


class Request(NamedTuple):
  """What :func:`capture_many` fetches: the inputs of ``origin``, the equation at the end of
  ``path`` in ``closed`` run on ``args``, and the outputs of the equations ``extra`` of its
  level; with ``widen``, every half-precision value computed in float32."""

  closed: Any
  args: Sequence[Any]
  origin: Any
  path: Sequence[Step]
  widen: bool = False
  extra: Sequence[int] = ()


def capture_many(requests: Sequence[Request]) -> list[tuple[list, set[str]]]:
  """Each request's values (the origin's inputs, literals left out, then the extra outputs)
  and the primitives that stayed in half precision in it, all from one compiled run."""
  closed = [J.closed(r.closed) for r in requests]
  counts = []
  for r, c in zip(requests, closed, strict=True):
    level = level_of(c, r.path)
    counts.append(sum(not J.is_literal(v) for v in r.origin.invars)
                  + sum(len(level.eqns[i].outvars) for i in r.extra))  # fmt: skip
  narrow: list[set[str]] = [set() for _ in requests]

  def program(all_consts, all_args):
    out = []
    for k, (r, c) in enumerate(zip(requests, closed, strict=True)):
      interp = _Capture(counts[k], r.widen, r.extra)
      out.append(interp.run(c, all_args[k], r.path, all_consts[k])[1])
      narrow[k] = set(interp.narrow)
    return out

  held = jax.device_get(_compiled(program, [list(c.consts) for c in closed],
                                  [list(r.args) for r in requests]))  # fmt: skip
  return list(zip(held, narrow, strict=True))


def capture(closed: Any, args: Sequence[Any], origin: Any, path: Sequence[Step]) -> list:
  """The inputs (literals left out) of ``origin``, the equation at the end of ``path``, from one
  compiled run of ``closed`` on ``args``."""
  return capture_many([Request(closed, args, origin, path)])[0][0]


def evaluate(programs: Sequence[tuple[Any, Sequence[Any], Callable[[Any], bool]]],
             widen: bool) -> tuple[list[tuple[list, list]], list[tuple[Any, tuple]]]:
  """Each ``(closed, args, keep)`` of ``programs`` evaluated, all in one compiled run (with
  ``widen``, every half-precision value in float32, scatters included): for each, its outputs
  and the outputs of the equations ``keep`` accepts outside loops (calls inlined), in program
  order; and the equations that stayed in half precision (a body of their own other than a
  scatter's: :class:`_Capture`), each with the call equations around it."""
  programs = [(J.closed(c), list(a), k) for c, a, k in programs]
  narrowed: list[tuple[Any, tuple]] = []

  def program(all_consts, all_args):
    results = []
    for (closed, _, keep), consts, args in zip(programs, all_consts, all_args, strict=True):
      interp = _Capture(0, widen, keep=keep, wide_scatters=True)
      outs = interp.run(closed, args, [], consts)[0]
      results.append((outs, [o for _, o in interp.kept]))
      narrowed.extend(interp.narrowed)
    return results

  results = jax.device_get(_compiled(program, [list(c.consts) for c, _, _ in programs],
                                     [a for _, a, _ in programs]))  # fmt: skip
  return results, narrowed


def sub_jaxpr(eqn: Any, step: Step) -> Any:
  """The closed body ``step`` enters at ``eqn`` (a call, a loop's body or condition, a
  branch, a shard_map's body)."""
  if step.kind == "call":
    return P.inline_body(eqn)
  if step.kind == "scan":
    return P.scan(eqn).body
  if step.kind == "while_body":
    return P.while_loop(eqn).body
  if step.kind in ("while_cond0", "while_cond"):
    return P.while_loop(eqn).cond
  if step.kind == "cond":
    assert step.at is not None, "a cond step names its branch"
    return P.cond_branches(eqn)[step.at]
  return P.shard_map(eqn).body


def level_of(closed: Any, path: Sequence[Step]) -> Any:
  """The (open) jaxpr holding the equation at the end of ``path``."""
  jaxpr = J.closed(closed).jaxpr
  for step in path[:-1]:
    jaxpr = J.closed(sub_jaxpr(jaxpr.eqns[step.index], step)).jaxpr
  return jaxpr
