"""Exact skipping of non-finite steps for a whole optimizer chain.

A chain head cannot undo what the transformations after it do, so the skip is
taken around the chain: the finiteness decision is made first (one read of
the gradients), then either ``lax.cond`` runs the whole chain or leaves every
state untouched except the scaler's own, which backs off; or (``"select"``
mode) the chain always runs and a fused ``jnp.where`` keeps the old values,
each output chosen as the chain makes it (:func:`apply_or_skip`).

A gradient's way, top to bottom: the caller (:func:`skip_nonfinite`,
``TrainState.apply_gradients``, ``NNXOptimizer.update``) asks :func:`plan_step`
once, which finds the scaler's state (``_lookup``) and asks the scaler
(``_scaler.decide``) for the decision and the state a skip leaves; then
:func:`apply_or_skip` runs the chain or keeps every old value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _source as S
from jmp_scaler.scaling._distributed import match_varying
from jmp_scaler.scaling._lookup import find_scale_state, replace_scale_state
from jmp_scaler.scaling._scaler import FINITE_KEY, LossScaleState, decide


class StepPlan(NamedTuple):
  """A step's way through the skip, decided before the chain runs (:func:`plan_step`)."""

  scaler: LossScaleState  #: the scaler's state found in ``opt_state``
  finite: Any  #: whether to apply the step
  grads: Any  #: the gradients to hand the chain (row-major)
  skipped_state: Any  #: ``opt_state`` after a skipped step: only the scaler's state moved


def plan_step(grads: Any, opt_state: Any, extra_args: dict[str, Any]) -> StepPlan | None:
  """The scaler in ``opt_state``, asked once for the decision and the skipped state.

  Returns ``None`` when ``opt_state`` holds no scaler. A decision already
  handed down through ``extra_args`` by an outer wrapper is reused.
  """
  scaler = find_scale_state(opt_state)
  if scaler is None:
    return None
  finite, grads, backed_off = decide(grads, scaler, extra_args)
  return StepPlan(scaler, finite, grads, replace_scale_state(opt_state, backed_off))


def noop_updates(shapes: Any) -> Any:
  """``-0.0`` in every leaf of ``shapes``: ``p + -0.0`` keeps every bit of every float."""
  return jax.tree.map(lambda s: jnp.full(s.shape, -0.0, s.dtype), shapes)


def skip_mode(scaler: LossScaleState | None, auto: str = "select") -> str:
  """How to skip: ``"cond"`` (``lax.cond``), ``"select"`` (a fused ``jnp.where``), or
  ``"platform"``: ``"cond"`` where the step is lowered for a TPU, ``"select"`` elsewhere.

  ``skip_mode="auto"`` stands for ``auto``: ``"cond"`` where the caller runs
  the chain on few of its calls (``accumulate_gradients``), else, for a
  step-by-step skip, by the platform the step is compiled for (decided when it is
  lowered, :func:`apply_or_skip`, not by the default backend when it is traced: a
  step compiled for a TPU from a CPU host gets the TPU's skip). TPU: ``"cond"``
  (its conditional runs on the device). GPU: ``"select"`` (XLA:GPU reads a
  conditional's predicate on the host). CPU: ``"select"``. With the gradients laid out row-major
  (:func:`jmp_scaler._leaves.row_major`) the two modes run a ``TrainState``
  step within the noise of each other from 8 to 1024 leaves, and on the
  pure-Optax path (:func:`skip_nonfinite`) a conditional also writes the
  updates to a buffer of their own before ``optax.apply_updates`` reads them
  (+15.8 MiB and x0.80-0.96 against x0.57-0.58 on 8 leaves of 1024x1024).
  docs/performance.md, has the figures. Without a scaler: ``"cond"``.
  """
  if scaler is None:
    return "cond"
  mode = scaler.config.skip_mode
  if mode != "auto":
    return mode
  return "cond" if auto == "cond" else "platform"


