"""``autocast``: mixed precision as a function transformation, op by op.

``autocast(fun, policy)`` traces ``fun`` to a jaxpr and evaluates that jaxpr
again, equation by equation, casting the floating inputs of each primitive as
its rule says (:mod:`jmp_scaler.precision._rules`): matmuls and convolutions in
the policy's compute dtype, exponentials, logarithms, powers and reductions in
float32, everything else at the widest of its inputs (what the casts already in
the jaxpr mean is decided first: :mod:`jmp_scaler.precision._casts`); under the
``"fp8"`` rule each ``dot_general`` is bound as ``fp8_dot_general``. The re-evaluation binds
ordinary primitives, so the result composes with ``jax.jit``, ``jax.grad``,
``jax.vmap`` and ``shard_map`` like any JAX function, and holds wherever and
whenever it is jitted.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_scaler._leaves import FLOAT32, is_half, is_real_floating
from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _primitives as P
from jmp_scaler.jaxcompat import _source as S
from jmp_scaler.jaxcompat import _types as T
from jmp_scaler.lowbit._block import MxFp8Recipe, Nvfp4Recipe, block_scaled_dot_general
from jmp_scaler.lowbit._fp8 import Fp8Recipe, Unsupported, fp8_dot_general
from jmp_scaler.precision import _rules as R
from jmp_scaler.precision._casts import NONE, Planner
from jmp_scaler.precision._composites import Finder
from jmp_scaler.precision._modules import as_policy
from jmp_scaler.precision._policy import Policy

#: Name prefixes of the ``jit`` equations that mark regions: the interpreter of
#: an enclosing ``autocast`` runs them as they are.
AUTOCAST_MARK = "jmp_autocast"
FULL_PRECISION_MARK = "jmp_full_precision"
_MARKS = (AUTOCAST_MARK, FULL_PRECISION_MARK)


# ---------------------------------------------------------------- the interpreter


def _is_weak(var: Any, fills: frozenset = frozenset()) -> bool:
  """Scalars (``x * 0.5``, a 0-d array: PyTorch's zero-dim tensors), a scalar broadcast to a
  shape (``fills``: ``jnp.where(mask, x, jnp.finfo(x.dtype).min)`` broadcasts its fill, as
  ``x.masked_fill(mask, value)`` fills in ``x``'s dtype) and weakly typed values do not drive
  promotion when a dimensioned value is there (``x16 / jnp.sqrt(d)`` is float16, as ``x16 /
  torch.tensor(8.)`` is in PyTorch). A fill narrowed so is saturated, not made infinite, if
  it is a constant (:func:`._rules.cast`)."""
  aval = var.aval
  if not aval.shape or getattr(aval, "weak_type", False):
    return True
  return _is_fill(var, fills)


def _is_fill(var: Any, fills: frozenset) -> bool:
  return not J.is_literal(var) and var in fills


def _widen(x: Any) -> Any:
  """A half-precision floating ``x`` in float32; anything else as it is."""
  return R.cast(x, FLOAT32) if is_real_floating(x) and x.dtype.itemsize < 4 else x


def _recomputed(body: Callable) -> Callable:
  """``body`` under ``jax.checkpoint``: its backward pass saves its inputs only, and the
  compiler the program is lowered for decides how the recomputation is placed.

  On TPU the recomputation is left open to common-subexpression elimination
  (``prevent_cse=False``): XLA:TPU then fuses the body into the matmuls around it, forward and
  backward, as it does with hand-annotated code; behind the CSE barrier it reads and writes
  float32 intermediates of the attention scores' size instead (TPU v5e, the 4-layer GPT step of
  ``benchmarks/bench_compiled.py``: 21.7 GB accessed against 17.0; a ResNet: 157 MiB of temp
  memory against 115). On the other platforms the barrier stays: XLA:GPU, free to merge the
  recomputation with the forward pass, keeps float32 intermediates alive from one to the other
  (H100, a 2-layer GPT: 1391 MiB of temp memory against 1236). Both are traced and only the
  lowering platform's is compiled (``jax.lax.platform_dependent``); both save the same
  residuals, the body's inputs, so the jaxpr's ``saved_residuals`` are those of one
  checkpoint. ``body`` is jitted, so both checkpoints (and every later call with the same input
  types) reuse one trace of it: tracing a 48-layer GPT's gradient under autocast takes
  x1.32-1.44 of the plain function's time, x1.58-1.64 with ``body`` traced for each
  checkpoint, x1.16-1.22 with one checkpoint for every platform.
  """
  traced = jax.jit(body)  # traced once for both platforms' checkpoints (and later calls)
  fused, kept = jax.checkpoint(traced, prevent_cse=False), jax.checkpoint(traced)
  return lambda *xs: jax.lax.platform_dependent(*xs, tpu=fused, default=kept)


def _all_fp8(args: Sequence[Any]) -> bool:
  """Whether every floating input is 8-bit: a matmul already in fp8 (fp8_dot_general's own)."""
  floats = [a for a in args if is_real_floating(a)]
  return bool(floats) and all(np.dtype(a.dtype).itemsize == 1 for a in floats)


#: The registry of the warnings below: one warning per site and reason, as ``warnings.warn``
#: gives one per line of code under the default filters.
_NOT_FP8: dict = {}


def _warn_not_fp8(eqn: Any, reason: Exception, dtype: Any) -> None:
  """Warns, once per site, that a dot under the "fp8" rule runs in ``dtype`` instead."""
  site = S.summarize(eqn)
  filename, lineno = S.summary_location(eqn)
  warnings.warn_explicit(
    f"jmp_scaler.autocast: the dot_general at {site} does not run in fp8; it runs in {dtype} "
    f"under the 'compute' rule: {reason}",
    UserWarning, filename, lineno, registry=_NOT_FP8,
  )


class _Interpreter:
  """Evaluates jaxprs under a policy and a rule table (see :mod:`._casts` for the plan)."""

  def __init__(self, policy: Policy, table: Mapping[str, str], given: frozenset[str],
               recipe: R.AnyRecipe, composites: Mapping[str, str] | None = None,
               own: frozenset[str] = frozenset(), scoped: Sequence[R.Scoped] = ()):  # fmt: skip
    self.policy, self.table, self.recipe = policy, table, recipe
    self.scoped = tuple(scoped)
    self._path: list[str] = []  # the name stacks of the calls being run, outermost first
    self.matched: set[int] = set()  # the scoped rules that matched an equation (by index)
    self.paths: dict[str, set[str]] = {}  # a scoped rule's primitive -> its module paths
    self._in_activation = False
    self._fills: frozenset = frozenset()  # the plan's of the jaxpr being run
    self._bodies: dict[Any, Callable] = {}
    finder = Finder(composites or {}, own)
    self.planner = Planner(table, self._body_of, given, finder)

  @staticmethod
  def _body_of(eqn: Any) -> Any:
    """A call-like body to plan through; regions are run as they are, so not planned."""
    if eqn.primitive.name in P.JIT_NAMES and P.jit_name(eqn).startswith(_MARKS):
      return None
    return P.call_body(eqn)

  def run(self, jaxpr: Any, args: Sequence[Any], widened=None, fed_out=None) -> list:
    """Evaluates a (closed) jaxpr on ``args`` under the rules.

    For the body of a call, ``widened`` says from which half dtypes the traced function
    computed each argument by widening, and ``fed_out`` which results the caller uses
    only in float32 ops (see :class:`Planner`); none if not given.
    """
    closed = J.closed(jaxpr)
    plan = self.planner.plan(closed.jaxpr, widened, fed_out)
    outer_fills, self._fills = self._fills, plan.fills
    try:
      return self._run(closed, args, plan)
    finally:
      self._fills = outer_fills

  def _run(self, closed: Any, args: Sequence[Any], plan: Any) -> list:
    env: dict[Any, Any] = {}
    read = lambda v: J.read_literal(v, env)
    env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(closed.jaxpr.invars, args, strict=True))
    casts: dict[tuple[int, Any], tuple[Any, Any]] = {}

    def cast(x, dtype):  # each value cast once per dtype: one cotangent sum, in float32
      key = (id(x), np.dtype(dtype))
      if key not in casts:
        casts[key] = (x, R.cast(x, dtype))
      return casts[key][1]

    inside: set[int] = set()  # the later members of an activation's run of equations
    for i, eqn in enumerate(closed.jaxpr.eqns):
      if i in inside:
        continue
      if (group := plan.groups.get(i)) is not None and not self._in_activation:
        inside.update(group.members[1:])
        with S.user_context(eqn):
          outs = self._activation(closed.jaxpr, group, [read(v) for v in group.inputs],
                                  i in plan.float32)  # fmt: skip
        env.update(zip(group.outputs, outs, strict=True))
        continue
      args_i = [read(v) for v in eqn.invars]
      with S.user_context(eqn):
        if i in plan.round_trips:
          outs = args_i  # the end of a round trip: the value stays as autocast computed it
        elif i in plan.bias_adds:  # never float32-fed: in the matmul's dtype
          outs = self._bias_add(eqn, args_i, plan.bias_adds[i], cast)
        else:
          rule = R.FLOAT32 if i in plan.float32 else None
          outs = self.apply(eqn, args_i, cast, rule, plan.widened, plan.calls_fed.get(i))
      env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in closed.jaxpr.outvars]

  def _activation(self, jaxpr: Any, group: Any, args: list, float32: bool) -> list:
    """An activation's equations as one op (:mod:`._composites`).

    Its input is the largest floating value it reads (a norm's scale and bias are not): the
    result of that shape gets that input's dtype, or float32 under the ``"float32"`` rule
    or where it feeds float32 ops; other results (a batch norm's running statistics) keep
    float32. Inside ``jax.checkpoint`` the equations run in float32 (or wider: float64
    stays), whatever dtypes they were traced with, so the backward pass saves the inputs
    only and recomputes the rest in float32; an op with a collective inside (a batch norm
    over a mesh axis) is not recomputed, so the backward pass adds no communication.
    """
    eqns = [jaxpr.eqns[j] for j in group.members]
    floats = [a for a in args if is_real_floating(a)]
    main_shape, target = None, None
    if floats:
      main = max(floats, key=lambda a: a.size)
      main_shape, dtypes = main.shape, [a.dtype for a in floats if a.size == main.size]
      widen = float32 or group.rule == R.FLOAT32
      target = R.widest([FLOAT32, *dtypes] if widen else dtypes)

    remat = not any(P.is_collective(e) for e in eqns)
    cached = self._bodies.get((group.key, remat)) if group.key is not None else None
    outs = (cached or self._body(eqns, group, remat))(*args)

    def narrow(o):
      shaped = len(outs) == 1 or o.shape == main_shape
      return shaped and is_real_floating(o) and np.dtype(o.dtype).itemsize <= 4
    return [R.cast(o, target) if target is not None and narrow(o) else o for o in outs]

  def _body(self, eqns: list, group: Any, remat: bool) -> Callable:
    """The function of an activation's equations in float32 (under ``jax.checkpoint`` when
    ``remat``: :func:`_recomputed`), kept for every later group of the same equations."""
    def body(*xs):
      env = {v: _widen(x) for v, x in zip(group.inputs, xs, strict=True)}
      self._in_activation = True  # the calls inside (silu's jit) are part of this one op
      try:
        for eqn in eqns:
          ins = [J.read_literal(v, env) for v in eqn.invars]
          if name_is_convert(eqn) and is_half(eqn.params["new_dtype"]) and is_real_floating(
              ins[0]):  # fmt: skip
            outs = ins  # traced from half code (jnp.sum's round trip): no rounding inside
          else:
            with S.user_context(eqn):
              outs = self.apply(eqn, ins, R.cast, R.FLOAT32, {}, None)
          env.update(zip(eqn.outvars, outs, strict=True))
      finally:
        self._in_activation = False
      return [env[v] for v in group.outputs]

    fn = _recomputed(body) if remat else body
    if group.key is not None:
      self._bodies[(group.key, remat)] = fn
    return fn

  def _bias_add(self, eqn: Any, args: list, k: int, cast: Callable) -> list:
    """A matmul's result plus a broadcast bias, in the matmul's dtype (``torch.nn.Linear``'s
    ``addmm``), even where only float32 ops use the sum (a head's logits); a wider bias
    (float64) is not narrowed: the add promotes then.

    The bias's gradient is torch's and cuBLAS's: the half-precision cotangents summed in
    float32 over the broadcast dimensions and the devices, rounded once to the matmul's
    dtype (as the kernel's gradient, a half-precision matmul's result, is), then widened to
    the bias's dtype. The bias is rounded to the matmul's dtype, widened, broadcast (and,
    inside ``shard_map``, marked varying along the mesh axes the result varies along), then
    cast, so that the transposes sum in float32 and round at the end. That rounding is also
    what lets XLA:TPU write the head's float32 logits in the backward pass, fused with the
    bias's gradient, not in the forward pass next to its bfloat16 ones: TPU v5e, the 4-layer
    GPT of ``benchmarks/bench_compiled.py``: 1335 -> 1188 MiB of temp memory.
    """
    dtype, bias = args[k].dtype, args[1 - k]
    if np.dtype(bias.dtype).itemsize > max(4, np.dtype(dtype).itemsize):
      return self._bind(eqn, *self._cast(eqn, args, R.PROMOTE, cast))
    bias = R.cast(cast(bias, dtype), bias.dtype)  # its gradient: rounded once, summed wide
    bias = jnp.broadcast_to(bias, args[k].shape)
    axes = tuple(sorted(T.varying_axes(args[k]) - T.varying_axes(bias), key=str))
    if axes:
      bias = T.mark_varying(bias, axes)
    bias = cast(bias, dtype)
    return self._bind(eqn, [bias if j != k else a for j, a in enumerate(args)], eqn.params)

  def transform(self, closed: Any, args: Sequence[Any], *plan_args) -> Any:
    """``closed`` rewritten for inputs shaped like ``args``."""
    return jax.make_jaxpr(lambda *xs: self.run(closed, xs, *plan_args))(*args)

  def apply(self, eqn: Any, args: list, cast: Callable, rule: str | None, widened: Mapping,
            fed_out: tuple | None) -> list:  # fmt: skip
    name = eqn.primitive.name
    recipe = self.recipe
    if self.scoped and not self._in_activation:  # the user's rule for this path wins
      if (scoped := self._scoped(eqn, name)) is not None:
        rule, recipe = scoped.rule, scoped.recipe or recipe
    rule = rule or self.table.get(name)
    if rule == R.ORIGINAL:
      return self._original(eqn, args)
    if name in P.JIT_NAMES:
      body = P.jit_body(eqn)
      if P.jit_name(eqn).startswith(_MARKS):  # a region: already decided
        return P.rebind_jit(
          eqn, body, [R.cast(a, v.dtype) for a, v in zip(args, body.in_avals, strict=True)]
        )
      inner = [NONE if J.is_literal(v) else widened.get(v, NONE) for v in eqn.invars]
      with self._inside(eqn):
        return P.rebind_jit(eqn, self.transform(body, args, inner, fed_out), args)
    if name in R.HIGHER_ORDER:
      with self._inside(eqn):
        return R.HIGHER_ORDER[name](self._runner(eqn, fed_out), eqn, args)
    if R.is_scatter(eqn):
      args, _ = self._cast(eqn, args, rule or R.PROMOTE, cast)
      return R.rebind_scatter(eqn, args)
    if rule in R.MATMUL and _all_fp8(args):  # already fp8: lower than any compute dtype
      return self._bind(eqn, args, eqn.params)
    if rule == R.FP8:
      return self._fp8(eqn, args, cast, recipe)
    if J.has_sub_jaxprs(eqn):
      warnings.warn(
        f"jmp_scaler.autocast cannot rewrite the body of {name!r}; it runs at the dtypes "
        "it was traced with",
        stacklevel=2,
      )
      return self._original(eqn, args)
    if rule is None:
      rule = R.PROMOTE if not eqn.primitive.multiple_results else R.KEEP
    return self._bind(eqn, *self._cast(eqn, args, rule, cast))

  @contextlib.contextmanager
  def _inside(self, eqn: Any) -> Iterator[None]:
    """Runs a call's body with the call's name stack on the module path."""
    self._path.append(S.name_stack(eqn))
    try:
      yield
    finally:
      self._path.pop()

  def _scoped(self, eqn: Any, name: str) -> R.Scoped | None:
    """The first scoped rule of ``name`` whose pattern is in ``eqn``'s module path, if any.
    It wins over the plan's float32 (the plan's other decisions hold where none matches)."""
    path = None
    for i, s in enumerate(self.scoped):
      if s.name != name:
        continue
      if path is None:
        path = S.module_path((*self._path, S.name_stack(eqn)))
        self.paths.setdefault(name, set()).add(path)
      if s.regex.search(path):
        self.matched.add(i)
        return s
    return None

  def _fp8(self, eqn: Any, args: list, cast: Callable, recipe: R.AnyRecipe) -> list:
    """A ``dot_general`` as :func:`fp8_dot_general`, its result in the compute rule's dtype.

    A dot the op refuses (integer or float64 operands, a non-default precision, an
    ``out_sharding`` on a reshaped dot, an unreduced operand) runs under the "compute"
    rule instead, with a warning once per site: never silently in high precision.
    """
    dtypes = [a.dtype for a in args if is_real_floating(a)]
    target = R.TARGETS[R.COMPUTE](self.policy.compute_dtype, dtypes, [False] * len(dtypes))
    try:
      params = {**eqn.params, "preferred_element_type": target}
      if isinstance(recipe, Fp8Recipe):
        return [fp8_dot_general(*args, **params, recipe=recipe)]
      return [block_scaled_dot_general(*args, **params, recipe=recipe)]  # mxfp8, nvfp4
    except Unsupported as e:
      out = self._bind(eqn, *self._cast(eqn, args, R.COMPUTE, cast))
      _warn_not_fp8(eqn, e, out[0].dtype)
      return out

  def _runner(self, eqn: Any, fed_out: tuple | None) -> Callable:
    """``run`` for a higher-order equation: its call body knows which results feed float32."""
    body = P.call_body(eqn)

    def run(jaxpr, args):
      mine = fed_out is not None and J.closed(jaxpr).jaxpr is body
      return self.run(jaxpr, args, None, fed_out if mine else None)

    return run

  def _cast(self, eqn: Any, args: list, rule: str, cast: Callable) -> tuple[list, dict]:
    params = dict(eqn.params)
    floats = [i for i, a in enumerate(args) if is_real_floating(a)]
    if name_is_convert(eqn) and floats:
      # A cast to the dtype it already had (a weak-type change) follows its input.
      if eqn.invars[0].aval.dtype == params["new_dtype"]:
        params["new_dtype"] = args[0].dtype
      return args, params
    if not floats or rule not in R.TARGETS:
      return args, params
    dtypes = [args[i].dtype for i in floats]
    weak = [_is_weak(eqn.invars[i], self._fills) for i in floats]
    target = R.TARGETS[rule](self.policy.compute_dtype, dtypes, weak)
    if len(set(dtypes)) > 1 or dtypes[0] != target:
      narrow = np.dtype(target).itemsize
      args = [cast(R.saturated_fill(a, target) if _is_fill(eqn.invars[i], self._fills)
                   and np.dtype(a.dtype).itemsize > narrow else a, target)
              if i in floats else a for i, a in enumerate(args)]  # fmt: skip
    pref = params.get("preferred_element_type")
    if pref is not None and jnp.issubdtype(pref, jnp.floating):
      params["preferred_element_type"] = np.dtype(target)
    return args, params

  def _original(self, eqn: Any, args: list) -> list:
    args = [R.cast(a, v.aval.dtype) for a, v in zip(args, eqn.invars, strict=True)]
    return self._bind(eqn, args, eqn.params)

  @staticmethod
  def _bind(eqn: Any, args: list, params: Mapping[str, Any]) -> list:
    return J.bind(eqn, args, dict(params))


