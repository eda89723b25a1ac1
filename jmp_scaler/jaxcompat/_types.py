"""A value's abstract type: the mesh axes it varies along, and its ``ShapeDtypeStruct``.

Inside ``shard_map`` a value's type says over which mesh axes it varies (``check_vma``):
jax 0.10 and 0.12 name it ``aval.manual_axis_type`` (``varying``, ``unreduced``); earlier
releases ``aval.vma``. Under explicit sharding, ``aval.sharding.spec.unreduced`` names the axes
a partial sum is not yet reduced over.
"""

from __future__ import annotations

from typing import Any

import jax


def _aval(x: Any) -> Any:
  return x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)


def varying_axes(x: Any) -> frozenset:
  """Mesh axes along which ``x`` (array or ShapeDtypeStruct) differs between devices."""
  aval = _aval(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(getattr(manual, "varying", ()))
  return frozenset(getattr(aval, "vma", ()))


def unreduced_axes(x: Any) -> frozenset:
  """Mesh axes over which ``x`` is a partial sum (explicit sharding or inside shard_map)."""
  aval = _aval(x)
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  unreduced = frozenset(getattr(spec, "unreduced", ()) or ())
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    unreduced |= frozenset(getattr(manual, "unreduced", ()))
  return unreduced


def mark_varying(x: jax.Array, axes: tuple) -> jax.Array:
  """``x`` marked as varying along the mesh ``axes`` (``lax.pcast``; ``lax.pvary`` before)."""
  if not axes:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axes, to="varying")
  return jax.lax.pvary(x, axes)  # type: ignore[attr-defined]  # jax < 0.12 only


def struct(x: Any, dtype: Any = None, weak: bool = False) -> jax.ShapeDtypeStruct:
  """The abstract value of ``x`` (sharding and varying manual axes included), in ``dtype``.

  A struct without the manual axes would make ``jax.eval_shape`` of a ``shard_map`` body
  that mixes it with a varying value fail under ``check_vma``.
  """
  aval = jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  manual = getattr(aval, "manual_axis_type", None)
  kwargs = {}
  if manual is not None and not manual.empty:
    kwargs["manual_axis_type"] = manual  # needs the manual mesh of the sharding with it
  elif sharding is not None and not any(getattr(sharding, "spec", ())):
    sharding = None  # replicated: let the context decide
  return jax.ShapeDtypeStruct(
    aval.shape, dtype or aval.dtype, sharding=sharding, weak_type=weak and aval.weak_type,
    **kwargs,
  )


def row_struct(x: Any) -> jax.ShapeDtypeStruct:
  """The abstract value of ``x[0]``, varying manual axes included: what a ``scan`` body sees
  of the array it scans over."""
  return jax.eval_shape(lambda v: v[0], struct(x))


def is_traced(x: Any) -> bool:
  """Whether ``x`` is a tracer (an abstract value inside ``jit``, ``grad``, ...), not data."""
  tracer = getattr(jax.core, "Tracer", None)
  if tracer is None:  # pragma: no cover - a JAX without jax.core.Tracer
    from jmp_scaler.jaxcompat._errors import missing  # noqa: PLC0415

    raise missing("the Tracer class", "jax.core")
  return isinstance(x, tracer)
