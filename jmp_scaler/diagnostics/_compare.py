"""Where does mixed precision hurt? A float32 baseline of the same function, layer by layer.

:func:`compare_precision` traces ``fn`` (under the policy, through :func:`jmp_scaler.autocast`,
or as it is) once: its forward pass and the gradient of ``fn(...) * scale``. That program is run
twice, each time as one compiled run (:func:`._walk.evaluate`): as it is, and with every
half-precision value computed in float32 (casts to float16 are casts to float32, the matmuls'
preferred type float32, a scatter-add's sums in float32). Both runs keep the output of each
layer's last operation, so the activations of the two runs are compared operation for
operation, and the gradients leaf for leaf.

A layer is a flax ``linen`` module path (its name scopes), an NNX or equinox attribute path
(their modules are given scopes of their own for the trace), else the line of the user's code
the operations come from.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_scaler import _validation as validation
from jmp_scaler._leaves import is_half
from jmp_scaler.diagnostics import _call as C
from jmp_scaler.diagnostics import _walk as W
from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _primitives as P
from jmp_scaler.jaxcompat import _source as S
from jmp_scaler.jaxcompat import _types as T
from jmp_scaler.precision._autocast import autocast
from jmp_scaler.precision._policy import Policy, get_policy

#: The prefix of the name scopes given to NNX and equinox modules (``jmp_layer:blocks.0.mlp``).
LAYER_MARK = "jmp_layer:"


# ---------------------------------------------------------------- the report


@dataclasses.dataclass(frozen=True)
class LayerError:
  """One layer's row of a :class:`PrecisionComparison`.

  Attributes:
    name: the module path (``Dense_0``, ``blocks.0.mlp``) or the source line.
    activation_error: the relative error (``|half - float32| / |float32|``, L2 norms) of the
      layer's output (its last operation's), inf if the half run's is not finite; None for
      a layer without a forward output (parameters only).
    dtype: the dtype of that output in the half run.
    gradient_error: the relative error of the gradient of the layer's parameters (all of
      them as one vector), the half run's gradient divided by the scale; None without any.
    underflow: the fraction of the float32 gradient's nonzero elements that are 0 once
      multiplied by the scale and cast to the half dtype; None without a gradient.
    size: the number of gradient elements.
  """

  name: str
  activation_error: float | None
  dtype: str
  gradient_error: float | None
  underflow: float | None
  size: int


@dataclasses.dataclass(frozen=True)
class PrecisionComparison:
  """What :func:`compare_precision` measured (``print`` it for the table).

  Attributes:
    layers: one :class:`LayerError` per layer, in forward order (layers with gradients but no
      output of their own last).
    jump: the first layer whose activation (or, failing that, gradient) error jumps: at least
      ``jump_factor`` times both the half dtype's rounding (its epsilon) and the largest error
      of the layers before it; None if no error jumps.
    loss, loss_half: the loss of the float32 run and of the half run.
    policy: the policy's string, or None (``fn`` run as given).
    dtype: the half dtype of the underflow column.
    scale: the loss scale of the half run's backward pass and of the underflow column.
    jump_factor: see ``jump``.
    note: what qualifies the baseline: the operations of the half run with a body of their own
      (a custom reduction) that the float32 run computes in their half dtype, each with the
      line it comes from; empty if none (a scatter, such as the gradient of an indexing or of
      an embedding lookup, is computed in float32).
  """

  layers: tuple[LayerError, ...]
  jump: str | None
  loss: float
  loss_half: float
  policy: str | None
  dtype: str
  scale: float
  jump_factor: float
  note: str = ""

  def layer(self, name: str) -> LayerError:
    """The row of layer ``name``; raises KeyError naming the layers if there is none."""
    for row in self.layers:
      if row.name == name:
        return row
    raise KeyError(f"no layer {name!r}; the layers are {[r.name for r in self.layers]}")

  def __str__(self) -> str:
    what = self.policy if self.policy is not None else "fn as given"
    loss_err = _relative(np.float64(self.loss_half), np.float64(self.loss))
    lines = [wrap_line(
      f"compare_precision: {what} against float32; loss {self.loss:.6g} vs {self.loss_half:.6g} "
      f"(relative error {fmt_error(loss_err)}), gradients at scale {self.scale:g}")]
    width = max([len("layer"), *(len(r.name) for r in self.layers)])
    lines.append(f"  {'layer':<{width}}  {'activation':>10}  {'gradient':>10}  "
                 f"{'underflow':>10}  dtype")  # fmt: skip
    for r in self.layers:
      under = "-" if r.underflow is None else f"{100 * r.underflow:.1f}%"
      mark = "  <- the error jumps here" if r.name == self.jump else ""
      lines.append(f"  {r.name:<{width}}  {fmt_error(r.activation_error):>10}  "
                   f"{fmt_error(r.gradient_error):>10}  {under:>10}  {r.dtype}{mark}")  # fmt: skip
    if self.jump is None:
      lines.append(wrap_line(f"no layer's error jumps (x{self.jump_factor:g} over {self.dtype}'s "
                         "rounding and the layers before it)"))  # fmt: skip
    else:
      row = self.layer(self.jump)
      kind, err = ("activation", row.activation_error) if _jumps_by(
        self, "activation_error") else ("gradient", row.gradient_error)
      lines.append(wrap_line(f"first jump: {self.jump} ({kind} error {fmt_error(err)}); underflow: "
                         f"the share of the float32 gradient that is 0 in {self.dtype} at scale "
                         f"{self.scale:g}"))  # fmt: skip
    if self.note:
      lines.append(wrap_line(f"note: {self.note}"))
    return "\n".join(lines)


def wrap_line(line: str) -> str:
  """``line`` wrapped at 100 columns, later lines indented: a report's paragraph."""
  return textwrap.fill(line, 100, subsequent_indent="  ", break_on_hyphens=False,
                       break_long_words=False)