def name_is_convert(eqn: Any) -> bool:
  return eqn.primitive.name == "convert_element_type"


# ---------------------------------------------------------------- named regions


def _dynamic(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _Static:
  """The non-array leaves and the tree structure of a call: a static jit argument."""

  def __init__(self, treedef: Any, mask: tuple[bool, ...], leaves: tuple):
    self.treedef, self.mask, self.leaves = treedef, mask, leaves
    self.key = (treedef, mask, tuple(self._hashable(x) for x in leaves))

  @staticmethod
  def _hashable(x: Any) -> Any:
    try:
      hash(x)
      return x
    except TypeError:
      return ("by-id", id(x))  # kept alive by self.leaves, so the id is not reused

  def rebuild(self, dynamic: Sequence[Any]) -> Any:
    dyn, stat = iter(dynamic), iter(self.leaves)
    leaves = [next(dyn) if m else next(stat) for m in self.mask]
    return jax.tree.unflatten(self.treedef, leaves)

  def __hash__(self) -> int:
    return hash(self.key)

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, _Static):
      return False
    try:
      return self.key == other.key
    except (ValueError, jax.errors.TracerBoolConversionError):
      # Metadata that holds arrays (tunix's sampling state), compared inside an enclosing
      # trace: == was traced instead of evaluated. Compare the values as at top level.
      with jax.ensure_compile_time_eval():
        return self.key == other.key


