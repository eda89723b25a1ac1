"""Which leaves the scaler touches, and in which dtype it does its arithmetic."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT32 = np.dtype(jnp.float32)


def is_floating(x: Any) -> bool:
  """Whether ``x`` is an array the scaler unscales and checks.

  Real floating and complex arrays (a complex gradient is scaled like a real
  one and is non-finite when either part is); integers, booleans, PRNG keys,
  Python numbers and ``None`` are left alone.
  """
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def is_real_floating(x: Any) -> bool:
  """Whether ``x`` is a real floating array (what precision casts and rounding touch)."""
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def math_dtype(dtype: Any) -> np.dtype:
  """The dtype to unscale in: at least float32 (a half-precision 1/scale underflows)."""
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


def floating_leaves(tree: Any) -> list[jax.Array]:
  """The non-empty leaves of ``tree`` that :func:`is_floating` accepts."""
  return [x for x in jax.tree.leaves(tree) if is_floating(x) and x.size]


def real_parts(x: jax.Array) -> jax.Array:
  """A complex array as its real and imaginary parts (a new leading axis of 2); others as is.

  For per-element statistics (magnitudes, underflow) that a complex number
  has twice: each part is scaled, cast and rounded on its own.
  """
  if jnp.iscomplexobj(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)])
  return x
