"""Which leaves the scaler touches, and in which dtype it does its arithmetic."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:  # pinning a layout: XLA:CPU's choice for a weight gradient costs every reader
  from jax.experimental.layout import Layout as _Layout
  from jax.experimental.layout import with_layout_constraint as _with_layout_constraint
except ImportError:  # pragma: no cover - a jax without the API keeps XLA's layouts
  _Layout = _with_layout_constraint = None  # type: ignore[misc, assignment]

FLOAT32 = np.dtype(jnp.float32)


def is_floating(x: Any) -> bool:
  """Whether ``x`` is an array the scaler unscales and checks.

  Real floating and complex arrays (a complex gradient is scaled like a real
  one and is non-finite when either part is); integers, booleans, PRNG keys,
  Python numbers and ``None`` are left alone.
  """
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def is_inexact_array(x: Any) -> bool:
  """Whether ``x`` is a floating or complex JAX or NumPy array: a leaf that is differentiated.

  ``equinox.is_inexact_array``'s rule: Python numbers, integer and boolean
  arrays, PRNG keys, strings, functions and any other leaf are not.
  """
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
      x.dtype, jnp.inexact)


def is_real_floating(x: Any) -> bool:
  """Whether ``x`` is a real floating array (what precision casts and rounding touch)."""
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def is_half(dtype: Any) -> bool:
  """Whether ``dtype`` is a floating dtype narrower than float32: float16, bfloat16, fp8.

  (NumPy gives ml_dtypes' types the kind ``"V"``, not ``"f"``: ``jnp.issubdtype`` knows
  them.)
  """
  return bool(jnp.issubdtype(dtype, jnp.floating)) and np.dtype(dtype).itemsize < 4


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


def one_cpu_device() -> bool:
  """Whether this host's XLA:CPU backend has one device.

  The layout pin (:func:`row_major`) and the grouped finiteness check
  (:func:`jmp_scaler.scaling._scaler.all_finite`) were measured on one XLA:CPU
  device only. With several devices the layout pin made XLA's partitioner gather
  sharded gradients, and an elementwise ``and`` of two leaves sharded differently
  would make it move one of them. What runs on the CPU is this host's, so its
  device count is the host's; whether the program runs on the CPU at all is the
  platform it is lowered for, not the default backend (a step compiled for a TPU
  from a CPU host): :func:`on_cpu` decides that.
  """
  return len(jax.devices("cpu")) == 1


def on_cpu(args: Any, cpu: Any, other: Any) -> Any:
  """``cpu(args)`` where the program is lowered for one XLA:CPU device, else ``other(args)``.

  The choice is made by the platform the program is lowered for
  (``jax.lax.platform_dependent``: both are traced, one is compiled, and the
  compiler sees no conditional), never by ``jax.default_backend()`` at trace
  time: a step compiled for a TPU or a GPU from a CPU host, or exported for
  several platforms (``jax.export``), gets each platform's own code.
  """
  if not one_cpu_device():
    return other(args)
  return jax.lax.platform_dependent(args, cpu=cpu, default=other)


def row_major(tree: Any) -> Any:
  """``tree`` with every floating leaf of two or more axes laid out row-major (XLA:CPU only).

  JAX makes a weight's gradient as ``transpose(dot_general(...))``, and
  XLA:CPU keeps it in the order the dot wrote it, transposed against the
  parameter. Each later reader pays for that: the finiteness check copies
  its predicate into the logical order, Adam reads the gradient with strides
  in each of its moment updates, and a ``lax.cond`` copies every such operand
  back inside its branch. Laid out once as the parameters are, by the kernel
  that makes it, the gradient is read in order by all of them: x1.5-2.0 per
  step for ``cond`` at 64-256 leaves came down to x1.07-1.12, and 8 leaves of
  1024x1024 run x0.6 of a step without a scaler, whose Adam reads them with
  strides (docs/performance.md). Other backends choose their
  own layouts (not measured there), and with several devices the constraint
  made XLA's partitioner gather sharded gradients (two more all-gathers on an
  FSDP step, ``tests/test_multidevice.py``): there the tree is returned as it is.
  Which it is, is decided by the platform the step is lowered for (:func:`on_cpu`).
  """
  leaves, treedef = jax.tree.flatten(tree)
  at = [i for i, x in enumerate(leaves) if is_floating(x) and x.ndim >= 2]
  if _with_layout_constraint is None or not at:
    return tree

  def pin(xs):
    return [_with_layout_constraint(x, _Layout(tuple(range(x.ndim)))) for x in xs]

  for i, x in zip(at, on_cpu([leaves[i] for i in at], pin, list), strict=True):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)