def fmt_error(x: float | None) -> str:
  """A relative error for a report's table: ``-`` for none, ``inf/nan``, else ``1.23e-04``."""
  if x is None:
    return "-"
  if math.isinf(x) or math.isnan(x):
    return "inf/nan"
  return f"{x:.2e}"


def _relative(half: np.ndarray | np.floating, wide: np.ndarray | np.floating) -> float:
  h, w = np.asarray(half, np.float64).ravel(), np.asarray(wide, np.float64).ravel()
  if not np.all(np.isfinite(h)):
    return math.inf
  norm = float(np.linalg.norm(w))
  diff = float(np.linalg.norm(h - w))
  return diff / norm if norm > 0 else diff


# ---------------------------------------------------------------- layers


_SCOPED: dict[tuple[type, str], type] = {}


def _scoped_class(cls: type, path: str) -> type:
  """``cls`` with a ``__call__`` inside the name scope of ``path`` (one class per path)."""
  if (cls, path) not in _SCOPED:
    base_call = cls.__call__

    def __call__(self, *args, **kwargs):
      with jax.named_scope(LAYER_MARK + path):
        return base_call(self, *args, **kwargs)

    _SCOPED[cls, path] = type(cls.__name__, (cls,), {"__call__": __call__,
                                                     "__module__": cls.__module__})
  return _SCOPED[cls, path]


def _attr_path(path: tuple) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                  for k in path)  # fmt: skip


def _scope_nnx(model: Any) -> Any:
  """A copy of the NNX ``model`` whose submodules' calls are named by their attribute paths."""
  copy = nnx.merge(*nnx.split(model))
  for path, module in nnx.iter_modules(copy):
    if path and callable(module):
      module.__class__ = _scoped_class(type(module), ".".join(map(str, path)))
  return copy