def _named_jit(body: Callable, fun: Callable, name: str) -> Callable:
  """``body(static, *arrays)`` as a ``jit`` named ``name``: the array leaves of the
  arguments are traced, every other leaf (Python numbers, strings) is static.

  The ``jit`` takes and returns flat lists of arrays, so JAX's caches never compare the
  caller's pytrees (inside an enclosing trace, metadata that holds arrays cannot be
  compared); the results' tree is kept per call signature when ``body`` is traced."""
  trees: dict[tuple, Any] = {}

  def signature(static: _Static, dynamic: Sequence[Any]) -> tuple:
    return static, tuple((x.shape, x.dtype) for x in dynamic)

  def run(static, *dynamic):
    outs, trees[signature(static, dynamic)] = jax.tree.flatten(body(static, *dynamic))
    return outs

  run.__name__ = run.__qualname__ = name
  jitted = jax.jit(run, static_argnums=0)

  @functools.wraps(fun)
  def wrapper(*args, **kwargs):
    leaves, treedef = jax.tree.flatten((args, kwargs))
    mask = tuple(_dynamic(x) for x in leaves)
    static = _Static(treedef, mask, tuple(x for x, m in zip(leaves, mask, strict=True) if not m))
    dynamic = [x for x, m in zip(leaves, mask, strict=True) if m]
    outs = jitted(static, *dynamic)
    return jax.tree.unflatten(trees[signature(static, dynamic)], outs)

  return wrapper


