"""Finding the scaler's state inside any ``opt_state``, in every form Flax hands out."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from types import FrameType
from typing import Any

import flax
import jax
from flax import nnx

import jmp_scaler
from jmp_scaler._leaves import floating_leaves, is_half
from jmp_scaler.scaling._scaler import LossScaleState, ScaleConfig

_FIELDS = frozenset(LossScaleState._fields)
# The numeric (leaf) fields of ScaleConfig; axis_name and skip_mode are static.
CONFIG_LEAVES = frozenset(
    f for f in ScaleConfig.__dataclass_fields__
    if ScaleConfig.__dataclass_fields__[f].metadata.get("pytree_node", True)
)


def is_scale_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def _is_scale_mapping(x: Any) -> bool:
  """A mapping with exactly the scaler's fields: what ``nnx.state`` makes of one."""
  if not isinstance(x, Mapping) or isinstance(x, LossScaleState):
    return False
  try:
    keys = set(x.keys())
  except TypeError:
    return False
  if keys != _FIELDS:
    return False
  config = x["config"]
  return isinstance(config, Mapping) and set(config.keys()) == CONFIG_LEAVES


def _value(x: Any) -> Any:
  return x.get_value() if isinstance(x, nnx.Variable) else x


def _from_mapping(x: Mapping) -> LossScaleState:
  """A :class:`LossScaleState` rebuilt from a mapping of its fields.

  The static ``axis_name`` and ``skip_mode`` are not in a mapping (``nnx.state``
  and ``nnx.to_pure_dict`` keep leaves only): they take their defaults.
  """
  config = ScaleConfig(**{k: _value(x["config"][k]) for k in CONFIG_LEAVES})
  return LossScaleState(**{k: _value(x[k]) for k in _FIELDS - {"config"}}, config=config)


def _is_nnx_object(x: Any) -> bool:
  return isinstance(x, nnx.Pytree)


def _searchable(value: Any) -> Any:
  """``value`` with every NNX object replaced by its ``nnx.state``."""
  if isinstance(value, nnx.GraphDef):
    raise ValueError(
        "got an NNX GraphDef, which holds no values: pass the state from the same "
        "nnx.split (graphdef, state = nnx.split(...)), or the optimizer itself"
    )
  return jax.tree.map(
      lambda x: nnx.state(x) if _is_nnx_object(x) else x, value, is_leaf=_is_nnx_object
  )