def _scope_equinox(x: Any, eqx: Any, path: tuple = ()) -> Any:
  """A copy of the equinox module ``x`` whose submodules are of classes whose calls are named
  by their attribute paths (the fields are shared, not copied)."""
  if isinstance(x, eqx.Module):
    cls = type(x)
    if path and callable(x):
      cls = _scoped_class(cls, ".".join(map(str, path)))
    new = object.__new__(cls)
    for field in dataclasses.fields(x):
      value = _scope_equinox(getattr(x, field.name), eqx, (*path, field.name))
      object.__setattr__(new, field.name, value)
    return new
  if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
    items = [_scope_equinox(v, eqx, (*path, i)) for i, v in enumerate(x)]
    return items if isinstance(x, list) else tuple(items)
  if isinstance(x, dict):
    return {k: _scope_equinox(v, eqx, (*path, k)) for k, v in x.items()}
  return x


def _scope(x: Any) -> Any:
  if isinstance(x, nnx.Module):
    return _scope_nnx(x)
  eqx = _equinox()
  if eqx is not None and isinstance(x, eqx.Module):
    return _scope_equinox(x, eqx)
  return x


def _equinox() -> Any:
  """equinox, if the program imported it (an equinox module cannot exist otherwise)."""
  return sys.modules.get("equinox")


def layer_of(eqn: Any, calls: tuple = ()) -> str:
  """The layer of ``eqn``, inside the call equations ``calls`` (outermost first): the innermost
  NNX/equinox module path, the flax ``linen`` module path (the root module left out), else the
  user's line (that of the call of a library's function it is in)."""
  parts = _scope_parts([S.name_stack(e) for e in (*calls, eqn)])
  marked = [p[len(LAYER_MARK):] for p in parts if p.startswith(LAYER_MARK)]
  if marked:
    return marked[-1]
  parts = [p for p in parts if p != C.SCALE_SCOPE]
  if len(parts) > 1:
    return "/".join(parts[1:])
  lines = next((found for found in map(C.user_lines, (eqn, *reversed(calls))) if found), [])
  return lines[0] if lines else S.summarize(eqn)


def _scope_parts(stacks: list[str]) -> list[str]:
  """The scope names of the name stacks of nested calls (outermost first), each stack that
  repeats the one around it counted once: a ``jit`` body's stack is its own, but the bodies of
  ``remat`` and ``custom_jvp``/``custom_vjp`` (``nn.relu``) hold the whole stack of their call
  (``Net`` around ``Net``, not ``Net/Net``). The scope of a flax transform of a module
  (``shifted.jmp_full_precision(Shifted)``: ``nn.jit`` in a ``full_precision`` region) before
  that module's own (``shifted``) is left out."""
  parts: list[str] = []
  outer: list[str] = []
  for stack in stacks:
    mine = [p for p in S.module_path([stack]).split("/") if p]
    parts += mine[len(outer):] if outer and mine[:len(outer)] == outer else mine
    outer = mine
  return [p for i, p in enumerate(parts)
          if not ("." in p and parts[i + 1:i + 2] == [p.split(".")[0]])]  # fmt: skip


def _leaf_layer(path: tuple) -> tuple[str, ...]:
  """The components of a gradient leaf's parent path (a flax collection name left out)."""
  parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  if len(path) > 1 and getattr(path[-1], "name", None) == "value":  # an nnx.Variable's value
    parts = parts[:-1]
  parts = parts[:-1]
  if parts and parts[0] == "params":
    parts = parts[1:]
  return tuple(parts)


def _layer_parts(name: str) -> tuple[str, ...]:
  return tuple(re.split(r"[./]", name))


# ---------------------------------------------------------------- the public function