def _fun_name(fun: Callable) -> str:
  return getattr(fun, "__name__", type(fun).__name__)


# ---------------------------------------------------------------- public API


def autocast(
  fun: Callable | Policy | str | None = None,
  policy: Policy | str | None = None,
  *,
  rules: Mapping[Any, str | Fp8Recipe | MxFp8Recipe | Nvfp4Recipe] | None = None,
) -> Callable:
  """Transforms ``fun`` to compute under ``policy``, op by op, as ``torch.autocast`` does.

  ``fun`` is traced to a jaxpr and every equation is evaluated again with its
  floating inputs cast as its rule says (:data:`DEFAULT_RULES`):

  * ``"compute"``: matmuls and convolutions (``dot_general``,
    ``conv_general_dilated``: what ``@``, ``jnp.einsum``, ``lax.dot``, Flax's
    ``Dense``/``Conv`` and attention lower to) in ``policy.compute_dtype``;
  * ``"float32"``: exponentials, logarithms, powers, square roots, ``logistic``,
    ``erf``, reductions and cumulative sums (hence softmax, log-softmax, norms
    and losses) in float32;
  * ``"promote"`` (every other primitive): the widest floating input, scalar
    constants not counted, so a float16 matmul plus a float32 bias is float32;
  * ``"reciprocal"`` (``div``): float32 for ``1 / x``, otherwise ``"promote"``;
  * ``"original"``: the dtypes ``fun`` was traced with;
  * ``"fp8"`` (``dot_general`` only, never a default): each matmul as
    :func:`jmp_scaler.fp8_dot_general` with per-tensor current scaling, forward
    and backward, its result in the compute dtype; ``rules={"dot_general":
    Fp8Recipe(...)}`` chooses the recipe (default ``Fp8Recipe()``). Dots already
    in fp8 are kept as they are (under ``"compute"`` too); a dot the op refuses
    (integer or float64 operands, a non-default ``precision``, ...) runs under
    ``"compute"`` with a ``UserWarning`` once per site (docs/fp8.md);
  * ``"mxfp8"`` and ``"nvfp4"`` (``dot_general`` only; or an
    :class:`jmp_scaler.MxFp8Recipe` or :class:`jmp_scaler.Nvfp4Recipe` as the rule):
    the same with block scaling, each matmul as
    :func:`jmp_scaler.block_scaled_dot_general`.

  Two things are decided from the traced dtypes first (:mod:`._casts`): a cast
  back to half precision that ends a round trip (``x16 -> float32 -> op ->
  float16``: how jnp's reductions, ``jax.nn.softmax`` and Flax's norms compute
  in float32) is not applied, so a float32 op's result stays float32; and an
  op that follows its inputs but feeds only float32 ops (or the output cast to
  a float32 ``output_dtype``) runs in float32, as the losses PyTorch lists do,
  except a matmul's bias add, in the matmul's dtype as ``torch.nn.Linear``'s
  ``addmm`` (a head's logits included). Every other cast in ``fun`` is
  applied as written; a primitive given a rule in ``rules`` keeps exactly that
  rule.

  Integer, boolean and key-typed values are never cast, and float64 is never
  narrowed, outputs included. Arguments are not cast on entry (parameters stay
  as stored: the casts happen at the op, and their gradients come back in the
  stored dtype); half-precision and float32 outputs are cast to
  ``policy.output_dtype``. The transformation enters ``jit``, ``custom_jvp``
  and ``custom_vjp`` functions (keeping their derivative rules), ``scan``,
  ``while_loop``, ``cond``/``switch``, ``checkpoint``, ``shard_map`` and jnp's
  scatters; loop carries keep the widest dtype their body gives them.

  The result is a ``jit`` named ``jmp_autocast[<policy>](<name>)`` in the
  jaxpr: an enclosing ``autocast`` runs it as it is, so nested policies and
  :func:`full_precision` regions hold. Array leaves of the arguments are
  traced; every other leaf (Python numbers, strings) is static, one trace per
  value.

  Use it as a function or as a decorator::

    loss = jmp_scaler.autocast(loss_fn, "p=f32,c=f16,o=f32")
    loss8 = jmp_scaler.autocast(loss_fn, "p=f32,c=bf16,o=f32", rules={"dot_general": "fp8"})

    @jmp_scaler.autocast(policy="p=f32,c=bf16,o=f32")
    def forward(params, x): ...

    logits = jmp_scaler.autocast(model.apply, policy)(variables, x)   # linen

  Args:
    fun: the function; omit it (or pass the policy first) for a decorator.
    policy: a :class:`jmp_scaler.Policy` or a policy string.
    rules: primitive (or its name) -> rule, over :data:`DEFAULT_RULES`; for
      example ``{"tanh": "float32", "reduce_max": "promote"}``, or
      ``{"dot_general": "fp8"}`` (or an :class:`jmp_scaler.Fp8Recipe` as its
      rule). A name must be a known primitive's; a primitive object of your
      own is accepted. A key ``(primitive, pattern)`` is a scoped rule: the
      rule of that primitive's equations whose module path (their
      ``jax.named_scope`` names, outermost first: flax linen's module path,
      ``"Model/Block_3/Dense_0"``) contains a match of the regular expression
      ``pattern`` (``re.search``); the first matching scoped rule wins over
      the primitive's own, so ``{"dot_general": "nvfp4", ("dot_general",
      r"Block_3|head"): "compute"}`` keeps a last block and the head in the
      compute dtype with no edit to the model. A scoped rule that matches no
      equation warns, listing the module paths there are.

  Returns:
    The transformed function, with ``fun``'s signature.

  Raises:
    ValueError: naming the argument, for a bad function, policy or rule (the
      ``"fp8"`` rule for another primitive than ``dot_general``), and for an
      unknown primitive name (with the closest known names).

  Examples:
    >>> import jax, jax.numpy as jnp, jmp_scaler
    >>> f = jmp_scaler.autocast(lambda w, x: jnp.exp(x @ w), "p=f32,c=f16,o=f32")
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((1, 2)))
    >>> [str(e.outvars[0].aval.dtype) for e in jaxpr.eqns[0].params["jaxpr"].eqns]
    ['float16', 'float16', 'float16', 'float32', 'float32']
  """
  if isinstance(fun, (Policy, str)) and policy is None:
    fun, policy = None, fun
  if policy is None:
    raise ValueError("policy must be a jmp_scaler.Policy or a policy string, got None")
  policy = as_policy("policy", policy)
  table, recipe, composites, own, scoped = R.rule_table(rules)
  if fun is None:
    return functools.partial(autocast, policy=policy, rules=rules)
  if not callable(fun):
    raise ValueError(f"fun must be callable, got {fun!r}")
  given = frozenset(k if isinstance(k, str) else k.name for k in (rules or {})
                    if not isinstance(k, tuple)) - own
  interp = _Interpreter(policy, table, given, recipe, composites, own, scoped)

  def body(static, *dyn):
    tree = []

    def flat(*xs):  # flat results: JAX never compares fun's output tree (metadata may hold arrays)
      args, kwargs = static.rebuild(xs)
      outs, out_tree = jax.tree.flatten(fun(*args, **kwargs))
      tree.append(out_tree)
      return outs

    closed = jax.make_jaxpr(flat)(*dyn)  # abstracts: vma, weak
    # The output cast to float32 is a float32 use: what feeds only it runs in float32.
    fed = (np.dtype(policy.output_dtype).itemsize >= 4,) * len(closed.jaxpr.outvars)
    interp.matched.clear()
    interp.paths.clear()
    outs = interp.run(closed, dyn, None, fed)
    outs = [R.cast_output(o, policy.output_dtype) for o in outs]
    # the names the finder looks for ("primitives" switches a composite off: nothing to find)
    finder = interp.planner.finder
    unseen = sorted((own & finder.table.keys()) - finder.matched)
    if unseen:
      named = ", ".join(f"{n!r} ({composites[n]!r})" for n in unseen)
      warnings.warn(
        f"jmp_scaler.autocast: rules names the function(s) [{named}], but "
        f"{_fun_name(fun)} calls no function of that name: check the spelling (the "
        "function's __name__); those ops are decided one by one", UserWarning, stacklevel=2)
    for i, s in enumerate(scoped):
      if i not in interp.matched:
        seen = sorted(interp.paths.get(s.name, ()))
        warnings.warn(
          f"jmp_scaler.autocast: rules[({s.name!r}, {s.pattern!r})] matched no {s.name} of "
          f"{_fun_name(fun)}, whose {s.name} module paths are {seen[:20]}"
          f"{' ...' if len(seen) > 20 else ''}: those run under rules[{s.name!r}] (flax "
          "linen names its modules' scopes; elsewhere a jax.named_scope names one)",
          UserWarning, stacklevel=2)
    return jax.tree.unflatten(tree[0], outs)

  return _named_jit(body, fun, f"{AUTOCAST_MARK}[{policy}]({_fun_name(fun)})")


