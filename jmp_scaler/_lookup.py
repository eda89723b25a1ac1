"""Finding the scaler's state inside any ``opt_state``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmp_scaler._scaler import LossScaleState


def _is_scale_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def find_scale_state(opt_state: Any) -> LossScaleState | None:
  """The one :class:`LossScaleState` inside ``opt_state``, or ``None``.

  Searches any nesting of tuples, lists, dicts, NamedTuples and other pytrees
  (``optax.chain``, ``optax.multi_transform``, ``optax.MultiSteps``, ...).

  Raises:
    ValueError: if ``opt_state`` holds more than one scaler state.
  """
  found = [
      leaf
      for leaf in jax.tree.leaves(opt_state, is_leaf=_is_scale_state)
      if _is_scale_state(leaf)
  ]
  if len(found) > 1:
    raise ValueError(
        f"opt_state holds {len(found)} loss-scaler states; use one scaler per "
        "optimizer (put jmp_scaler.dynamic_scale() once, at the head of the chain)"
    )
  return found[0] if found else None


def replace_scale_state(opt_state: Any, new: LossScaleState) -> Any:
  """``opt_state`` with its scaler state replaced by ``new``."""
  return jax.tree.map(
      lambda x: new if _is_scale_state(x) else x, opt_state, is_leaf=_is_scale_state
  )


def get_scale(opt_state: Any) -> jax.Array:
  """The current loss scale (a float32 scalar array) held in ``opt_state``.

  Multiply the loss by it before taking gradients::

    grads = jax.grad(lambda p: loss_fn(p) * jmp_scaler.get_scale(opt_state))(p)

  An ``opt_state`` without a scaler (for example under a bfloat16 policy,
  whose :meth:`jmp_scaler.Policy.loss_scaler` is ``optax.identity()``) scales
  by 1, so the same train step serves every policy. Reading the scale does
  not synchronise with the host.
  """
  state = find_scale_state(opt_state)
  if state is None:
    return jnp.ones([], jnp.float32)
  return state.scale


def scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """What a user logs about the scaler, as a dict of scalar arrays.

  Keys: ``scale`` (float32), ``skipped`` (bool: the last update was skipped),
  ``consecutive_skips``, ``total_skips``, ``steps`` (updates seen, skipped
  or not) and ``growth_tracker`` (int32). Values stay on the device; convert
  them on the host when logging. Empty when ``opt_state`` holds no scaler.
  """
  state = find_scale_state(opt_state)
  if state is None:
    return {}
  return {
      "scale": state.scale,
      "skipped": state.skipped,
      "consecutive_skips": state.consecutive_skips,
      "total_skips": state.total_skips,
      "steps": state.steps,
      "growth_tracker": state.growth_tracker,
  }