def compare_precision(fn: Callable[..., Any], *args: Any, policy: Policy | str | None = None,
                      scale: Any = 1.0, jump_factor: float = 10.0,
                      **kwargs: Any) -> PrecisionComparison:  # fmt: skip
  """Compares ``fn`` in mixed precision with the same function in float32, layer by layer.

  The float32 baseline of "run it in float32 first, then in mixed precision, and compare", in
  one call that says *where* the two part: ``fn(*args, **kwargs)`` (a loss) and the gradient
  of ``fn(...) * scale`` with respect to the floating leaves of the first argument are run as
  ``policy`` says (through :func:`jmp_scaler.autocast`; with no policy, ``fn`` as it is: an
  autocast function, a model with ``dtype=jnp.float16``) and again with every half-precision
  value computed in float32, and each layer's activation and gradient are compared.

  A layer is a flax ``linen`` module path (``Dense_0``, ``Block_1/MLP_0``), an NNX or equinox
  attribute path (``blocks.0.linear``: ``fn`` or its first argument being the module), else
  the line of your code the operations come from. It costs two compiled runs of the loss and
  its gradient (the program as it is, and widened), each keeping every layer's output.

  Args:
    fn: the loss function (``loss(params, batch)``), an NNX or equinox module, or a function
      of one; it must return a floating scalar.
    *args: its arguments; the first one holds the parameters differentiated (an NNX or
      equinox module: its parameters). Array leaves are traced, every other leaf is static.
    policy: a :class:`jmp_scaler.Policy` or a policy string (``"p=f32,c=f16,o=f32"``) to run
      ``fn`` under with :func:`jmp_scaler.autocast`; None runs ``fn`` as it is.
    scale: the loss scale of the half-precision backward pass and of the underflow column
      (``jmp_scaler.get_scale(opt_state)``).
    jump_factor: how many times larger than the half dtype's epsilon and than every error
      before it a layer's error must be to be the jump.
    **kwargs: ``fn``'s keyword arguments (``policy``, ``scale`` and ``jump_factor`` are this
      function's own).

  Returns:
    A :class:`PrecisionComparison`: ``print`` it for a table; ``.jump`` names the first
    layer where the error jumps, ``.layers`` has the numbers.

  Raises:
    ValueError: if ``fn`` is not callable, ``policy`` is not a policy, ``scale`` not a
      positive float32 number, ``jump_factor`` not a number above 1, ``fn`` does not return
      a floating scalar or its first argument holds no floating array, or when called inside
      ``jax.jit``.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> def loss(w, x):  # 1000.01 is 1000 in float16: the matmul loses w
    ...   return jnp.mean(x @ (w + 1000.0) - jnp.sum(x, -1, keepdims=True) * 1000.0)
    >>> w, x = jnp.full((4, 4), 0.01), jnp.ones((2, 4))
    >>> report = jmp_scaler.compare_precision(loss, w, x, policy="p=f32,c=f16,o=f32")
    >>> round(report.loss, 4), report.loss_half, report.layers[0].activation_error
    (0.04, 0.0, 1.0)
  """
  if not callable(fn):
    raise ValueError(f"fn must be callable, got {fn!r}")
  if policy is not None:
    if not isinstance(policy, (Policy, str)):
      raise ValueError(f"policy must be a jmp_scaler.Policy, a policy string or None, got "
                       f"{policy!r}")
    policy = get_policy(policy)
  scale = validation.positive_f32("scale", scale)
  if isinstance(jump_factor, bool) or not isinstance(jump_factor, (int, float)) or not (
      1 < jump_factor < math.inf):
    raise ValueError(f"jump_factor must be a number above 1, got {jump_factor!r}")
  scoped_fn = _scope(fn)
  call = C.Call(scoped_fn, tuple(_scope(a) if i == 0 else a for i, a in enumerate(args)),
                kwargs)  # fmt: skip
  if any(T.is_traced(x) for x in call.dynamic):
    raise ValueError("compare_precision runs on the host, on concrete arrays: call it outside "
                     "jax.jit (and grad, vmap, ...)")
  flat = autocast(call.flat, policy) if policy is not None else call.flat
  forward, shape = jax.make_jaxpr(flat, return_shape=True)(*call.dynamic)
  leaves = jax.tree.leaves(shape)
  if len(leaves) != 1 or leaves[0].shape != () or not jnp.issubdtype(leaves[0].dtype,
                                                                      jnp.floating):
    got = jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", shape)
    raise ValueError(f"fn must return a floating scalar loss, got {got}; for (loss, aux) pass "
                     "lambda *a: fn(*a)[0]")
  diff, other = call.split_first()
  grad = jax.make_jaxpr(jax.grad(call.scaled(scale, flat)))(diff, other)
  flat_eqns = _flat_eqns(forward)
  lasts: dict[str, int] = {}
  for i, (eqn, calls) in enumerate(flat_eqns):
    if any(_is_activation(v) for v in eqn.outvars):
      lasts[layer_of(eqn, calls)] = i
  wanted = set(lasts.values())
  half_dtype = (np.dtype(policy.compute_dtype) if policy is not None and
                is_half(policy.compute_dtype) else _first_half(flat_eqns))  # fmt: skip

  def keeper() -> Callable[[Any], bool]:
    count = iter(range(len(flat_eqns)))
    return lambda eqn: next(count) in wanted

  runs, stayed = [], []
  for widen in (False, True):
    results, narrowed = W.evaluate([(forward, call.dynamic, keeper()),
                                    (grad, [*diff, *other], lambda eqn: False)], widen)  # fmt: skip
    runs.append(results)
    stayed += narrowed
  (h_out, h_kept), (h_grads, _) = runs[0]  # the gradients of the first argument's leaves
  (w_out, w_kept), (w_grads, _) = runs[1]
  rows: dict[str, dict] = {}
  kept_eqns = [e for i, e in enumerate(flat_eqns) if i in wanted]
  for (eqn, calls), h, w in zip(kept_eqns, h_kept, w_kept, strict=True):
    name = layer_of(eqn, calls)
    j = next(k for k, v in enumerate(eqn.outvars) if _is_activation(v))
    rows[name] = {"act": _relative(h[j], w[j]), "dtype": str(np.asarray(h[j]).dtype)}
  order = list(rows)
  skip = 3 if args and isinstance(C.split(args[0]), C.Module) else 2  # (args, 0[, params])
  groups: dict[str, list] = {}
  for k, i in enumerate(call.first):
    parts = _leaf_layer(call.paths[i][skip:])
    owner = next((n for n in order if _matches(n, parts)), None)
    if owner is None:  # not a module's: the layer of the first operation that reads it
      user = _consumer(forward, i)
      owner = layer_of(*user) if user is not None else "/".join(parts) or C.leaf_name(
        call.paths[i])
    groups.setdefault(owner, []).append(k)
  for name, members in groups.items():
    row = rows.setdefault(name, {"act": None, "dtype": "-"})
    hg = np.concatenate([np.ravel(np.asarray(h_grads[k], np.float64)) for k in members]) / scale
    wg = np.concatenate([np.ravel(np.asarray(w_grads[k], np.float64)) for k in members]) / scale
    row["grad"] = _relative(hg, wg)
    nonzero = wg != 0
    with np.errstate(over="ignore"):  # an overflow is not an underflow: inf != 0
      lost = nonzero & (np.asarray(wg * scale, np.float32).astype(half_dtype) == 0)
    row["under"] = float(lost.sum() / max(int(nonzero.sum()), 1))
    row["size"] = wg.size
  layers = tuple(LayerError(n, r["act"], r["dtype"], r.get("grad"), r.get("under"),
                            r.get("size", 0)) for n, r in rows.items())  # fmt: skip
  eps = float(jnp.finfo(half_dtype).eps)
  return PrecisionComparison(
    layers=layers, jump=_jump(layers, eps, jump_factor),
    loss=float(np.asarray(w_out[0])), loss_half=float(np.asarray(h_out[0])),
    policy=None if policy is None else _policy_text(policy), dtype=str(half_dtype),
    scale=scale, jump_factor=float(jump_factor),
    note=_stayed_note(stayed))


