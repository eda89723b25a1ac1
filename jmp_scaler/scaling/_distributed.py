"""Catching a loss scaler whose decision is not shared by every device.

Under ``jax.jit`` with ``NamedSharding`` the gradients are global arrays and
the decision is global by construction. Under ``jax.shard_map`` or
``jax.pmap`` each device sees only its own block: unless the scaler's
``axis_name`` names every mesh axis along which the gradients differ, each
device decides on its own block, and the devices skip different steps and
keep different scales. Two checks catch that: :func:`check_axis_name` at
trace time (free), :func:`scale_in_sync` at run time (one scalar collective).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp

from jmp_scaler._leaves import is_floating
from jmp_scaler.jaxcompat._types import mark_varying, varying_axes
from jmp_scaler.scaling._lookup import find_scale_state
from jmp_scaler.scaling._scaler import LossScaleState


def _names(axis_name: Hashable | None) -> frozenset:
  if axis_name is None:
    return frozenset()
  return frozenset(axis_name) if isinstance(axis_name, tuple) else frozenset([axis_name])


def match_varying(x: jax.Array, like: Any) -> jax.Array:
  """``x`` cast to ``like``'s dtype and marked varying along ``like``'s varying axes.

  The two branches of a ``lax.cond`` inside ``shard_map`` must agree on both.
  Any state leaf optax allows is accepted: a Python number becomes an array of
  ``like``'s dtype, a PRNG key array is kept as it is (keys cannot be cast).
  """
  if not isinstance(x, jax.Array) or x.dtype != like.dtype:
    if jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key):
      x = jnp.asarray(x)
    else:
      x = jnp.asarray(x, like.dtype)
  return mark_varying(x, tuple(sorted(varying_axes(like) - varying_axes(x))))


def check_axis_name(grads: Any, opt_state: Any) -> None:
  """Raises if the scaler in ``opt_state`` would decide differently on different devices.

  Call it inside a ``jax.shard_map`` body, on the gradients about to be
  handed to the optimizer. It reads only types, at trace time: it costs
  nothing at run time and never syncs with the host. ``shard_map`` tracks
  along which mesh axes each value varies (``check_vma=True``, the default);
  if the gradients vary along an axis that the scaler's ``axis_name`` does
  not reduce over, each device would decide on its own block, skip its own
  steps and keep its own scale. Gradients already averaged over the data
  axis (``lax.pmean``) are the same everywhere and need no ``axis_name``.

  Outside ``shard_map``, under ``check_vma=False`` or ``pmap`` (whose types
  carry no such information) it checks nothing; use :func:`scale_in_sync`.

  Args:
    grads: the gradients handed to ``tx.update`` / ``apply_gradients``.
    opt_state: the optimizer state holding the scaler (nothing is checked
      without one).

  Raises:
    ValueError: naming the missing axes and the ``axis_name`` to use.
  """
  scaler = find_scale_state(opt_state)
  if scaler is None:
    return
  varying: frozenset = frozenset()  # mesh axis names, as varying_axes gives them
  for g in jax.tree.leaves(grads):
    if is_floating(g):
      varying |= varying_axes(g)
  declared = scaler.config.axis_name
  missing = varying - _names(declared)
  if missing:
    wanted = tuple(sorted(varying | _names(declared)))
    wanted = wanted[0] if len(wanted) == 1 else wanted
    raise ValueError(
        f"the gradients differ between devices along mesh axes {sorted(missing)}, but the "
        f"loss scaler has axis_name={declared!r}: each device would decide on its own "
        f"block, skip different steps and keep a different scale. Use "
        f"dynamic_scale(..., axis_name={wanted!r})."
    )


def scale_in_sync(opt_state: Any, axis_name: Hashable) -> jax.Array:
  """Whether every device along ``axis_name`` holds the same scaler state.

  For ``shard_map`` and ``pmap`` bodies, where a scaler without the right
  ``axis_name`` lets devices drift apart silently (``pmap`` tracks no
  types, so :func:`check_axis_name` cannot see it). Compares the scale (bit
  for bit) and the integer counters with one all-reduce (a ``pmax`` of
  14 int32 scalars); log the result with the scaler's metrics. True without a scaler.

  Args:
    opt_state: the optimizer state holding the scaler.
    axis_name: the mapped axis name(s) to compare over.

  Returns:
    A bool scalar array, the same on every device.
  """
  s = find_scale_state(opt_state)
  if s is None:
    return jnp.asarray(True)
  # Every field but the static-and-leaf config, derived from the type: a new field is compared
  # without anyone editing a list. Floats are compared bit for bit.
  def as_int32(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return x.astype(jnp.int32)

  fields = [as_int32(getattr(s, f)) for f in LossScaleState._fields if f != "config"]
  v = jnp.stack([jnp.asarray(f, jnp.int32) for f in fields])
  # max(v) == -max(-v) == min(v) on every field iff all devices agree (no value is INT_MIN).
  both = jax.lax.pmax(jnp.concatenate([v, -v]), axis_name)
  return jnp.all(both[: v.size] == -both[v.size:])
