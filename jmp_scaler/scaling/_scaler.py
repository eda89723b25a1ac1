"""Loss scaling as an Optax gradient transformation.

One state type, three factories: :func:`dynamic_scale` (PyTorch's GradScaler
rule, plus bounds and hysteresis), :func:`fixed_scale` and :func:`no_scale`.
All three produce a :class:`LossScaleState` of the same structure and dtypes,
so switching modes changes neither checkpoints nor compiled shapes.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jmp_scaler import _validation as validation
from jmp_scaler._leaves import floating_leaves, is_floating, math_dtype, on_cpu, row_major
from jmp_scaler.jaxcompat._tracing import reaches
from jmp_scaler.scaling._position import check_head

_F32 = validation.F32
#: Default lower bound of the scale: the smallest normal float32, so ``1/scale``
#: stays finite. The scale may go below 1 (a floor of 1 can stall training: docs).
DEFAULT_MIN_SCALE = float(_F32.tiny)
#: Default upper bound of the scale: the largest float32 (PyTorch has no bound;
#: like PyTorch, a growth whose result is not finite is refused).
DEFAULT_MAX_SCALE = float(_F32.max)

#: Extra-argument name through which :class:`jmp_scaler.TrainState` and
#: :func:`jmp_scaler.skip_nonfinite` hand their finiteness decision to the
#: scaler inside ``tx.update`` (so the gradients are read once, not twice).
FINITE_KEY = "jmp_scaler_all_finite"
#: Extra-argument name through which :func:`jmp_scaler.accumulate_gradients` hands the
#: scaler, with the unscaled mean of a window, the micro-batch gradients it was given and
#: the scale it unscaled them by: what the check of scaled gradients reads.
SCALED_BY_KEY = "jmp_scaler_scaled_by"


class ScaleConfig(struct.PyTreeNode):
  """The scaler's configuration, recorded in its state.

  The numeric fields are float32/int32 scalar leaves: they are saved with every
  checkpoint (as PyTorch's ``GradScaler.state_dict`` saves its factors) and the
  update rule reads them from the state, so a restored run continues with the
  configuration it was saved with. ``axis_name`` and ``skip_mode`` are static
  (part of the tree structure, never leaves): they describe the program, not
  the training run.
  """

  growth_factor: jax.Array
  backoff_factor: jax.Array
  growth_interval: jax.Array
  min_scale: jax.Array
  max_scale: jax.Array
  hysteresis: jax.Array
  axis_name: Hashable | None = struct.field(pytree_node=False, default=None)
  skip_mode: str = struct.field(pytree_node=False, default="auto")


class LossScaleState(NamedTuple):
  """State of :func:`dynamic_scale`, :func:`fixed_scale` and :func:`no_scale`.

  Every leaf is a scalar with a fixed dtype, so jitted steps never retrace.

  Attributes:
    scale: current loss scale, float32, always positive, finite and within
      ``[config.min_scale, config.max_scale]``.
    growth_tracker: consecutive finite steps since the last growth or
      overflow (int32, PyTorch's ``_growth_tracker``).
    hysteresis_tracker: overflows still tolerated before the next backoff
      (int32); refilled to ``config.hysteresis`` on every growth.
    skipped: whether the last update was skipped (bool).
    consecutive_skips: skipped updates in a row (int32, saturating).
    total_skips: skipped updates since init (int32, saturating).
    steps: updates seen since init, skipped or not (int32, saturating).
    config: the recorded :class:`ScaleConfig`.
  """

  scale: jax.Array
  growth_tracker: jax.Array
  hysteresis_tracker: jax.Array
  skipped: jax.Array
  consecutive_skips: jax.Array
  total_skips: jax.Array
  steps: jax.Array
  config: ScaleConfig


SKIP_MODES = ("auto", "cond", "select")

#: Warned once per process, at the first update (trace) of a scaler that no
#: exact-skip wrapper handed a decision (``bare=True`` says that it is intended).
BARE_WARNING = (
    "the loss scaler is used bare (no jmp_scaler.NNXOptimizer, jmp_scaler.TrainState, "
    "jmp_scaler.skip_nonfinite or jmp_scaler.accumulate_gradients around the chain): on an "
    "overflow the rest of the chain still runs on zero gradients, so e.g. Adam's count and "
    "moments move and the step is not skipped exactly. Use one of those wrappers (a plain "
    "nnx.Optimizer is bare: use jmp_scaler.NNXOptimizer), or pass bare=True to the scaler's "
    "factory if that is intended."
)
_BARE_WARNED: list[bool] = []  # non-empty once the warning was given


# --------------------------------------------------------------------------
# The factories.


class LossScaler(optax.GradientTransformationExtraArgs):
  """The transformation :func:`dynamic_scale`, :func:`fixed_scale` and :func:`no_scale`
  return: an ``optax.GradientTransformationExtraArgs`` (``init``, ``update``) whose repr
  says which scaler it is, with its configuration (``print(policy.loss_scaler())``)."""

  __slots__ = ()

  def __repr__(self) -> str:
    return getattr(self.init, "description", "jmp_scaler loss scaler")


#: The factories' defaults: :func:`_describe` shows the arguments that differ from them.
_DEFAULTS: dict[str, Any] = dict(
    growth_factor=2.0, backoff_factor=0.5, min_scale=float(np.float32(DEFAULT_MIN_SCALE)),
    max_scale=float(np.float32(DEFAULT_MAX_SCALE)), hysteresis=1, skip_mode="auto",
    axis_name=None, check_scaled=True)


def _describe(name: str, kwargs: dict[str, Any], bare: bool, first: bool = True) -> str:
  """``dynamic_scale(init_scale=65536.0, growth_interval=2000)``: the arguments that
  differ from the factory's defaults, as a user would write them (the first always: the
  scale and, for ``dynamic_scale``, the interval)."""
  items = list(kwargs.items())
  always = 2 if name == "dynamic_scale" else int(first)
  shown = items[:always] + [(k, v) for k, v in items[always:] if v != _DEFAULTS.get(k)]
  if bare:
    shown.append(("bare", True))
  return f"{name}({', '.join(f'{k}={v!r}' for k, v in shown)})"


def _transformation(
    *,
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float,
    max_scale: float,
    hysteresis: int,
    axis_name: Hashable | None,
    skip_mode: str,
    bare: bool,
    check: bool,
    description: str,
) -> LossScaler:
  """Builds the transformation from validated values."""
  validation.warn_on_fast_math(stacklevel=4)

  def init_fn(params):
    del params
    check_head("the loss scaler")
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return LossScaleState(
        scale=f32(init_scale),
        growth_tracker=i32(0),
        hysteresis_tracker=i32(hysteresis),
        skipped=jnp.asarray(False),
        consecutive_skips=i32(0),
        total_skips=i32(0),
        steps=i32(0),
        config=ScaleConfig(
            growth_factor=f32(growth_factor),
            backoff_factor=f32(backoff_factor),
            growth_interval=i32(growth_interval),
            min_scale=f32(min_scale),
            max_scale=f32(max_scale),
            hysteresis=i32(hysteresis),
            axis_name=axis_name,
            skip_mode=skip_mode,
        ),
    )

  def update_fn(updates, state, params=None, **extra_args):
    refuse_partial_updates(updates)
    decided = extra_args.get(FINITE_KEY)
    if check:  # the gradients as the step computed them, and the scale the step read
      grads, scale = extra_args.get(SCALED_BY_KEY, (updates, state.scale))
      check_scaled(grads, scale, params)
    updates = row_major(updates)  # a no-op where a wrapper did it already
    if decided is None and not bare and not _BARE_WARNED:
      _BARE_WARNED.append(True)
      warnings.warn(BARE_WARNING, UserWarning, stacklevel=3)
    finite = decision(updates, state, extra_args)
    unscaled = unscale(updates, state.scale)
    if decided is not True:
      # Without an exact-skip wrapper the rest of the chain runs anyway: give it
      # zeros rather than inf/NaN, so no non-finite value reaches its state.
      unscaled = jax.tree.map(
          lambda u: jnp.where(finite, u, jnp.zeros_like(u)) if is_floating(u) else u,
          unscaled,
      )
    return unscaled, next_state(state, finite)

  init_fn.description = description  # type: ignore[attr-defined]
  return LossScaler(init_fn, update_fn)


def dynamic_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    *,
    min_scale: float = DEFAULT_MIN_SCALE,
    max_scale: float = DEFAULT_MAX_SCALE,
    hysteresis: int = 1,
    axis_name: Hashable | None = None,
    skip_mode: str = "auto",
    bare: bool = False,
    check_scaled: bool = True,
) -> LossScaler:
  """Dynamic loss scaling, step for step PyTorch's ``torch.amp.GradScaler``.

  Put it at the head of a chain and multiply the loss by
  :func:`jmp_scaler.get_scale` before taking gradients. Each update divides
  the gradients by the scale, decides whether every element of every floating
  leaf is finite (after unscaling), and adapts the scale::

    if not all_finite(grads / scale):       # the step is skipped
      growth_tracker = 0
      hysteresis_tracker = max(hysteresis_tracker - 1, 0)
      if hysteresis_tracker == 0: scale = max(scale * backoff_factor, min_scale)
    else:
      growth_tracker += 1
      if growth_tracker == growth_interval:
        if isfinite(scale * growth_factor):
          scale = min(scale * growth_factor, max_scale)
        growth_tracker = 0; hysteresis_tracker = hysteresis

  With the defaults (``hysteresis=1``, bounds at the edges of float32) this is
  exactly GradScaler's ``_amp_update_scale_`` rule (``docs/migration.md``
  compares it with the other scalers).

  For an exact skip (parameters and every downstream optimizer state
  bit-identical on an overflow) apply the chain through
  :class:`jmp_scaler.TrainState` or wrap it with
  :func:`jmp_scaler.skip_nonfinite`. Used bare in a plain ``optax`` loop the
  scaler hands zeros to the rest of the chain on an overflow: no inf or NaN
  reaches its state, but e.g. Adam's moments decay and its count advances;
  the first such update warns (once per process), unless ``bare=True`` says
  that this is intended.

  Args:
    init_scale: initial scale; positive and finite in float32.
    growth_factor: multiplier applied on growth; > 1.
    backoff_factor: multiplier applied on overflow; in (0, 1).
    growth_interval: consecutive finite steps between growths; >= 1.
    min_scale: lower bound of the scale (default: smallest normal float32,
      so the scale can fall below 1 and ``1/scale`` stays finite).
    max_scale: upper bound of the scale (default: largest float32).
    hysteresis: overflows tolerated before backing off (Megatron-LM and
      DeepSpeed's ``hysteresis``), refilled on growth; 1 is PyTorch.
    axis_name: mapped axis name(s) (``shard_map``/``pmap``) over which each
      device holds only its shard of the gradients; the finiteness decision is
      reduced over them so every device skips together and keeps one scale.
    skip_mode: how :class:`jmp_scaler.TrainState`,
      :func:`jmp_scaler.skip_nonfinite`, :class:`jmp_scaler.NNXOptimizer` and
      :func:`jmp_scaler.accumulate_gradients` skip: ``"select"`` always runs
      the optimizer and keeps the old values with ``jnp.where``, leaf by leaf
      as the chain makes them (no branch, no extra memory); ``"cond"`` runs it
      under ``lax.cond`` (nothing is computed on a skip, but XLA:GPU copies the
      predicate to the host and waits for the stream, unless conditionals are
      put in command buffers, and on the pure-Optax path the updates cross the
      branch in a buffer of their own). ``"auto"``, by the platform the step
      is compiled for (``jax.lax.platform_dependent``, so a step compiled for
      a TPU from a CPU host, or exported for several platforms, gets each
      platform's own): ``"select"`` on GPU and CPU; ``"cond"`` on TPU and in
      ``accumulate_gradients`` with ``every_k > 1`` (the optimizer runs on one
      call in ``every_k``) (docs/performance.md).
      Both modes take the same decision and skip the same steps; a skipped step leaves the
      parameters and every optimizer state but the scaler's bit-identical, and
      the scaler's state is bit-identical between the modes. Applied steps
      agree to rounding, not bit for bit: XLA fuses a conditional's branch
      differently from a select, and XLA:CPU contracts multiply-adds into FMAs
      as it fuses, so a few elements may differ in the last bit.
    bare: say that the scaler is used bare on purpose (a plain ``tx.update``
      or ``nnx.Optimizer``, no exact-skip wrapper): silences the warning that
      the first bare update gives otherwise (once per process). Static
      configuration, not state.
    check_scaled: check, when the step is traced, that the gradients handed to
      the scaler were computed from the loss times its scale: gradients
      computed in the jitted step from the parameters but not from the scale
      (``jax.grad`` or ``nnx.value_and_grad`` of the unscaled loss, a
      trainer's own step) raise a ``ValueError`` at the first trace, since the
      scaler would divide them by 2**16 (docs/scaler.md, "Gradients that were
      never scaled"). ``False`` turns the check off, for gradients scaled by a
      route it cannot follow. Static configuration, not state.

  Returns:
    A :class:`LossScaler` (an ``optax.GradientTransformationExtraArgs`` whose
    repr names the scaler and its configuration) whose state is a
    :class:`LossScaleState`.

  Raises:
    ValueError: naming the argument and its value, for any invalid setting.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jmp_scaler
    >>> tx = optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(0.1))
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> float(jmp_scaler.get_scale(state))
    65536.0
    >>> grads = {"w": jnp.array([jnp.inf, 1.0, 1.0])}
    >>> _, state = tx.update(grads, state)
    >>> float(jmp_scaler.get_scale(state))
    32768.0

  References:
    Micikevicius et al., 2018, Mixed Precision Training
    (https://arxiv.org/abs/1710.03740).
  """
  init = validation.positive_f32("init_scale", init_scale)
  growth = validation.factor("growth_factor", growth_factor, above_one=True)
  backoff = validation.factor("backoff_factor", backoff_factor, above_one=False)
  interval = validation.integer("growth_interval", growth_interval, 1)
  lo = validation.positive_f32("min_scale", min_scale)
  hi = validation.positive_f32("max_scale", max_scale)
  if lo > hi:
    raise ValueError(
        f"min_scale must not exceed max_scale, got min_scale={min_scale!r} "
        f"and max_scale={max_scale!r}"
    )
  if not lo <= init <= hi:
    raise ValueError(
        f"init_scale must lie in [min_scale, max_scale] = [{lo!r}, {hi!r}], "
        f"got {init_scale!r}"
    )
  return _transformation(
      init_scale=init,
      growth_factor=growth,
      backoff_factor=backoff,
      growth_interval=interval,
      min_scale=lo,
      max_scale=hi,
      hysteresis=validation.integer("hysteresis", hysteresis, 1),
      axis_name=validation.axis_name(axis_name),
      skip_mode=validation.one_of("skip_mode", skip_mode, SKIP_MODES),
      bare=validation.boolean("bare", bare),
      check=validation.boolean("check_scaled", check_scaled),
      description=_describe("dynamic_scale", dict(
          init_scale=init, growth_interval=interval, growth_factor=growth,
          backoff_factor=backoff, min_scale=lo, max_scale=hi, hysteresis=hysteresis,
          skip_mode=skip_mode, axis_name=axis_name, check_scaled=check_scaled), bare),
  )


def fixed_scale(
    scale: float,
    *,
    axis_name: Hashable | None = None,
    skip_mode: str = "auto",
    bare: bool = False,
    check_scaled: bool = True,
) -> LossScaler:
  """A constant loss scale, with the same state as :func:`dynamic_scale`.

  For debugging, fix a small scale and compare with the dynamic run. Gradients are
  divided by ``scale`` and non-finite steps are still skipped (and counted),
  but the scale never changes. The state has the same structure and dtypes
  as :func:`dynamic_scale`'s, so checkpoints and compiled steps are shared.

  Args:
    scale: the constant scale; positive and finite in float32.
    axis_name: as in :func:`dynamic_scale`.
    skip_mode: as in :func:`dynamic_scale`.
    bare: as in :func:`dynamic_scale`.
    check_scaled: as in :func:`dynamic_scale` (a scale of 1 has nothing to check).

  Returns:
    A :class:`LossScaler` (an ``optax.GradientTransformationExtraArgs`` whose
    repr names the scaler and its configuration) whose state is a
    :class:`LossScaleState`.
  """
  s = validation.positive_f32("scale", scale)
  check = validation.boolean("check_scaled", check_scaled)
  description = _describe("fixed_scale", dict(
      scale=s, skip_mode=skip_mode, axis_name=axis_name, check_scaled=check), bare)
  return _fixed(s, axis_name, skip_mode, bare, check and s != 1.0, description)


def _fixed(s: float, axis_name: Hashable | None, skip_mode: str, bare: bool, check: bool,
           description: str) -> LossScaler:
  """The constant scale ``s`` (validated), for :func:`fixed_scale` and :func:`no_scale`."""
  return _transformation(
      init_scale=s,
      growth_factor=1.0,
      backoff_factor=1.0,
      growth_interval=int(np.iinfo(np.int32).max),
      min_scale=s,
      max_scale=s,
      hysteresis=1,
      axis_name=validation.axis_name(axis_name),
      skip_mode=validation.one_of("skip_mode", skip_mode, SKIP_MODES),
      bare=validation.boolean("bare", bare),
      check=check,
      description=description,
  )


def no_scale(
    *, axis_name: Hashable | None = None, skip_mode: str = "auto", bare: bool = False
) -> LossScaler:
  """Loss scaling turned off (PyTorch's ``GradScaler(enabled=False)``).

  ``fixed_scale(1.0)``: the loss is not scaled, but non-finite steps are still
  skipped and counted, and the state matches :func:`dynamic_scale`'s.
  """
  description = _describe(
      "no_scale", dict(skip_mode=skip_mode, axis_name=axis_name), bare, first=False)
  return _fixed(1.0, axis_name, skip_mode, bare, False, description)


UNSCALED = (
  "the loss scaler was handed gradients of the unscaled loss: they were computed from the "
  "parameters but not from the loss scale (jax.grad, nnx.value_and_grad or a framework's own "
  "train step, with no '* scale'). The scaler divides them by its scale (2**16 at the start), "
  "so every update would be that many times too small, and float16 gradients underflow "
  "unscaled. Take the gradients with jmp_scaler.value_and_grad(loss_fn, state)(...) (state: "
  "the TrainState, the NNX optimizer or the opt_state), or multiply the loss by "
  "jmp_scaler.get_scale(opt_state) (TrainState.loss_scale, NNXOptimizer.loss_scale) before "
  "differentiating. A trainer that computes its own gradients from the unscaled loss needs "
  "its loss scaled, or jmp_scaler.no_scale() (bfloat16, float32) in place of the scaler. If "
  "these gradients are scaled by a route this check cannot follow, pass check_scaled=False "
  "to the scaler's factory."
)


def check_scaled(grads: Any, scale: Any, params: Any) -> None:
  """Raises ``ValueError`` if ``grads`` were certainly computed from ``params`` without ``scale``.

  Gradients of the *unscaled* loss (``jax.grad``, ``nnx.value_and_grad`` or a framework's
  own train step, with no ``* scale``) would be divided by the scale (2^16 at the start):
  updates 65536 times too small, which Adam hides (its update hardly depends on the
  gradients' size), and float16 gradients that underflowed before the scaler saw them. The
  scale is a value of the optimizer state, so gradients of the scaled loss are computed from
  it: when the step is traced, the walk back from the gradients
  (:func:`jmp_scaler.jaxcompat._tracing.reaches`) tells. It raises only when it is certain:
  the gradients were computed in the traced step from ``params`` (the parameters the
  optimizer was handed) and not from ``scale`` (the state's own leaf, the object the step
  read). Gradients that are inputs of the traced function (computed by another jitted
  function), made up or read back from an accumulator (not computed from the parameters),
  concrete arrays (an eager step), or ``params=None``: nothing can be said, nothing is
  (docs/scaler.md, "Gradients that were never scaled").

  Called by the scaler's update, once per trace; under an exact-skip wrapper that update is
  traced with the gradients and state the wrapper was handed (closed over by its
  ``make_jaxpr``), and under ``accumulate_gradients`` it is handed each micro-batch's
  gradients and scale (:data:`SCALED_BY_KEY`).
  """
  if params is None:
    return
  reach = reaches(floating_leaves(grads), scale, floating_leaves(params))
  if reach.known and reach.others and not reach.target:
    raise ValueError(UNSCALED)


# --------------------------------------------------------------------------
# The pieces of the update, shared with TrainState and skip_nonfinite.

def reciprocal(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(pre, inv)`` with ``g * pre * inv == g * (1 / scale)`` and both factors normal.

  Above ``2**126`` the reciprocal of a float32 scale is subnormal, and
  XLA:CPU flushes it to zero (it also rewrites ``g / scale`` into
  ``g * (1 / scale)``): every gradient would become 0. Above ``2**63`` the
  scale is split into ``2**64 * (scale / 2**64)``; both factors are powers of
  two times a normal reciprocal, so the product is the same correctly rounded
  ``g * (1 / scale)`` (for a power-of-two scale: exactly ``g / scale``).

  ``pre`` is taken by a division, like ``inv``: XLA computes a division once and
  hands its result to every kernel that reads it, where a select of two constants
  (``where(big, 2**-64, 1)``) is cheap enough to be recomputed, with its comparison
  and constants, inside each of them: about 3 kernels a leaf (the check, Adam's two
  moments), 800 HLO instructions at 64 leaves (docs/performance.md).
  """
  big = scale > 2.0**63
  pre = jnp.float32(1.0) / jnp.where(big, jnp.float32(2.0**64), jnp.float32(1.0))
  return pre, 1.0 / (scale * pre)


def unscale_leaf(
    g: jax.Array, pre: jax.Array, inv: jax.Array, dtype: Any = None
) -> jax.Array:
  """``g * pre * inv`` (:func:`reciprocal`'s factors) in ``dtype``, by default in at
  least float32 and cast back to ``g``'s dtype."""
  m = math_dtype(g.dtype) if dtype is None else dtype
  return ((g.astype(m) * pre.astype(m)) * inv.astype(m)).astype(g.dtype if dtype is None else m)


def unscale(grads: Any, scale: jax.Array) -> Any:
  """Divides every floating (or complex) leaf by ``scale`` in at least float32, keeping its dtype.

  Exact for every scale in ``[min_scale, max_scale]``, up to the largest
  float32: the reciprocal is taken in two normal factors (a plain ``1 / scale``
  is subnormal above ``2**126``, and XLA:CPU flushes it to zero).
  """
  pre, inv = reciprocal(jnp.asarray(scale, jnp.float32))
  return jax.tree.map(lambda g: unscale_leaf(g, pre, inv) if is_floating(g) else g, grads)


# Leaves of up to GROUP_BELOW elements that share a shape are checked together, by one
# reduction of their elementwise ``and`` (XLA:CPU, one device): GROUP_SIZE at a time, and at
# most GROUP_ELEMENTS elements (2 MiB of float32) a group.
GROUP_BELOW = 2**16
GROUP_SIZE = 32
GROUP_ELEMENTS = 2**19


def _check_groups(leaves: list[jax.Array]) -> list[list[jax.Array]]:
  """The leaves checked by one reduction together, on one XLA:CPU device (:func:`all_finite`
  uses it there only, each leaf on its own elsewhere).

  There the leaves of one shape of up to ``GROUP_BELOW`` elements go to groups of
  ``GROUP_SIZE`` leaves and at most ``GROUP_ELEMENTS`` elements (32 leaves of 2^14
  elements, 16 of 181x181), checked as ``all(isfinite(u1) & isfinite(u2) & ...)``:
  exactly the conjunction of their own checks, in one fused kernel and one reduction
  instead of three kernels a leaf. On such leaves those kernels cost more to launch and
  to compile than to run (docs/performance.md, "The finiteness check"). Larger leaves
  keep their own reduction, which reads each one as soon as the backward pass has
  written it.
  """
  groups: list[list[jax.Array]] = []
  small: dict[tuple[int, ...], list[jax.Array]] = {}  # the leaves of one shape
  for g in leaves:
    if g.size > GROUP_BELOW:
      groups.append([g])
    else:
      small.setdefault(g.shape, []).append(g)
  for same in small.values():
    k = max(1, min(GROUP_SIZE, GROUP_ELEMENTS // max(same[0].size, 1)))
    groups += [same[i : i + k] for i in range(0, len(same), k)]
  return groups


def all_finite(grads: Any, state: LossScaleState) -> jax.Array:
  """Whether every floating leaf of ``grads / state.scale`` is finite.

  One read of the gradients: the unscaling is fused into one reduction per
  leaf (or per group of small leaves), so the unscaled tree is never
  materialised, and an overflow of the unscaling itself (a float16 gradient
  divided by a scale below 1) counts as non-finite. Complex leaves count as
  non-finite when either part is. Non-floating leaves and ``None`` are ignored. With
  ``state.config.axis_name`` set, the decision is reduced over those mapped
  axes: every device returns the same value.

  The per-leaf reduction is ``all(isfinite(u))`` (a max-reduction would not
  do: XLA:CPU's drops NaN from 4096 elements up). On XLA:CPU the callers hand
  it the gradients laid out row-major (:func:`jmp_scaler._leaves.row_major`),
  so it reads each one in order. (A ``sum(u - u)`` reduction was faster on a
  gradient left as its dot wrote it; on row-major ones it is slower: x0.56-0.71
  against x0.51-0.52 per step, +12.0 against +4.8 MiB, on 8 leaves of
  1024x1024, docs/performance.md.) On one XLA:CPU device, small leaves of one shape are
  checked together, a group at a time (:func:`_check_groups`). The flags are combined by one
  ``min``-reduction over an int32 vector, which XLA keeps as one materialised
  value: combined as ``all(stack(flags))`` (or a sum of partial sums) XLA
  rewrites them into a chain of scalar ops and copies that chain into every
  kernel that reads the decision, so compile time grew with the square of
  the leaf count (docs/performance.md). The check does not
  survive fast-math flags, which let XLA assume that no inf or NaN exists
  (:func:`dynamic_scale` warns).

  The check multiplies by one factor, ``pre * inv`` (the float32 ``1 / scale``,
  subnormal or flushed to zero above ``2**126``), where the unscaling multiplies by
  two: the decision is the same. Up to ``2**63`` the factors are the same (``pre ==
  1``); above it the factor is below 1, so a finite gradient stays finite (as it
  does unscaled), and an inf or NaN stays non-finite (``inf * 0`` is NaN). One
  multiply a leaf fewer.
  """
  pre, inv = reciprocal(state.scale)
  one = pre * inv

  def isfinite(g):  # unscaled in at least float32, cast back: its overflow counts too
    return jnp.isfinite((g.astype(math_dtype(g.dtype)) * one).astype(g.dtype))

  def check(groups: list[list[jax.Array]]) -> jax.Array:
    flags = [jnp.all(functools.reduce(jnp.logical_and, map(isfinite, g))) for g in groups]
    if not flags:
      return jnp.asarray(True)
    # The int32 vector is materialised once; its comparison and ``all`` give a bool that
    # the selects read as it is (a ``min(...) > 0`` put a comparison in each of them).
    return jnp.all(jnp.stack(flags).astype(jnp.int32) > 0)

  # Grouped where the step is lowered for one XLA:CPU device, each leaf on its own elsewhere.
  leaves = floating_leaves(grads)
  finite = on_cpu(leaves, lambda xs: check(_check_groups(xs)),
                  lambda xs: check([[g] for g in xs])) if leaves else jnp.asarray(True)
  axes = state.config.axis_name
  if axes is not None:
    bad = jax.lax.psum(jnp.logical_not(finite).astype(jnp.int32), axes)
    finite = bad == 0
  return finite


def decision(updates: Any, state: LossScaleState, extra_args: dict[str, Any]) -> Any:
  """The finiteness decision an outer wrapper handed down through ``extra_args``
  (:data:`FINITE_KEY`), or, without one, :func:`all_finite` of ``updates``."""
  decided = extra_args.get(FINITE_KEY)
  return all_finite(updates, state) if decided is None else decided


class Decision(NamedTuple):
  """What the skip asks the scaler, once per step (:func:`decide`)."""

  finite: Any  #: apply the step: a bool array, or ``True`` handed down by an outer wrapper
  grads: Any  #: the gradients as the check read them (:func:`row_major`), for the chain
  skipped: LossScaleState  #: the scaler's state after a skipped step (backed off)


def decide(grads: Any, state: LossScaleState, extra_args: dict[str, Any]) -> Decision:
  """The finiteness decision for ``grads`` and the state a skip would leave.

  The gradients come back :func:`row_major`: the check and the chain both read
  those. A decision handed down through ``extra_args`` is reused
  (:func:`decision`).
  """
  grads = row_major(grads)
  return Decision(decision(grads, state, extra_args), grads, next_state(state, False))


def refuse_partial_updates(updates: Any) -> None:
  """Raises if the scaler receives only part of the gradients (``optax.MaskedNode`` leaves).

  Inside one branch of ``optax.multi_transform`` (or under ``optax.masked``)
  the scaler would unscale its own parameters only: the others would reach
  their optimizer still multiplied by the scale.
  """
  is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  if any(is_masked(x) for x in jax.tree.leaves(updates, is_leaf=is_masked)):
    raise ValueError(
        "the loss scaler receives only part of the gradients (it sits inside "
        "optax.multi_transform, optax.partition or optax.masked), so the other parameters "
        "would be updated with gradients still multiplied by the loss scale. Put the scaler "
        "at the head of the whole chain: optax.chain(jmp_scaler.dynamic_scale(), "
        "optax.multi_transform(...))"
    )


def next_state(state: LossScaleState, finite: jax.Array | bool) -> LossScaleState:
  """The scaler's state after an update whose gradients were ``finite`` (a traced bool, or a
  Python one where the outcome is known)."""
  c = state.config
  finite = jnp.asarray(finite, jnp.bool_)
  # A finite step: count it, grow on the growth_interval-th.
  counted = state.growth_tracker + 1
  at_interval = counted >= c.growth_interval
  candidate = state.scale * c.growth_factor
  grown = jnp.where(
      jnp.isfinite(candidate), jnp.minimum(candidate, c.max_scale), state.scale
  )
  # An overflow: back off once hysteresis is used up.
  tolerance = jnp.maximum(state.hysteresis_tracker - 1, 0)
  backed_off = jnp.where(
      tolerance == 0,
      jnp.maximum(state.scale * c.backoff_factor, c.min_scale),
      state.scale,
  )
  scale = jnp.where(finite, jnp.where(at_interval, grown, state.scale), backed_off)
  growth_tracker = jnp.where(finite & ~at_interval, counted, 0)
  hysteresis_tracker = jnp.where(
      finite, jnp.where(at_interval, c.hysteresis, state.hysteresis_tracker),
      tolerance,
  )
  return LossScaleState(
      scale=scale.astype(jnp.float32),
      growth_tracker=growth_tracker.astype(jnp.int32),
      hysteresis_tracker=hysteresis_tracker.astype(jnp.int32),
      skipped=jnp.logical_not(finite),
      consecutive_skips=jnp.where(
          finite, 0, optax.safe_increment(state.consecutive_skips)
      ).astype(jnp.int32),
      total_skips=jnp.where(
          finite, state.total_skips, optax.safe_increment(state.total_skips)
      ).astype(jnp.int32),
      steps=optax.safe_increment(state.steps).astype(jnp.int32),
      config=c,
  )