def _holds_optimizer_state(tree: Any) -> bool:
  """Whether ``tree`` could hold an optimizer's state (anything but one array or number)."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
  if any(isinstance(x, nnx.Variable) for x in leaves):
    # An NNX state: optimizer states are nnx.OptState variables (OptArray, ...).
    return any(isinstance(x, nnx.training.optimizer.OptState) for x in leaves)
  top = jax.tree.leaves(tree)
  return tree is not None and not (len(top) == 1 and top[0] is tree)


def find_scale_state(opt_state: Any) -> LossScaleState | None:
  """The one :class:`LossScaleState` inside ``opt_state``, or ``None``.

  Searches any nesting of tuples, lists, dicts, NamedTuples and other pytrees
  (``optax.chain``, ``optax.multi_transform``, ``optax.MultiSteps``,
  :class:`jmp_scaler.TrainState`), and every form Flax NNX hands out: a live
  ``nnx.Optimizer`` / :class:`jmp_scaler.NNXOptimizer` (or a tuple such as
  ``(model, optimizer)``), ``nnx.state(optimizer)``, the state of
  ``nnx.split((model, optimizer))`` and ``nnx.to_pure_dict`` of it. In the last
  three forms the scaler is a mapping of its fields; it is returned as a
  :class:`LossScaleState` whose static ``config.axis_name`` and
  ``config.skip_mode`` take their defaults (a mapping does not keep them).

  Returns:
    The scaler's state (with plain array leaves), or ``None`` for an optimizer
    state without a scaler.

  Raises:
    ValueError: if ``opt_state`` holds more than one scaler state, or cannot hold
      an optimizer state at all (an array, a number, ``None``, an NNX model or
      ``nnx.state(model)`` without an optimizer, a ``GraphDef``): such a call
      would otherwise read a scale of 1 while the scaler divides by another.
  """
  tree = _searchable(opt_state)
  is_leaf = lambda x: is_scale_state(x) or _is_scale_mapping(x)  # noqa: E731
  found = [x for x in jax.tree.leaves(tree, is_leaf=is_leaf) if is_leaf(x)]
  if len(found) > 1:
    raise ValueError(
        f"opt_state holds {len(found)} loss-scaler states; use one scaler per "
        "optimizer (put jmp_scaler.dynamic_scale() once, at the head of the chain)"
    )
  if not found:
    if not _holds_optimizer_state(tree):
      raise ValueError(
          f"{type(opt_state).__name__} cannot hold a loss scaler: pass the optimizer "
          "state (TrainState.opt_state, an optax opt_state, an nnx.Optimizer or its "
          f"nnx.state), got {_describe(opt_state)}"
      )
    return None
  state = found[0]
  if _is_scale_mapping(state):
    return _from_mapping(state)
  return jax.tree.map(_value, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _caller_stacklevel() -> int:
  """The ``stacklevel`` of the first frame outside jmp_scaler and flax (NNX's metaclass calls
  ``__init__`` from its own frames), counted from the caller of this function."""
  skip = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (flax, jmp_scaler))
  frame: FrameType | None = sys._getframe(1)
  level = 1
  while frame is not None and frame.f_code.co_filename.startswith(skip):
    frame, level = frame.f_back, level + 1
  return level


def warn_without_scaler(opt_state: Any, params: Any, who: str) -> None:
  """Warns at the creation of ``who`` (a TrainState or NNXOptimizer) whose ``opt_state``
  holds no loss scaler: nothing would then skip a non-finite step.

  Without a scaler the exact skip has nothing to decide with, so an inf/NaN gradient is
  applied to the parameters and reaches every optimizer state (Adam's moments stay NaN).
  """
  if find_scale_state(opt_state) is not None:
    return
  half = sorted({str(x.dtype) for x in floating_leaves(params) if is_half(x.dtype)})
  why = (f"its parameters are {' and '.join(half)}, whose gradients underflow and overflow "
         "without loss scaling, and " if half else "")
  warnings.warn(
      f"{who} was created with a tx that holds no loss scaler: {why}an inf/NaN gradient "
      "would be applied to the parameters and poison the optimizer state, with no skip. Put "
      "jmp_scaler.no_scale() at the head of the chain (scale 1; non-finite steps skipped), "
      "or policy.loss_scaler() (dynamic_scale() for float16)",
      UserWarning, stacklevel=_caller_stacklevel())


def _describe(x: Any) -> str:
  text = repr(x)
  return text if len(text) <= 80 else text[:77] + "..."


def replace_scale_state(opt_state: Any, new: LossScaleState) -> Any:
  """``opt_state`` with its scaler state replaced by ``new``."""
  return jax.tree.map(
      lambda x: new if is_scale_state(x) else x, opt_state, is_leaf=is_scale_state
  )


def _required(opt_state: Any, what: str) -> LossScaleState:
  """The scaler's state in ``opt_state``; a ``ValueError`` saying ``what`` is missing if none."""
  state = find_scale_state(opt_state)
  if state is None:
    raise ValueError(
        f"opt_state holds no loss scaler, so there is {what}: put policy.loss_scaler() (or "
        "jmp_scaler.no_scale(), which scales by 1 and still skips non-finite steps) at the "
        "head of the chain; jmp_scaler.find_scale_state(opt_state) asks whether there is one"
    )
  return state


def get_scale(opt_state: Any) -> jax.Array:
  """The current loss scale (a float32 scalar array) held in ``opt_state``.

  Multiply the loss by it before taking gradients (or let
  :func:`jmp_scaler.value_and_grad` do it). ``opt_state`` may be any form
  :func:`find_scale_state` accepts: an optax state, a
  :class:`jmp_scaler.TrainState`, an NNX optimizer or its ``nnx.state``.
  Reading the scale does not synchronise with the host.

  Every reader of the scaler (this, :func:`scale_metrics`,
  ``TrainState.loss_scale``, ``NNXOptimizer.loss_scale``,
  :func:`jmp_scaler.value_and_grad`) raises on an optimizer state without a
  scaler: a float16 chain that lost its scaler would otherwise train on
  unscaled gradients without a word. :func:`find_scale_state` is the one that
  asks whether there is a scaler (``None`` when there is not).

  Raises:
    ValueError: if ``opt_state`` holds no scaler (put ``policy.loss_scaler()``
      or ``jmp_scaler.no_scale()`` at the head of the chain), or, as
      :func:`find_scale_state`, cannot hold one.
  """
  return _required(opt_state, "no loss scale to read").scale


def scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """What a user logs about the scaler, as a dict of scalar arrays.

  Keys: ``scale`` (float32), ``skipped`` (bool: the last update was skipped),
  ``consecutive_skips``, ``total_skips``, ``steps`` (updates seen, skipped
  or not) and ``growth_tracker`` (int32). Values stay on the device; convert
  them on the host when logging (:func:`jmp_scaler.to_scalars`). Every
  :class:`jmp_scaler.Policy`'s :meth:`~jmp_scaler.Policy.loss_scaler` holds a
  scaler, so the keys are the same under every policy.

  Raises:
    ValueError: if ``opt_state`` holds no scaler (there is nothing to report:
      build the chain with ``policy.loss_scaler()`` or
      ``jmp_scaler.no_scale()``), or cannot hold one.
  """
  state = _required(opt_state, "no scaler metrics")
  return {
      "scale": state.scale,
      "skipped": state.skipped,
      "consecutive_skips": state.consecutive_skips,
      "total_skips": state.total_skips,
      "steps": state.steps,
      "growth_tracker": state.growth_tracker,
  }
