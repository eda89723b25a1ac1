"""Argument validation, shared by every factory: host side, at construction.

Every check raises ``ValueError`` naming the argument and the value, before
anything is traced. Numbers may be Python numbers or concrete 0-d NumPy/JAX
scalars (``jnp.asarray(2.0**15)``, as jmp's README passes them); a tracer (an
argument computed inside ``jit`` or ``optax.inject_hyperparams``) is refused:
the configuration must be known when the transformation is built.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import warnings
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

F32 = np.finfo(np.float32)
INT32_MAX = int(np.iinfo(np.int32).max)


def _scalar(name: str, value: Any) -> Any:
  """``value`` as a Python/NumPy scalar; 0-d arrays are unwrapped, tracers refused."""
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
        f"{name} must be a concrete number known when the transformation is built, got "
        f"a traced value {value!r} (computed inside jit, or passed by "
        "optax.inject_hyperparams): pass a Python number"
    )
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if np.ndim(value) != 0:
      raise ValueError(f"{name} must be a scalar, got an array of shape {np.shape(value)}")
    value = np.asarray(value)[()]
  return value


def real(name: str, value: Any) -> float:
  """A real number (bools and complex numbers are refused)."""
  x = _scalar(name, value)
  if isinstance(x, np.generic) and jnp.issubdtype(x.dtype, jnp.floating):
    return float(x)  # also ml_dtypes' bfloat16 and fp8, which are not numbers.Real
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
    raise ValueError(f"{name} must be a real number, got {value!r}")
  return float(x)


def integer(name: str, value: Any, low: int, high: int = INT32_MAX) -> int:
  """An integer in ``[low, high]`` (``high`` defaults to 2**31 - 1)."""
  x = _scalar(name, value)
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
    raise ValueError(f"{name} must be an integer, got {value!r}")
  if not low <= int(x) <= high:
    hi = "2**31 - 1" if high == INT32_MAX else str(high)
    raise ValueError(f"{name} must be an integer in [{low}, {hi}], got {value!r}")
  return int(x)


def as_f32(x: float) -> float:
  """``x`` rounded to float32 (inf past float32's range), back as a Python float."""
  with np.errstate(over="ignore"):
    return float(np.float32(x))


def positive_f32(name: str, value: Any) -> float:
  """A positive, finite, normal float32 (so that its reciprocal is finite)."""
  x = real(name, value)
  if not math.isfinite(x) or x <= 0:
    raise ValueError(f"{name} must be positive and finite, got {value!r}")
  if x > float(F32.max) or np.float32(x) < F32.tiny:
    raise ValueError(
        f"{name} must lie in float32's normal range [{F32.tiny:.3e}, {F32.max:.3e}], "
        f"got {value!r}"
    )
  return float(np.float32(x))


def factor(name: str, value: Any, *, above_one: bool) -> float:
  """A growth (> 1) or backoff (in (0, 1)) factor, checked as stored in float32.

  ``1 + 1e-9`` is 1.0 in float32 and ``1e-46`` is 0.0: a scaler built with
  them would never grow or back off, so the stored value is what is checked.
  """
  x = real(name, value)
  stored = as_f32(x)
  if above_one:
    if not (math.isfinite(stored) and stored > 1):
      raise ValueError(
          f"{name} must be finite and > 1 in float32, got {value!r}"
          + (f" (stored as {stored!r})" if stored != x else "")
      )
  elif not (stored > 0 and stored < 1 and np.float32(stored) >= F32.tiny):
    raise ValueError(
        f"{name} must lie in (0, 1) as a normal float32, got {value!r}"
        + (f" (stored as {stored!r})" if stored != x else "")
    )
  return stored


def boolean(name: str, value: Any) -> bool:
  """``value`` as a Python bool, if it is ``True`` or ``False`` (a NumPy bool included)."""
  if not isinstance(value, bool | np.bool_):
    raise ValueError(f"{name} must be True or False, got {value!r}")
  return bool(value)


def one_of(name: str, value: Any, choices: Sequence[Any]) -> Any:
  """``value`` if it is one of ``choices``."""
  if isinstance(value, Hashable) and value in choices:
    return value
  raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def axis_name(value: Any) -> Hashable | None:
  """``None``, a mesh axis name, or a non-empty tuple of them."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, tuple) and value and all(isinstance(a, str) for a in value):
    return value
  raise ValueError(
      f"axis_name must be None, a string or a non-empty tuple of strings, got {value!r}"
  )


# Every spelling XLA's flag parser takes as "on": a bare --flag, =true, =1 (any case).
# (The ``*_fast_math_honor_*`` flags only matter once fast math is on.)
_FAST_MATH = re.compile(r"--(xla_\w*enable_fast_math|xla_\w*enable_fast_min_max)(?:=(\S*))?")
_OFF = ("false", "0")


def fast_math_flags(flags: str | None = None) -> list[str]:
  """The fast-math flags turned on in ``flags`` (default: ``$XLA_FLAGS``).

  Recognises every spelling XLA's flag parser accepts as true (a bare
  ``--flag``, ``=true``, ``=True``, ``=1``) on every backend's flag
  (``xla_cpu_enable_fast_math``, ``xla_gpu_enable_fast_min_max``, ...).
  """
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  return [
      m.group(0)
      for m in _FAST_MATH.finditer(flags)
      if (m.group(2) is None or m.group(2).strip().lower() not in _OFF)
  ]


def warn_on_fast_math(stacklevel: int = 3) -> None:
  """Fast math lets XLA assume no inf/NaN exist, which voids every finiteness check."""
  on = fast_math_flags()
  if on:
    warnings.warn(
        f"XLA_FLAGS turns fast math on ({' '.join(on)}): XLA may then assume that no inf "
        "or NaN exists and fold the loss scaler's finiteness check away, so overflowing "
        "steps would not be skipped. Remove the flag when training in float16.",
        stacklevel=stacklevel,
    )
