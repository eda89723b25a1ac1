"""Which operation, on which line of my code, made the first inf or NaN, and is it float16's fault?

:func:`find_nonfinite` traces the function, runs it as one compiled program that flags every
operation whose output holds inf or NaN while its inputs are finite (:mod:`._walk`), then, in
a second compiled run, fetches the inputs of the first one. That operation is then run again
alone, as it ran and in float32, which gives the verdict: float16's range, or a bug.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_scaler import _validation as validation
from jmp_scaler._leaves import is_half
from jmp_scaler.diagnostics import _call as C
from jmp_scaler.diagnostics import _upstream as U
from jmp_scaler.diagnostics import _walk as W
from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _primitives as P
from jmp_scaler.jaxcompat import _source as S
from jmp_scaler.jaxcompat import _types as T
from jmp_scaler.precision._autocast import AUTOCAST_MARK, FULL_PRECISION_MARK
from jmp_scaler.precision._rules import DEFAULT_RULES

#: Primitives that have no real value for some inputs (NaN in any precision).
_DOMAIN = {"log": 0.0, "sqrt": 0.0, "rsqrt": 0.0, "log1p": -1.0, "pow": 0.0, "acosh": 1.0}


# ---------------------------------------------------------------- the report


@dataclasses.dataclass(frozen=True)
class ValueInfo:
  """An input or output of the operation: dtype, shape, largest finite magnitude, and how many
  elements are NaN and inf (None where the operation could not be run again)."""

  dtype: str
  shape: tuple[int, ...]
  max_abs: float
  nan: int | None = 0
  inf: int | None = 0

  @classmethod
  def of(cls, x: Any) -> ValueInfo:
    a = np.asarray(x)
    if not _inexact(a.dtype):
      big = float(np.max(np.abs(a))) if a.size and a.dtype.kind in "iu" else float("nan")
      return cls(str(a.dtype), a.shape, big)
    wide = _wide(a)
    ok = np.isfinite(wide)
    big = float(np.max(np.abs(wide[ok]))) if ok.any() else float("nan")
    return cls(str(a.dtype), a.shape, big, int(np.isnan(wide).sum()), int(np.isinf(wide).sum()))

  def __str__(self) -> str:
    big = "-" if math.isnan(self.max_abs) else f"{self.max_abs:.4g}"
    text = f"{self.dtype}[{','.join(map(str, self.shape))}] max|x| {big}"
    if self.nan or self.inf:
      text += f" ({self.inf} inf, {self.nan} NaN of {math.prod(self.shape)})"
    return text


@dataclasses.dataclass(frozen=True)
class NonFiniteOp:
  """The first operation that made an inf or a NaN, as :func:`find_nonfinite` found it.

  ``print(report)`` shows all of it with a next step; the fields are there for programs.

  Attributes:
    phase: ``"forward"``, or ``"backward"`` (the gradient of ``fn(...) * scale``).
    primitive: the JAX primitive (``"dot_general"``, ``"exp"``, ``"convert_element_type"``).
    source: ``"path/to/file.py:LINE (function)"``: the first frame outside jax, flax, optax,
      equinox and jmp_scaler (for a backward operation, the forward operation it
      differentiates; inside a library's jitted function, the line that called it).
    finite_in_float32: whether the same operation on the same inputs gives a finite result
      with its half-precision inputs and result widened to float32 (a float16 range problem,
      not a bug of the model); None when it cannot be run again alone (``note`` says why).
    inputs: each non-literal input's :class:`ValueInfo` (all finite, by definition).
    outputs: each output's :class:`ValueInfo`, with its inf and NaN counts.
    first_index: the index of the first non-finite element of the first non-finite output.
    float32_max_abs: the largest magnitude of the float32 result (nan if it holds none).
    where: the calls, loop iterations, branches and devices around it, outermost first.
    autocast: the policy of the ``jmp_scaler.autocast`` function it runs in, or None.
    full_precision: whether it runs in a ``jmp_scaler.full_precision`` region.
    scale: the scale of the backward pass, or None.
    frames: every frame of its traceback outside those packages, innermost first.
    advice: the concrete next step.
    note: anything that qualifies the verdict (empty when nothing does).
    fn_finite_in_float32: whether the same *function* is finite there in float32: ``fn`` run
      again with every half-precision value widened to float32 (float16 and bfloat16
      arguments, constants, casts, an autocast policy's compute dtype, an optimizer's ``eps``)
      gives this operation a finite result. Asked when the operation alone is not finite in
      float32 and ``fn`` computes anything in half precision; False for a function that is
      float32 throughout; None when not asked (the operation alone is finite in float32: a
      range problem) or when it could not be run (``note`` says why).
    upstream: where the two verdicts differ, the upstream operation whose half-precision
      rounding made this operation's input (a value underflowed to 0, a constant rounded to
      0, a value clipped), with its line; else "".
  """

  phase: str
  primitive: str
  source: str
  finite_in_float32: bool | None
  inputs: tuple[ValueInfo, ...]
  outputs: tuple[ValueInfo, ...]
  first_index: tuple[int, ...] | None
  float32_max_abs: float | None
  where: tuple[str, ...]
  autocast: str | None
  full_precision: bool
  scale: float | None
  frames: tuple[str, ...]
  advice: str
  note: str = ""
  fn_finite_in_float32: bool | None = None
  upstream: str = ""

  def __str__(self) -> str:
    bad = next((o for o in self.outputs if o.nan or o.inf), self.outputs[0] if self.outputs
               else None)  # fmt: skip
    at = f", first at {list(self.first_index)}" if self.first_index is not None else ""
    scale = f" at scale {self.scale:g}" if self.phase == "backward" else ""
    lines = [
      f"find_nonfinite: the first inf/NaN is made in the {self.phase} pass{scale} by",
      f"  {self.primitive} at {self.source}",
      f"  inputs   {';  '.join(map(str, self.inputs)) or '(constants only)'}",
    ]
    if bad is not None:
      lines.append(f"  output   {bad}{at}")
    if self.where:
      lines.append(f"  inside   {' > '.join(self.where)}")
    lines.append(f"  float32  {_verdict(self)}")
    if self.upstream:
      lines.append(f"  upstream {self.upstream}")
    if self.note:
      lines.append(f"  note     {self.note}")
    lines.append(f"  next     {self.advice}")
    return "\n".join(textwrap.fill(line, 100, subsequent_indent=" " * 11,
                                   break_on_hyphens=False, break_long_words=False)
                     for line in lines)  # fmt: skip


def _verdict(r: NonFiniteOp) -> str:
  if r.finite_in_float32 is None:
    return "could not run it again alone (see the note)"
  if r.finite_in_float32:
    return (f"finite (largest magnitude {r.float32_max_abs:.4g}): "
            f"a {_narrow(r)} range problem, not a bug in the model")  # fmt: skip
  if r.fn_finite_in_float32:
    return ("the operation alone is not finite in float32 on these inputs, but the whole "
            "function run in float32 is: half-precision rounding upstream made its input")
  if r.fn_finite_in_float32 is False:
    return "not finite either, nor is the whole function run in float32: not a matter of precision"
  return "not finite either: not a matter of precision"


# ---------------------------------------------------------------- the public function


def find_nonfinite(fn: Callable[..., Any], *args: Any, scale: Any = None,
                   **kwargs: Any) -> NonFiniteOp | None:  # fmt: skip
  """Finds the first operation of ``fn(*args, **kwargs)`` that makes an inf or a NaN.

  Runs ``fn`` operation by operation and returns the first operation whose output holds inf
  or NaN while all its inputs are finite, with the line of your code it comes from and
  whether float32 would have been finite. If the forward pass is finite and ``scale`` is
  given, does the same for the backward pass of ``fn(...) * scale`` (the loss multiplied in
  float32, as :func:`jmp_scaler.value_and_grad` does) with respect to the floating leaves of
  the first argument (an NNX module's ``nnx.Param`` leaves): the gradients the loss scaler
  would see. Returns None when nothing is non-finite.

  It runs the whole function as one compiled program that flags every operation (one
  reduction per value), the loss and its gradient as one more when ``scale`` is given, then
  a last one that fetches the inputs of the first flagged operation: about what compiling a
  training step costs, not an operation-by-operation run. When that operation is not finite
  in float32 either, on the inputs it had, and ``fn`` computes anything in half precision, one
  more compiled run evaluates ``fn`` with every half-precision value in float32
  (``fn_finite_in_float32``) and names the upstream operation whose rounding broke the input
  (``upstream``: a probability that underflowed before a ``log``, optax's ``eps`` that is 0 in
  float16). It sees through ``jit``,
  ``custom_jvp``/``custom_vjp``, ``remat``, ``scan``/``while_loop``/``cond`` (naming the
  iteration and the branch) and ``shard_map`` (naming the device), and through
  :func:`jmp_scaler.autocast`: an autocast function is analysed as it runs, float16 casts
  included. ``fn`` may be a function, a flax ``model.apply``, an NNX module or an equinox
  module.

  Args:
    fn: the function, for example a loss function or ``model.apply``.
    *args: its positional arguments. Array leaves are traced; every other leaf (Python
      numbers, strings, a policy) is static, as under ``jax.jit``.
    scale: the loss scale of the backward pass (``jmp_scaler.get_scale(opt_state)``); None
      analyses the forward pass only. ``fn`` must then return a scalar.
    **kwargs: its keyword arguments (``scale`` is this function's own).

  Returns:
    A :class:`NonFiniteOp` (``print`` it), or None if every value of the forward pass (and,
    with ``scale``, of the backward pass) is finite.

  Raises:
    ValueError: if ``fn`` is not callable; if ``scale`` is not a positive number in
      float32's normal range, or ``fn`` does not return a floating scalar when it is given;
      if an argument (or an array ``fn`` closes over) already holds inf or NaN and no
      operation made one.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> def loss(w, x):
    ...   return jnp.sum(x.astype(jnp.float16) @ w.astype(jnp.float16))
    >>> w, x = jnp.full((4, 4), 300.0), jnp.full((2, 4), 100.0)  # 4 * 300 * 100 > 65504
    >>> report = jmp_scaler.find_nonfinite(loss, w, x)
    >>> report.phase, report.primitive, report.finite_in_float32
    ('forward', 'dot_general', True)
    >>> print(report)  # doctest: +ELLIPSIS
    find_nonfinite: the first inf/NaN is made in the forward pass by
      dot_general at ...
    >>> jmp_scaler.find_nonfinite(loss, w / 300, x / 100, scale=2.0**10) is None
    True
  """
  if not callable(fn):
    raise ValueError(f"fn must be callable, got {fn!r}")
  scale = _check_scale(scale)
  call = C.Call(fn, args, kwargs)
  if any(T.is_traced(x) for x in call.dynamic):
    raise ValueError("find_nonfinite runs on the host, on concrete arrays: call it outside "
                     "jax.jit (and grad, vmap, ...), with the batch and parameters of the step")
  closed, shape = jax.make_jaxpr(call.flat, return_shape=True)(*call.dynamic)
  wide = [_widen(x) for x in call.dynamic]
  forward = _Search(closed, call.dynamic, call.names,
                    lambda: (jax.make_jaxpr(call.flat)(*wide), wide))
  if scale is None:
    return forward.report("forward", None)
  _check_loss(shape)
  # One compiled run of the loss and its gradient. Its first origin is a backward one when a
  # transposition holds it; any other is in the forward part of the program (a forward
  # operation, or a factor of a derivative): the forward pass alone tells which.
  diff, other = call.split_first()
  grad = jax.make_jaxpr(jax.value_and_grad(call.scaled(scale)))(diff, other)
  wdiff, wother = [_widen(x) for x in diff], [_widen(x) for x in other]
  backward = _Search(grad, [*diff, *other], [call.names[i] for i in (*call.first, *call.rest)],
                     lambda: (jax.make_jaxpr(jax.value_and_grad(call.scaled(scale)))(
                       wdiff, wother), [*wdiff, *wother]))
  if backward.path is None:
    return backward.report("backward", scale)  # None, or the inputs' error
  if not any("transpose(" in S.name_stack(e) for e in backward.eqns):
    found = forward.report("forward", None)
    if found is not None:
      return found
  return backward.report("backward", scale)


def _check_scale(scale: Any) -> float | None:
  """``scale`` as the float32 the scaler would hold: positive, finite, in float32's range."""
  return None if scale is None else validation.positive_f32("scale", scale)


def _check_loss(shape: Any) -> None:
  leaves = jax.tree.leaves(shape)
  if len(leaves) != 1 or leaves[0].shape != () or not jnp.issubdtype(leaves[0].dtype,
                                                                      jnp.floating):
    got = jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", shape)
    raise ValueError(
      f"with scale, fn must return a floating scalar loss (the backward pass is that of "
      f"loss * scale), got {got}; for (loss, aux) pass lambda *a: fn(*a)[0]")


# ---------------------------------------------------------------- arguments


# ---------------------------------------------------------------- the search


class _Search:
  """A jaxpr's first origin (:mod:`._walk`), found lazily by one compiled run."""

  def __init__(self, closed: Any, args: list, names: list[str],
               retrace: Callable[[], tuple[Any, list]] | None = None):
    self.closed, self.args, self.names = closed, args, names
    self.retrace = retrace  #: the same program traced on the arguments widened to float32

  @functools.cached_property
  def probed(self) -> W.Probed:
    return W.probe(self.closed, self.args)

  @functools.cached_property
  def path(self) -> list | None:
    return W.first_origin(self.probed.layout, self.probed.record)

  @functools.cached_property
  def eqns(self) -> list:
    """The equations along :attr:`path` (read only where an origin was found)."""
    path = self.path
    assert path is not None, "no origin: no equations along its path"
    return W.equations(self.probed.layout, path)

  def report(self, phase: str, scale: float | None) -> NonFiniteOp | None:
    """The origin's report, None if every value is finite; raises ValueError if an output is
    not finite while no operation made it (it came with the inputs)."""
    path = self.path
    if path is None:
      if all(self.probed.outputs_finite):
        return None
      n_consts = len(J.closed(self.closed).consts)
      bad = [self.names[i - n_consts] if i >= n_consts else "an array fn closes over"
             for i, ok in enumerate(self.probed.inputs_finite) if not ok]  # fmt: skip
      what = "result" if phase == "forward" or not self.probed.outputs_finite[0] else "gradient"
      if not bad and (constant := _nonfinite_constant(J.closed(self.closed))):
        raise ValueError(f"fn's {what} holds inf/NaN, but no operation made it: {constant}")
      raise ValueError(
        f"fn's {what} holds inf/NaN, but no operation made it: it was in the inputs already "
        f"({', '.join(bad) or 'none found'}). Check the data (jmp_scaler.nonfinite_report) and "
        "the previous step.")
    held = W.capture(self.closed, self.args, self.eqns[-1], path)
    report = _report(phase, self.eqns, path, held, scale)
    if report.finite_in_float32 is True:
      return report  # a range problem: nothing upstream to blame
    if not self.probed.has_half:
      return dataclasses.replace(report, fn_finite_in_float32=False)
    if self.retrace is None:
      return report
    it = iter(held)
    made, _ = _run(self.eqns[-1], [np.asarray(v.val) if J.is_literal(v) else next(it)
                                   for v in self.eqns[-1].invars], widen=False)  # fmt: skip
    bad_mask = next((~np.isfinite(_wide(o)) for o in made or () if not W.host_finite(o)),
                    np.ones((), bool))  # fmt: skip
    return self._function_verdict(report, path, bad_mask)

  def _function_verdict(self, report: NonFiniteOp, path: list, bad: np.ndarray) -> NonFiniteOp:
    """``report`` with the verdict about the whole function in float32 and the upstream
    culprit where the verdicts differ (:mod:`._upstream`): one more compiled run, which
    evaluates ``fn`` as it ran and widened, fetching the origin's ancestors in both."""
    assert self.retrace is not None, "report() calls this only with a retrace"
    level = W.level_of(self.closed, path)
    extra = U.ancestors(level, path[-1].index)
    try:
      closed_b, args_b = self.retrace()
      path_b, mapped = U.match(self.closed, path, closed_b, extra)
      level_b = W.level_of(closed_b, path_b)
      origin_b = level_b.eqns[path_b[-1].index]
      extra_b = sorted(set(mapped.values()))
      (as_ran, _), (held, narrow) = W.capture_many([
        W.Request(self.closed, self.args, self.eqns[-1], path, extra=extra),
        W.Request(closed_b, args_b, origin_b, path_b, widen=True, extra=extra_b)])
      half = _split_outputs(level, extra, as_ran[sum(not J.is_literal(v)
                                                     for v in self.eqns[-1].invars):])
      n_in = sum(not J.is_literal(v) for v in origin_b.invars)
      it = iter(held[:n_in])
      inputs = [np.asarray(v.val) if J.is_literal(v) else next(it) for v in origin_b.invars]
      outs, why = _run(origin_b, inputs, widen=True)
      if outs is None:
        raise RuntimeError(why)
    except Exception as e:  # noqa: BLE001 - any failure is reported in the note, never hidden
      first = str(e).splitlines()[0] if str(e) else ""
      note = (f"the whole function could not be run again in float32 ({type(e).__name__}: "
              f"{first}), so whether float16's rounding upstream made this input is unknown")
      return dataclasses.replace(report, note="; ".join(filter(None, [report.note, note])))
    if narrow:
      note = (f"in the float32 run, {', '.join(sorted(narrow))} stayed in half precision (an "
              "operation with a body of its own)")
      report = dataclasses.replace(report, note="; ".join(filter(None, [report.note, note])))
    if not all(W.host_finite(o) for o in outs):
      return dataclasses.replace(report, fn_finite_in_float32=False)
    wide = _split_outputs(level_b, extra_b, held[n_in:])
    culprit = U.find_culprit(level, level_b, extra, mapped, half, wide,
                             (path[-1].index, path_b[-1].index), bad)  # fmt: skip
    if culprit is None:
      advice = (f"the same function in float32 is finite: half-precision rounding upstream made "
                f"this {report.primitive}'s input, in an operation find_nonfinite could not "
                f"name. Compute the code before {report.source} in float32, or run "
                "jmp_scaler.compare_precision to see where the two runs part")  # fmt: skip
      return dataclasses.replace(report, fn_finite_in_float32=True, advice=advice)
    found = C.user_lines(culprit.eqn)
    where = found[0] if found else report.source
    # A culprit without a line of the user's is inside the library function around the origin.
    inside = next((w[len("jit "):] for w in reversed(report.where) if w.startswith("jit ")
                   and not found), None)  # fmt: skip
    if inside is not None:
      culprit = dataclasses.replace(culprit, name=f"{culprit.name} inside {inside}")
    advice = U.culprit_advice(culprit, where, report.primitive, report.phase, report.scale,
                              "transpose(" in S.name_stack(culprit.eqn),
                              report.autocast, inside)  # fmt: skip
    return dataclasses.replace(report, fn_finite_in_float32=True, advice=advice,
                               upstream=f"{culprit.name} at {where}: {culprit.detail}")


def _split_outputs(level: Any, indices: list, values: list) -> dict[int, list]:
  """The captured outputs ``values`` of the equations ``indices`` of ``level``, by index."""
  it = iter(values)
  return {i: [next(it) for _ in level.eqns[i].outvars] for i in indices}


def _widen(x: Any) -> Any:
  """A half-precision array as float32, anything else as it is."""
  return jnp.asarray(x, jnp.float32) if is_half(np.asarray(x).dtype) else x


def _report(phase: str, eqns: list, path: list, held: list, scale: float | None) -> NonFiniteOp:
  eqn = eqns[-1]
  it = iter(held)
  inputs = [np.asarray(v.val) if J.is_literal(v) else np.asarray(next(it)) for v in eqn.invars]
  notes = []
  if J.has_sub_jaxprs(eqn):
    notes.append(f"{eqn.primitive.name} has a body find_nonfinite cannot open: it is reported "
                 "as one operation")
  outs, why = _run(eqn, inputs, widen=False)
  if outs is None:
    outputs = tuple(ValueInfo(str(v.aval.dtype), tuple(v.aval.shape), float("nan"), None, None)
                    for v in eqn.outvars)  # fmt: skip
    first_index, bad = None, None
    notes.append(f"it could not be run again alone ({why})")
  else:
    outputs = tuple(ValueInfo.of(o) for o in outs)
    bad = next((o for o in outs if not W.host_finite(o)), None)
    first_index = None if bad is None else tuple(
      int(i) for i in np.argwhere(~np.isfinite(_wide(bad)))[0])
    if bad is None:
      notes.append("alone it gives a finite result: in the compiled program XLA computed it "
                   "differently (fused with its neighbours), so float32 cannot be compared")
  wide, why32 = _run(eqn, inputs, widen=True) if outs is not None else (None, "")
  if wide is None or bad is None:
    finite32, max32 = None, None
    if wide is None and outs is not None:
      notes.append(f"it could not be run again in float32 ({why32})")
  else:
    finite32 = all(W.host_finite(o) for o in wide)
    sizes = [ValueInfo.of(o).max_abs for o in wide if np.asarray(o).size]
    max32 = max([m for m in sizes if not math.isnan(m)], default=float("nan"))
  where, policy, region = _context(eqns, path)
  frames = C.user_lines(eqn)
  if not frames:  # inside a library's jitted function: the line that called it
    frames = next((f for f in map(C.user_lines, reversed(eqns[:-1])) if f), [])
  in_scale = C.SCALE_SCOPE in S.name_stack(eqn)
  source = frames[0] if frames else _library_source(eqn)
  if in_scale:
    source = "the loss's cast to float32 before find_nonfinite's scale multiply"
  report = NonFiniteOp(
    phase=phase, primitive=eqn.primitive.name, source=source, finite_in_float32=finite32,
    inputs=tuple(ValueInfo.of(x) for x, v in zip(inputs, eqn.invars, strict=True)
                 if not J.is_literal(v)),
    outputs=outputs, first_index=first_index, float32_max_abs=max32, where=where,
    autocast=policy, full_precision=region, scale=scale, frames=tuple(frames),
    advice="", note="; ".join(notes),
  )  # fmt: skip
  # finite32 is False only where wide (the operation run in float32) is not None
  why = _why_float32_fails(report, inputs, wide) if finite32 is False and wide is not None else ""
  return dataclasses.replace(report, advice=_advice(report, why, in_scale))


def _inexact(dtype: Any) -> bool:
  """Floating or complex (bfloat16 and fp8 included: numpy calls their kind "V")."""
  return bool(jnp.issubdtype(dtype, jnp.inexact))


def _wide(x: Any) -> np.ndarray:
  """A floating ``x`` as float64 (complex128), for counting and measuring on the host."""
  a = np.asarray(x)
  return a.astype(np.complex128 if jnp.issubdtype(a.dtype, jnp.complexfloating) else np.float64)


def _run(eqn: Any, inputs: list, widen: bool) -> tuple[list | None, str]:
  """``eqn`` bound again, alone, on ``inputs`` (widened to float32): (outputs, "") or (None,
  why)."""
  try:
    params = P.float32_params(eqn) if widen else dict(eqn.params)
    args = [jnp.asarray(x, jnp.float32) if widen and is_half(np.asarray(x).dtype) else
            jnp.asarray(x) for x in inputs]  # fmt: skip
    return [np.asarray(o) for o in jax.device_get(J.bind(eqn, args, params))], ""
  except Exception as e:  # noqa: BLE001 - any failure is reported, never hidden
    return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _library_source(eqn: Any) -> str:
  """Where ``eqn`` comes from when no frame of the user's is around it (``fn`` is a library's
  layer, called directly): the first frame outside jax and jmp_scaler, or JAX's summary."""
  mine = [sys.modules[name] for name in ("jax", "jmp_scaler")]
  found = S.user_frames(eqn, mine)
  where = C.relative(str(found[0])) if found else S.summarize(eqn)
  return f"{where} (a library's line: fn calls no code of yours around it)"


def _context(eqns: list, path: list) -> tuple[tuple[str, ...], str | None, bool]:
  """The ``where`` strings, the autocast policy around the origin, and whether a
  full_precision region holds it."""
  where, policy, region = [], None, False
  for eqn, step in zip(eqns[:-1], path[:-1], strict=True):
    name = eqn.primitive.name
    if step.kind == "call":
      body = P.inline_body(eqn)
      if name in P.JIT_NAMES:
        label = P.jit_name(eqn)
        if label.startswith(AUTOCAST_MARK) and "]" in label:
          policy = label[len(AUTOCAST_MARK) + 1 : label.index("]")]
        region = region or label.startswith(FULL_PRECISION_MARK)
        where.append(f"jit {label}")
      else:
        func = J.function_name(body)
        where.append(f"{name} ({func})" if func else name)
    elif step.kind == "scan":
      p = P.scan(eqn)
      where.append(f"scan iteration {step.at} of {p.length}{', reversed' if p.reverse else ''}")
    elif step.kind == "while_cond0":
      where.append("while_loop condition, before the first iteration")
    elif step.kind == "while_body":
      where.append(f"while_loop iteration {step.at}")
    elif step.kind == "while_cond":
      where.append(f"while_loop condition after iteration {step.at}")
    elif step.kind == "cond":
      where.append(f"cond branch {step.at}")
    else:
      where.append(f"shard_map device {step.at} of {P.shard_map(eqn).mesh.size}")
  return tuple(where), policy, region


def _nonfinite_constant(closed: Any) -> str:
  """Where the traced function holds a non-finite half-precision constant (a literal or a
  closed-over array, in any body), with the fix; "" if it holds none.

  A float32 constant beyond float16's range (an attention mask of -2.38e38) written where the
  model computes in float16 (``jnp.asarray(K_MASK, x.dtype)``) is converted when the function
  is traced: the jaxpr holds ``-inf`` itself, and no operation makes it.
  """
  todo = [closed]
  while todo:
    c = J.closed(todo.pop())
    for x in c.consts:
      a = np.asarray(x)
      if is_half(a.dtype) and not np.isfinite(a.astype(np.float32)).all():
        return _constant_advice(str(a.dtype), "a constant array the function closes over",
                                None)
    for eqn in c.jaxpr.eqns:
      for v in eqn.invars:
        if not J.is_literal(v):
          continue
        a = np.asarray(v.val)
        if is_half(a.dtype) and not np.isfinite(a.astype(np.float32)).all():
          return _constant_advice(str(a.dtype), f"the constant {a.astype(np.float32)} "
                                  f"({a.dtype}) of the {P.jit_name(eqn) or eqn.primitive.name} "
                                  "call", eqn)  # fmt: skip
      todo.extend(J.jaxprs_in_params(eqn.params))
  return ""


def _constant_advice(dtype: str, what: str, eqn: Any) -> str:
  lines = C.user_lines(eqn) if eqn is not None else []
  at = f" at {lines[0]}" if lines else ""
  top = _largest(dtype)
  return (f"{what}{at} is infinite in {dtype}. A float32 constant past {dtype}'s largest "
          f"{top:g} (an attention mask value such as -2.38e38 or jnp.finfo(jnp.float32).min) "
          f"becomes inf when the function is traced in {dtype}; with it a fully masked row's "
          f"softmax is NaN. Write it as jnp.finfo(jnp.{dtype}).min ({-top:g}), or keep the model "
          "in float32 and run it under jmp_scaler.autocast, which saturates such constants at "
          f"{dtype}'s largest.")


# ---------------------------------------------------------------- the advice


def _narrow(r: NonFiniteOp) -> str:
  """The half dtype the operation ran in (its outputs', else its inputs'), or "float32"."""
  for info in (*r.outputs, *r.inputs):
    if info.dtype in ("float16", "bfloat16") or info.dtype.startswith("float8"):
      return info.dtype
  return "float32"


def _largest(dtype: str) -> float:
  try:
    return float(jnp.finfo(dtype).max)
  except (TypeError, ValueError):
    return float(jnp.finfo(jnp.float32).max)


def _why_float32_fails(r: NonFiniteOp, inputs: list, wide: list) -> str:
  """Why the operation is not finite in float32 either, when the inputs tell."""
  floats = [_wide(x) for x in inputs if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)
            and np.asarray(x).size]  # fmt: skip
  outs = [_wide(o) for o in wide if _inexact(np.asarray(o).dtype)]
  nan = any(np.isnan(o).any() for o in outs)
  inf = any(np.isinf(o).any() for o in outs)
  prim = r.primitive
  if not floats:
    return ""
  low, high = float(np.min(floats[0].real)), float(np.max(np.abs(floats[0])))
  if nan and prim in _DOMAIN and low < _DOMAIN[prim]:
    what = "a negative number" if _DOMAIN[prim] == 0.0 else f"a number below {_DOMAIN[prim]:g}"
    return f"{prim} of {what} (smallest input {low:.4g})"
  if nan and prim in ("asin", "acos", "atanh") and high > 1:
    return f"{prim} of a number outside [-1, 1] (largest magnitude {high:.4g})"
  if prim == "div" and len(floats) > 1 and (floats[1] == 0).any():
    return "division by zero"
  if inf and prim in ("log", "rsqrt") and (floats[0] == 0).any():
    return f"{prim} at zero"
  if inf and not nan:
    biggest = max(float(np.max(np.abs(f))) for f in floats)
    return f"the result passes float32's range too (largest input magnitude {biggest:.4g})"
  if nan:
    return "NaN in float32 too (0 * inf, inf - inf or 0 / 0 within it)"
  return ""


def _keep_in_float32(r: NonFiniteOp) -> str:
  prim, half = r.primitive, _narrow(r)
  if prim == "convert_element_type" and r.phase == "backward":
    return (f"keep the value cast at {r.source} in float32: its gradient, up to "
            f"{r.inputs[0].max_abs:.4g}, is cast back to {half} there")
  if r.autocast is not None and not r.full_precision:
    if prim == "convert_element_type":
      return (f"autocast ({r.autocast}) casts a value of magnitude up to "
              f"{r.inputs[0].max_abs:.4g} to {half} for the operation at {r.source}: wrap that "
              "code in jmp_scaler.full_precision, or scale the value down before it")
    rule = DEFAULT_RULES.get(prim, "promote")
    return (f"autocast ({r.autocast}) runs this {prim} in {half} (default rule {rule!r}): "
            f"keep it in float32 with jmp_scaler.autocast(fn, policy, rules={{{prim!r}: "
            f"'float32'}}) (every {prim}), or wrap the code at {r.source} in "
            "jmp_scaler.full_precision (this one)")
  if prim == "convert_element_type" and r.phase == "forward" and r.inputs and (
      not r.inputs[0].shape):
    return (f"the cast to {half} at {r.source} gets the scalar of magnitude "
            f"{r.inputs[0].max_abs:.4g}, past {half}'s largest {_largest(half):g}, which "
            f"{half} makes inf: a constant of your code (an attention mask value such as "
            f"-2.38e38 or jnp.finfo(jnp.float32).min, written for float32) must be {half}'s "
            f"own: write it as jnp.finfo(jnp.{half}).min ({-_largest(half):g}), or keep the "
            "model in float32 and run it under jmp_scaler.autocast, which saturates such "
            f"constants at {half}'s largest")
  if prim == "convert_element_type":
    return (f"the cast to {half} at {r.source} gets a value of magnitude "
            f"{r.inputs[0].max_abs:.4g}, past {half}'s largest {_largest(half):g}: rescale it "
            "before the cast (standardise the data, in float32), or keep it in float32")
  return (f"compute this {prim} in float32 at {r.source}: cast its inputs with "
          ".astype(jnp.float32) (a layer: dtype=jnp.float32), or scale its inputs down")


def _advice(r: NonFiniteOp, why: str, in_scale: bool) -> str:
  if r.finite_in_float32 is None:
    return (f"inspect the operation at {r.source} by hand: its inputs are in the report; "
            "find_nonfinite could not compare it with float32")
  if not r.finite_in_float32:
    guard = ("guard its forward input (jnp.where before the operation, the double-where "
             "trick), a clip or an epsilon" if r.phase == "backward" else
             "guard its input (jnp.where, a clip or an epsilon)")  # fmt: skip
    half = _narrow(r)
    not_this = f"not {half}'s range" if half != "float32" else "not a matter of precision"
    return (f"float32 fails too: a bug in the model or the data{': ' + why if why else ''}, "
            f"{not_this}. Fix the data, or {guard} at {r.source}")
  if r.phase == "backward" and in_scale and r.primitive == "convert_element_type":
    return (f"the loss is {_narrow(r)}: the gradient starts as the scale ({r.scale:g}) in "
            f"{_narrow(r)}, which overflows. Keep the loss in float32 (a policy with "
            "output=float32, or .astype(jnp.float32) before the loss's reduction)")
  if r.phase == "backward":
    assert r.scale is not None, "a backward pass has a scale"
    half = _narrow(r)
    ratio = r.scale * _largest(half) / max(r.float32_max_abs or 0.0, 1e-300)
    safe = 2.0 ** math.floor(math.log2(ratio)) if 0 < ratio < math.inf else 0.0
    if 0 < safe < r.scale:  # else the scale is not what overflowed: keep the op in float32
      return (f"a lower scale: at scale {r.scale:g} this gradient reaches "
              f"{r.float32_max_abs:.4g} in float32, past {half}'s largest "
              f"{_largest(half):g}; a scale of at most {safe:g} (2^{int(math.log2(safe))}) keeps "
              "it finite, and dynamic_scale backs off to it by itself (the step is skipped). "
              "If it keeps happening, " + _keep_in_float32(r))
  return _keep_in_float32(r)
