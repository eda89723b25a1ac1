"""jmp's loss scales, with jmp's update rule and without its bugs.

The rule and the arithmetic are jmp 0.0.4's, so a float32 scale follows the
same history bit for bit. What changes: the scale is a float32 array leaf
whatever it is built from (a float16 scale cannot overflow, a Python number
cannot cause a second trace), ``min_loss_scale`` is configuration kept through
``jit`` and flattening (jmp's ``tree_flatten`` drops it, and the floor falls
back to 1), and bad arguments raise ``ValueError`` when built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_scaler._validation import INT32_MAX, as_f32

T = TypeVar("T")
_TINY = float(np.finfo(np.float32).tiny)


class _NotABooleanScalar(ValueError, AssertionError):
  """A ``ValueError`` that is also the ``AssertionError`` jmp's ``assert`` raised."""


def _check_boolean_scalar(name: str, pred: Any) -> jax.Array:
  if jnp.ndim(pred) != 0 or jnp.result_type(pred) != jnp.bool_:
    raise _NotABooleanScalar(
        f"{name}: expected boolean scalar (jmp.all_finite's result), got shape "
        f"{jnp.shape(pred)} and dtype {jnp.result_type(pred)}: {pred!r}"
    )
  return jnp.asarray(pred)


def _warn_if_not_floating(x: Any, name: str) -> None:
  try:
    dtype = jnp.result_type(x)
  except TypeError:
    return  # not a number at all: _concrete raises the ValueError
  if not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {dtype}", stacklevel=4)


def _concrete(name: str, x: Any) -> float | None:
  """``x`` as a Python float, or ``None`` for a traced value; refuses non-scalars."""
  if jnp.ndim(x) != 0:
    raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(x)}: {x!r}")
  try:
    value = np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None
  # jnp.issubdtype knows ml_dtypes' bfloat16 and fp8 (NumPy gives them the kind "V").
  if not jnp.issubdtype(value.dtype, jnp.number) or np.iscomplexobj(value):
    raise ValueError(f"{name} must be a real number, got {x!r}")
  return float(value)


def _register_empty(cls: type) -> type:
  """A pytree with no leaves: the object itself is the (hashable) treedef data."""
  jax.tree_util.register_pytree_node(cls, lambda x: ((), x), lambda data, _: data)
  return cls


@_register_empty
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale of 1 that does nothing: ``scale`` and ``unscale`` return the tree itself.

  A pytree with no leaves.
  """

  @property
  def loss_scale(self) -> int:
    """1, as jmp's."""
    return 1

  def scale(self, tree: T) -> T:
    """``tree``, unchanged (the same object)."""
    return tree

  def unscale(self, tree: T) -> T:
    """``tree``, unchanged (the same object)."""
    return tree

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    """``self``; ``grads_finite`` must be a boolean scalar."""
    _check_boolean_scalar("grads_finite", grads_finite)
    return self