def full_precision(fun: Callable) -> Callable:
  """``fun`` as a float32 region: an enclosing :func:`autocast` leaves it alone.

  ``torch.autocast(enabled=False)`` for JAX: half-precision floating arguments
  are cast to float32 and ``fun`` runs exactly as written, its matmuls
  included. The region is a ``jit`` named ``jmp_full_precision(<name>)`` in
  the jaxpr. Used alone it changes nothing but the casts of its arguments.

  ``fun`` may be a flax module, or a method of one, called where the plain
  module would be:

  * linen: a submodule inside the parent's ``nn.compact`` method (or one
    assigned in ``setup``), ``full_precision(nn.Dense(10, name="head"))(x)``
    or ``full_precision(self.embed.attend)(x)``. ``init`` runs it as the plain
    module (the same variables, values included); ``apply`` runs it as a
    ``nn.jit`` (flax's lifted ``jax.jit``), so its variables, mutable
    collections (``batch_stats``) and random streams (``dropout``) go in and
    out as the plain module's do, and gradients flow through it. A random
    stream draws other (equally random) numbers inside the region than
    outside: flax's lifted ``jit`` forks it.
  * NNX: a module or a method of one, ``full_precision(self.head)(x)``, under
    ``nnx.jit``, ``nnx.value_and_grad`` or :func:`autocast` of a function of
    its state (docs/autocast.md, "Flax"). Its state goes through the ``jit``
    and the variables the call changes (``BatchNorm``'s statistics in
    training, an ``nnx.Rngs`` count) are written back, as are those of NNX
    objects among the arguments (``rngs=``).

  Its ``dtype`` fields still apply: a module with ``dtype=jnp.float16`` (set by
  hand or by :func:`jmp_scaler.autocast_nnx`) computes in float16 in the
  region too. A function that closes over a linen submodule cannot be a region
  (the variables created inside a ``jit`` would leak out as tracers): it is
  refused; pass the module itself, or keep the model as it is and give
  :func:`autocast` a scoped rule, ``rules={("dot_general", r"head"):
  "float32"}``.

  Args:
    fun: the function, flax module or module method to keep in full precision.

  Returns:
    The wrapped function.

  Raises:
    ValueError: if ``fun`` is not callable; naming the module and the scoped
      rule to use instead, for a linen module that is not bound to a parent
      (created outside a module, or in ``setup`` without being assigned), for
      a function that closes over a linen submodule, and (when called) for
      one given a linen submodule as an argument.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> @jmp_scaler.autocast(policy="p=f32,c=f16,o=f32")
    ... def f(w, x):
    ...   return jmp_scaler.full_precision(jnp.dot)(x, w) + (x @ w)
    >>> f(jnp.ones((2, 2)), jnp.ones((1, 2))).dtype
    dtype('float32')

    Around a linen submodule, whose matmul is then the only float32 one:

    >>> import jax, flax.linen as nn
    >>> class Model(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return jmp_scaler.full_precision(nn.Dense(2, name="head"))(nn.Dense(4)(x))
    >>> model, x = Model(), jnp.ones((1, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> jax.tree.map(jnp.shape, variables["params"]["head"])
    {'bias': (2,), 'kernel': (4, 2)}
    >>> apply16 = jmp_scaler.autocast(model.apply, "p=f32,c=f16,o=f32")
    >>> body = jax.make_jaxpr(apply16)(variables, x).eqns[0].params["jaxpr"]
    >>> [str(e.outvars[0].aval.dtype) for e in body.eqns if e.primitive.name == "dot_general"]
    ['float16']
    >>> [e.params["name"] for e in body.eqns if e.primitive.name == "jit"]
    ['jmp_full_precision(Dense)']
  """
  if not callable(fun):
    raise ValueError(f"fun must be callable, got {fun!r}")
  owner = _module_of(fun)
  if owner is not None:
    module, method = owner
    if _is_linen(module):
      return _linen_region(fun, module, method)
    return _nnx_region(fun, module, method)
  _refuse_captured_linen(fun)

  def body(static, *dyn):
    args, kwargs = static.rebuild([_widen(x) for x in dyn])
    return fun(*args, **kwargs)

  plain = _named_jit(body, fun, f"{FULL_PRECISION_MARK}({_fun_name(fun)})")
  stateful: list[Callable] = []  # made at the first call given NNX objects

  @functools.wraps(fun)
  def wrapper(*args, **kwargs):
    objects = _flax_objects((args, kwargs))
    if not objects:
      return plain(*args, **kwargs)
    for x in objects:
      if _is_linen(x):
        _refuse_linen_argument(fun, x)
    if not stateful:
      stateful.append(_nnx_region(fun, None, None))
    return stateful[0](*args, **kwargs)

  return wrapper