def apply_or_skip(
    scaler: LossScaleState | None,
    finite: jax.Array,
    apply: Callable[[Any], Any],
    skip: Callable[[Any], Any],
    auto: str = "select",
):
  """``apply(True)`` if ``finite`` else ``skip(shapes)``, without a host sync.

  ``apply(decision)`` runs the chain, handing ``decision`` to the scaler so
  that it does not read the gradients again; it is always called with
  ``True`` (in ``"select"`` mode too: the outer ``jnp.where`` discards a bad
  step, so the scaler need not mask every gradient), and traced once: its
  jaxpr gives the shapes and is then evaluated in place. ``skip`` receives
  the shapes of ``apply``'s outputs, and its outputs are made to match them:
  the dtypes (an inner transformation may change a state leaf's dtype on its
  first update, as Adam's moments of an integer leaf do; a Python number or
  a PRNG key in the state becomes an array of its type) and, inside
  ``shard_map``, the mesh axes along which they vary. In ``"cond"`` mode
  (also without a scaler) a ``lax.cond`` runs one of the two; in
  ``"select"`` mode both run and ``jnp.where`` keeps one, leaf by leaf, as
  each output is made (see :func:`_eval_selecting`). ``auto`` is the mode
  that ``skip_mode="auto"`` stands for (:func:`skip_mode`); by the platform, both
  are traced under ``jax.lax.platform_dependent`` and the one for the platform
  the step is lowered for is compiled.
  """
  closed, shapes = jax.make_jaxpr(lambda: apply(True), return_shape=True)()
  treedef = jax.tree.structure(shapes)
  run = J.run_closed(closed)

  def applied():
    return jax.tree.unflatten(treedef, run())

  def skip_typed():
    return jax.tree.map(match_varying, skip(shapes), shapes)

  def by_cond():
    return jax.lax.cond(finite, applied, skip_typed)

  def by_select():
    # jaxlib's PyTreeDef has no type stubs on jax 0.10 (mypy sees a name without attributes)
    kept = treedef.flatten_up_to(skip_typed())  # type: ignore[attr-defined]
    return jax.tree.unflatten(treedef, _eval_selecting(closed, finite, kept))

  mode = skip_mode(scaler, auto)
  if mode == "platform":
    return jax.lax.platform_dependent(tpu=by_cond, default=by_select)
  return by_cond() if mode == "cond" else by_select()


def _eval_selecting(closed: Any, finite: jax.Array, kept: list) -> list:
  """Evaluates ``closed`` choosing each output as it is made: ``where(finite, new, kept)``.

  The chain's later equations then read the chosen value (the same bits
  when ``finite``; when not, every output is the kept one whatever they
  compute). Selecting only at the end made XLA:CPU, which does not fuse the
  selects of one leaf's parameter and moments into one kernel, recompute
  the new moments from the old ones inside the parameter update after the
  moments' select had overwritten them in place, so it copied every moment
  first (two float32 copies of the parameters for Adam, and x1.8-2.4 per step).
  Selected as it is made, each moment is written once, in place, and read
  back by the parameter update, as in a step without a scaler.
  """
  jaxpr = closed.jaxpr
  is_var = lambda v: not J.is_literal(v)  # noqa: E731
  outvars = [v for v in jaxpr.outvars if is_var(v)]
  at = {v: i for i, v in enumerate(jaxpr.outvars) if is_var(v) and outvars.count(v) == 1}
  env: dict[Any, Any] = {}  # what the later equations read
  chosen: dict[Any, Any] = {}  # the selected outputs

  def write(v, x):
    env[v] = x
    if v in at:
      chosen[v] = jnp.where(finite, x, kept[at[v]])
      # Read back only where it has the type the equations were traced with (inside
      # shard_map a selected value may vary along more mesh axes than ``x``).
      if jax.typeof(chosen[v]) == jax.typeof(x):
        env[v] = chosen[v]

  def read(v):
    return J.read_literal(v, env)

  for v, x in zip(jaxpr.constvars, closed.consts, strict=True):
    write(v, x)
  for eqn in jaxpr.eqns:
    with S.user_context(eqn, with_ctx=True):  # its source line and its context (its mesh)
      outs = J.bind(eqn, [read(v) for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs, strict=True):
      write(v, x)
  return [
    chosen[v] if is_var(v) and v in at else jnp.where(finite, read(v), k)
    for v, k in zip(jaxpr.outvars, kept, strict=True)
  ]


def skip_nonfinite(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Makes a chain holding a loss scaler skip non-finite steps exactly.

  The pure-Optax path (``jmp_scaler.TrainState`` does the same for Flax)::

    tx = jmp_scaler.skip_nonfinite(
        optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3)))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

  On a step whose unscaled gradients hold inf or NaN, ``inner``'s state
  (Adam's ``mu``, ``nu`` and ``count``, so schedules do not advance) is
  returned bit-identical, the scaler backs off, and the updates are
  ``-0.0``, which ``optax.apply_updates`` adds to the parameters without
  changing a single bit (``x + -0.0 == x`` for every ``x``, ``-0.0``
  included). Unlike ``optax.apply_if_finite`` there is no limit on the
  number of consecutive skips: no inf or NaN ever reaches the state.

  The state is ``inner``'s own (no wrapper state), so checkpoints, compiled
  shapes and :func:`jmp_scaler.get_scale` are the same with or without it.
  Without a scaler in ``inner``'s state the wrapper changes nothing. The
  scaler's ``skip_mode`` chooses between ``lax.cond`` and a fused select.

  Args:
    inner: a transformation whose state contains one
      :class:`jmp_scaler.LossScaleState` (typically
      ``optax.chain(jmp_scaler.dynamic_scale(), ...)``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``inner``'s state.
  """
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    plan = plan_step(updates, state, extra_args)
    if plan is None or plan.finite is True:
      updates = updates if plan is None else plan.grads
      return inner.update(updates, state, params, **extra_args)

    def apply(decision):
      return inner.update(plan.grads, state, params, **{**extra_args, FINITE_KEY: decision})

    def skip(shapes):
      return noop_updates(shapes[0]), plan.skipped_state

    return apply_or_skip(plan.scaler, plan.finite, apply, skip)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