def _stayed_note(stayed: list[tuple[Any, tuple]]) -> str:
  """What qualifies the float32 run: the operations with a body of their own (a custom
  reduction; a scatter is widened) that it computed in their half dtype, each named by where it
  comes from (the user's line, or the gradient of the operations of that line)."""
  where: dict[str, None] = {}
  for eqn, calls in stayed:
    line = next((found[0] for found in map(C.user_lines, (eqn, *reversed(calls))) if found),
                S.summarize(eqn))
    grad = any("transpose(" in S.name_stack(e) for e in (*calls, eqn))
    half = sorted({str(np.dtype(v.aval.dtype)) for v in eqn.invars
                   if getattr(v.aval, "dtype", None) is not None and is_half(v.aval.dtype)})
    what = "in the gradient of the code at" if grad else "at"
    where[f"the {eqn.primitive.name} {what} {line} stayed in {' and '.join(half)}"] = None
  if not where:
    return ""
  return (f"in the float32 run, {'; '.join(where)}: an operation with a body of its own (a "
          "custom reduction) computes in its own dtype, so the float32 run rounds there as the "
          "half run does")


def _is_activation(v: Any) -> bool:
  """A floating, non-scalar value (a scalar is a loss or a statistic, not an activation)."""
  dtype, shape = getattr(v.aval, "dtype", None), getattr(v.aval, "shape", ())
  return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating)) and shape != ()