# ------------------------------------------------ full-precision regions of flax modules
#
# A jax.jit boundary inside a flax module leaks what the module writes inside it: a linen
# scope's new variables (init) and updated collections, an NNX variable's new value, as
# tracers of the finished trace. So a module's region carries its variables through the jit:
# linen's own lifted jit (nn.jit) on a function named like the region, NNX's split state in
# and the changed variables out (nnx.update). flax is looked up in sys.modules: a flax object
# exists only once flax is imported, and importing jmp_scaler imports no more of it.


def _linen() -> Any:
  return sys.modules.get("flax.linen")


def _nnx() -> Any:
  return sys.modules.get("flax.nnx")


def _is_linen(x: Any) -> bool:
  nn = _linen()
  return nn is not None and isinstance(x, nn.Module)


def _is_nnx(x: Any) -> bool:
  """Whether ``x`` is an NNX object with state: a module, ``nnx.Rngs``, a variable."""
  nnx = _nnx()
  return nnx is not None and isinstance(x, (nnx.Pytree, nnx.Variable))


def _is_variable(x: Any) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.Variable)


def _module_of(fun: Any) -> tuple[Any, str] | None:
  """``(module, method name)`` for a flax module or a method bound to one; else None."""
  if _is_linen(fun) or (_is_nnx(fun) and not _is_variable(fun)):
    return fun, "__call__"
  owner = getattr(fun, "__self__", None)
  if (_is_linen(owner) or _is_nnx(owner)) and hasattr(fun, "__name__"):
    return owner, fun.__name__
  return None