@_register_empty
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """Scales and unscales by a fixed constant, held in float32.

  A pytree with no leaves: the constant is configuration, part of the
  treedef, so it must be known when built (a Python number or a concrete
  array; a traced value is refused). It is stored as a ``np.float32``, so a
  16-bit tree scaled or unscaled by it comes back in float32, as with
  :class:`DynamicLossScale` (jmp keeps a Python number weakly typed and a
  float16 loss times ``2 ** 15`` overflows float16).

  Attributes:
    loss_scale: the constant (``np.float32``, finite, >= 0; 0 is accepted as
      jmp accepts it, and makes ``unscale`` divide by zero).
  """

  loss_scale: Any

  def __post_init__(self):
    value = _concrete("loss_scale", self.loss_scale)
    if value is None:
      raise ValueError(
          "loss_scale of a StaticLossScale is configuration (the pytree has no leaves), "
          f"so it must be known when built; got a traced value {self.loss_scale!r}: build "
          "it outside jit, or use a DynamicLossScale, whose scale is a leaf"
      )
    if not (math.isfinite(as_f32(value)) and value >= 0):  # checked as stored
      raise ValueError(f"loss_scale must be finite in float32 and >= 0, got {self.loss_scale!r}")
    object.__setattr__(self, "loss_scale", np.float32(value))

  def scale(self, tree: T) -> T:
    """Every leaf of ``tree`` times the scale."""
    return jax.tree.map(lambda x: x * self.loss_scale, tree)

  def unscale(self, tree: T) -> T:
    """Every leaf of ``tree`` times ``1 / scale``."""
    with np.errstate(divide="ignore"):
      inv_loss_scale = 1 / self.loss_scale
    return jax.tree.map(lambda x: x * inv_loss_scale, tree)

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    """``self``; ``grads_finite`` must be a boolean scalar."""
    _check_boolean_scalar("grads_finite", grads_finite)
    return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """jmp's dynamic loss scale: grow every ``period`` finite steps, back off on overflow.

  The rule, jmp's::

    if grads_finite:
      if counter == period - 1: loss_scale = first_finite(loss_scale * factor, loss_scale)
      counter = (counter + 1) % period
    else:
      loss_scale = max(min_loss_scale, loss_scale / factor)
      counter = 0

  computed as jmp computes it, so a float32 scale has jmp's history bit for
  bit, for every overflow pattern, ``period`` and ``factor``. A pytree whose
  leaves are two arrays, ``loss_scale`` (float32) and ``counter`` (int32);
  ``period``, ``factor`` and ``min_loss_scale`` are configuration, kept
  through ``jit``, ``tree_map`` and flattening. Differences from jmp:

  * ``loss_scale`` is stored in float32 whatever it is built from, so a
    float16 scale (``DynamicLossScale(jmp.half_dtype()(2 ** 15))``, jmp's
    README) grows past float16's 65504 instead of breaking ``adjust``
    (jmp#47), and a Python number does not make a jitted step trace twice.
    ``scale`` and ``unscale`` therefore return float32 for 16-bit leaves, as
    jmp does with the float32 scale its docstring builds.
  * ``min_loss_scale`` survives ``jit``: jmp's ``tree_flatten`` drops it and
    the floor silently falls back to 1.
  * bad arguments raise ``ValueError`` when built (a non-floating scale still
    only warns, as in jmp, and is then stored in float32).

  Attributes:
    loss_scale: the current scale, a float32 scalar array, positive and finite.
    counter: finite steps since the last growth or overflow, an int32 scalar
      array in ``[0, period)``.
    period: finite steps between growths (a positive integer).
    factor: growth factor, and the divisor on overflow (> 1).
    min_loss_scale: the floor of the backoff (``np.float32``, >= 0; default 1).

  Examples:
    >>> import jax.numpy as jnp
    >>> from jmp_scaler import jmp
    >>> loss_scale = jmp.DynamicLossScale(jnp.float16(2 ** 15), period=2)
    >>> for finite in (True, True, True, True):
    ...   loss_scale = loss_scale.adjust(jnp.bool_(finite))
    >>> float(loss_scale.loss_scale), loss_scale.loss_scale.dtype   # past float16's 65504
    (131072.0, dtype('float32'))
  """

  loss_scale: Any
  counter: Any = dataclasses.field(default_factory=lambda: np.zeros([], np.int32))
  period: int = 2000
  factor: float = 2
  min_loss_scale: Any = dataclasses.field(default_factory=lambda: np.ones([], np.float32))

  def __post_init__(self):
    _warn_if_not_floating(self.loss_scale, "loss_scale")
    _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
    period = _concrete("period", self.period)
    if period is None or not (1 <= period <= INT32_MAX and period == int(period)):
      raise ValueError(f"period must be an integer in [1, 2**31 - 1] (the counter is int32), "
                       f"got {self.period!r}")
    period = int(period)
    factor = _concrete("factor", self.factor)
    # Checked as the float32 arithmetic sees it: 1 + 1e-9 is 1 there (the scale would never
    # move), 1e39 is inf.
    if factor is None or not (math.isfinite(as_f32(factor)) and as_f32(factor) > 1):
      raise ValueError(f"factor must be finite and > 1 in float32, got {self.factor!r}")
    floor = _concrete("min_loss_scale", self.min_loss_scale)
    if floor is None:
      raise ValueError(
          "min_loss_scale is configuration (kept out of the leaves so that jit keeps it), so "
          f"it must be known when built; got a traced value {self.min_loss_scale!r}")
    if not (math.isfinite(as_f32(floor)) and floor >= 0):
      raise ValueError(
          f"min_loss_scale must be finite in float32 and >= 0, got {self.min_loss_scale!r}")
    scale = _concrete("loss_scale", self.loss_scale)
    # Stored in float32: past its range the scale is inf, below its normal range 1 / scale is.
    if scale is not None and not (math.isfinite(as_f32(scale)) and as_f32(scale) >= _TINY):
      raise ValueError(f"loss_scale must be positive and finite in float32 (in [{_TINY:.3e}, "
                       f"{float(np.finfo(np.float32).max):.3e}]), got {self.loss_scale!r}")
    if not jnp.issubdtype(jnp.result_type(self.counter), jnp.integer):
      raise ValueError(f"counter must be an integer, got {self.counter!r}")
    counter = _concrete("counter", self.counter)
    if counter is not None and not 0 <= counter < period:
      raise ValueError(f"counter must lie in [0, period={period}), got {self.counter!r}")
    _set(self, jnp.asarray(self.loss_scale, jnp.float32), jnp.asarray(self.counter, jnp.int32),
         period, factor, np.float32(floor))

  def scale(self, tree: T) -> T:
    """Every leaf of ``tree`` times the scale."""
    return jax.tree.map(lambda x: x * self.loss_scale, tree)

  def unscale(self, tree: T) -> T:
    """Every leaf of ``tree`` times ``1 / scale``."""
    inv_loss_scale = 1 / self.loss_scale
    return jax.tree.map(lambda x: x * inv_loss_scale, tree)

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """The next state, given whether this step's gradients are finite.

    Args:
      grads_finite: a boolean scalar (``jmp.all_finite(grads)``).

    Returns:
      A new ``DynamicLossScale`` with the same configuration.

    Raises:
      ValueError: (also an ``AssertionError``, as jmp's ``assert``) if
        ``grads_finite`` is not a boolean scalar.
    """
    finite = _check_boolean_scalar("grads_finite", grads_finite)
    first_finite = lambda a, b: lax.select(jnp.isfinite(a).all(), a, b)  # noqa: E731
    loss_scale = lax.select(
        finite,
        lax.select(self.counter == (self.period - 1),
                   first_finite(self.loss_scale * self.factor, self.loss_scale),
                   self.loss_scale),
        jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor),
    )
    counter = ((self.counter + 1) % self.period) * finite
    new = object.__new__(DynamicLossScale)
    _set(new, loss_scale.astype(jnp.float32), counter.astype(jnp.int32), self.period,
         self.factor, self.min_loss_scale)
    return new