def _policy_text(policy: Policy) -> str:
  short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
  parts = (("p", policy.param_dtype), ("c", policy.compute_dtype), ("o", policy.output_dtype))
  return ",".join(f"{k}={short.get(np.dtype(d).name, np.dtype(d).name)}" for k, d in parts)


def _matches(layer: str, parts: tuple) -> bool:
  mine = _layer_parts(layer)
  return bool(parts) and (mine == parts or (len(mine) >= len(parts) and
                                            mine[-len(parts):] == parts))  # fmt: skip


def _first_jump(layers: tuple[LayerError, ...], attr: str, eps: float,
                factor: float) -> str | None:  # fmt: skip
  """The first layer whose ``attr`` is at least ``factor`` times ``eps`` and every one before."""
  worst = eps
  for row in layers:
    err = getattr(row, attr)
    if err is None:
      continue
    if err >= factor * worst:
      return row.name
    worst = max(worst, err)
  return None


def _jump(layers: tuple[LayerError, ...], eps: float, factor: float) -> str | None:
  """The first activation error that jumps, else the first gradient error."""
  return (_first_jump(layers, "activation_error", eps, factor)
          or _first_jump(layers, "gradient_error", eps, factor))


def _jumps_by(report: PrecisionComparison, attr: str) -> bool:
  eps = float(jnp.finfo(report.dtype).eps)
  return _first_jump(report.layers, attr, eps, report.jump_factor) == report.jump


def _flat_eqns(closed: Any, calls: tuple = ()) -> list[tuple[Any, tuple]]:
  """The equations of ``closed`` with calls inlined, loops as one, each with the call equations
  around it: the order in which the evaluation of :func:`._walk.evaluate` asks ``keep``."""
  out = []
  for eqn in J.closed(closed).jaxpr.eqns:
    body = P.inline_body(eqn)
    if body is not None:
      out.extend(_flat_eqns(body, (*calls, eqn)))
    else:
      out.append((eqn, calls))
  return out


def _consumer(closed: Any, index: int, calls: tuple = ()) -> tuple[Any, tuple] | None:
  """The first equation (with the calls around it) that reads input ``index`` of ``closed``,
  through calls and casts; None if none does."""
  jaxpr = J.closed(closed).jaxpr
  var = jaxpr.invars[index]
  for eqn in jaxpr.eqns:
    if var not in eqn.invars:
      continue
    body = P.inline_body(eqn)
    if body is not None:
      found = _consumer(body, eqn.invars.index(var), (*calls, eqn))
      if found is not None:
        return found
      continue
    if eqn.primitive.name == "convert_element_type":
      var = eqn.outvars[0]
      continue
    return eqn, calls
  return None


def _first_half(eqns: list) -> np.dtype:
  for eqn, _ in eqns:
    for v in eqn.outvars:
      dtype = getattr(v.aval, "dtype", None)
      if dtype is not None and is_half(dtype):
        return np.dtype(dtype)
  return np.dtype(jnp.float16)