def _flax_objects(tree: Any) -> list:
  """The linen modules and NNX objects among the leaves of ``tree`` (NNX modules are
  pytrees: each is taken whole)."""
  leaves = jax.tree.leaves(tree, is_leaf=_is_nnx)
  return [x for x in leaves if _is_nnx(x) or _is_linen(x)]


def _module_name(module: Any) -> str:
  return getattr(module, "name", None) or type(module).__name__


def _scoped_rule(module: Any) -> str:
  """The scoped rule that keeps ``module``'s matmuls in float32 (its name is in its path)."""
  name = _module_name(module)
  if _is_linen(module) and module.scope is None:
    name = "<the module's name>"  # not named yet: the path holds the name it will get
  return f'rules={{("dot_general", r"{name}"): "float32"}}'


def _region_name(module: Any, method: str) -> str:
  kind = type(module).__name__
  return f"{FULL_PRECISION_MARK}({kind if method == '__call__' else f'{kind}.{method}'})"


def _named_like(wrapper: Callable, fun: Any) -> Callable:
  """``wrapper`` with ``fun``'s name and docstring (a module's class's), ``fun`` as its
  ``__wrapped__``; nothing of a module's own attributes."""
  functools.update_wrapper(wrapper, fun, ("__module__", "__name__", "__qualname__", "__doc__"), ())
  if not hasattr(fun, "__name__"):
    wrapper.__name__ = wrapper.__qualname__ = type(fun).__name__
  return wrapper