def _set(obj: DynamicLossScale, loss_scale, counter, period, factor, min_loss_scale) -> None:
  for name, value in (("loss_scale", loss_scale), ("counter", counter), ("period", period),
                      ("factor", factor), ("min_loss_scale", min_loss_scale)):
    object.__setattr__(obj, name, value)


def _flatten_with_keys(x: DynamicLossScale):
  children = ((jax.tree_util.GetAttrKey("loss_scale"), x.loss_scale),
              (jax.tree_util.GetAttrKey("counter"), x.counter))
  return children, (x.period, x.factor, x.min_loss_scale)


def _flatten(x: DynamicLossScale):
  return (x.loss_scale, x.counter), (x.period, x.factor, x.min_loss_scale)


def _unflatten(config, children) -> DynamicLossScale:
  # No validation: JAX rebuilds pytrees with tracers, None or placeholder objects.
  new = object.__new__(DynamicLossScale)
  _set(new, *children, *config)
  return new


jax.tree_util.register_pytree_with_keys(
    DynamicLossScale, _flatten_with_keys, _unflatten, _flatten)

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale


def all_finite(tree: Any) -> jax.Array:
  """A boolean scalar array: whether every leaf of ``tree`` is finite (``True`` for no leaves)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def select_tree(pred: Any, a: T, b: T) -> T:
  """``a`` if ``pred`` else ``b``, leaf by leaf with ``lax.select`` (bit for bit, no promotion).

  Raises:
    ValueError: (also an ``AssertionError``, as jmp's ``assert``) if ``pred``
      is not a boolean scalar.
  """
  pred = _check_boolean_scalar("pred", pred)
  return jax.tree.map(functools.partial(lax.select, pred), a, b)