def _flat_call(args: tuple, kwargs: dict) -> list:
  """``[static, *arrays]`` of a call, as :func:`_named_jit` passes them to its ``jit``."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  mask = tuple(_dynamic(x) for x in leaves)
  static = _Static(treedef, mask, tuple(x for x, m in zip(leaves, mask, strict=True) if not m))
  return [static, *(x for x, m in zip(leaves, mask, strict=True) if m)]


def _refuse_captured_linen(fun: Any) -> None:
  """Raises for a function that closes over (or is a partial of) a bound linen module."""
  seen: list = []
  f = fun
  while isinstance(f, functools.partial):
    seen += [*f.args, *f.keywords.values()]
    f = f.func
  seen += [c.cell_contents for c in getattr(f, "__closure__", None) or () if _has_contents(c)]
  seen += [*(getattr(f, "__defaults__", None) or ()),
           *(getattr(f, "__kwdefaults__", None) or {}).values()]  # fmt: skip
  for x in seen:
    if _is_linen(x) and (x.scope is not None or _is_linen(x.parent)):
      raise ValueError(
        f"jmp_scaler.full_precision({_fun_name(fun)}) closes over the flax linen module "
        f"{_module_name(x)!r} ({type(x).__name__}): a jit inside a linen module cannot create "
        "or update its variables (they would leak out as tracers). Pass the module, or a "
        "method of it, instead of a function that calls it (jmp_scaler.full_precision("
        "self.head)(x), jmp_scaler.full_precision(self.embed.attend)(x)), or keep the model "
        f"as it is and give jmp_scaler.autocast the scoped rule {_scoped_rule(x)}"
      )


def _has_contents(cell: Any) -> bool:
  try:
    cell.cell_contents  # noqa: B018
  except ValueError:  # an empty cell: a variable not assigned yet
    return False
  return True


def _refuse_linen_argument(fun: Any, module: Any) -> None:
  raise ValueError(
    f"jmp_scaler.full_precision({_fun_name(fun)}) was given the flax linen module "
    f"{_module_name(module)!r} ({type(module).__name__}) as an argument: a jit inside a linen "
    "module cannot create or update its variables (they would leak out as tracers). Pass the "
    "module, or a method of it, instead of a function that calls it (jmp_scaler.full_precision("
    "self.head)(x), jmp_scaler.full_precision(self.embed.attend)(x)), or keep the model as it "
    f"is and give jmp_scaler.autocast the scoped rule {_scoped_rule(module)}"
  )


def _linen_region(fun: Any, module: Any, method: str) -> Callable:
  """A linen module's method as a region: the plain call under ``init`` (the plain module's
  variables, values included), ``nn.jit`` of a function named like the region otherwise."""
  if module.scope is None:
    where = ("created in setup without being assigned to an attribute; assign it "
             f"(self.head = {type(module).__name__}(...)) and wrap it where it is called, "
             "jmp_scaler.full_precision(self.head)(x)" if _is_linen(module.parent) else
             "not bound to a parent module (created outside a module's setup or compact "
             "method); wrap a submodule inside the parent's method, or what runs the whole "
             "model: jmp_scaler.full_precision(model.apply)")  # fmt: skip
    raise ValueError(
      f"jmp_scaler.full_precision({type(module).__name__}): the flax linen module "
      f"{_module_name(module)!r} is {where}; or keep the model as it is and give "
      f"jmp_scaler.autocast the scoped rule {_scoped_rule(module)}"
    )
  nn = _linen()

  def run(mdl, static, *dyn):
    args, kwargs = static.rebuild([_widen(x) for x in dyn])
    return getattr(mdl, method)(*args, **kwargs)

  run.__name__ = run.__qualname__ = _region_name(module, method)
  lifted = nn.jit(run, static_argnums=1)

  def wrapper(*args, **kwargs):
    if module.is_initializing():
      return getattr(module, method)(*args, **kwargs)
    return lifted(module, *_flat_call(args, kwargs))

  return _named_like(wrapper, fun)


def _nnx_region(fun: Any, module: Any, method: str | None) -> Callable:
  """``module.method(*args, **kwargs)`` (``fun(*args, **kwargs)`` when ``module`` is None)
  as a region: the state of the module and of the NNX objects among the arguments goes in,
  the variables the call changes (or creates) come out and are written back."""
  nnx = _nnx()

  def call(mdl, args, kwargs):
    return fun(*args, **kwargs) if method is None else getattr(mdl, method)(*args, **kwargs)

  def body(static, *dyn):
    (graphdef, state), _ = static.rebuild(dyn)
    node = nnx.merge(graphdef, state)
    before = {p: _value(v) for p, v in nnx.to_flat_state(nnx.state(node))}
    mdl, args, kwargs = node
    args, kwargs = jax.tree.map(lambda x: x if _is_nnx(x) else _widen(x), (args, kwargs),
                                is_leaf=_is_nnx)  # fmt: skip
    out = call(mdl, args, kwargs)
    changed = [(p, v) for p, v in nnx.to_flat_state(nnx.state(node))
               if isinstance(v, nnx.Variable) and before.get(p, _UNSET) is not _value(v)]
    return out, nnx.from_flat_state(changed)

  name = (_region_name(module, method) if method is not None else
          f"{FULL_PRECISION_MARK}({_fun_name(fun)})")  # fmt: skip
  jitted = _named_jit(body, body, name)

  def wrapper(*args, **kwargs):
    node = (module, args, kwargs)
    graphdef, state = nnx.split(node)
    out, changed = jitted(graphdef, state)
    nnx.update(node, changed)
    return out

  return _named_like(wrapper, fun)


_UNSET = object()


def _value(v: Any) -> Any:
  nnx = _nnx()
  return v.get_value() if isinstance(v, nnx.Variable) else v


DEFAULT_RULES = R.DEFAULT_RULES
