"""jmp's policies: :class:`jmp_scaler.Policy` with jmp's dtype fields and names."""

from __future__ import annotations

from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

from jmp_scaler.precision import _policy as base

T = TypeVar("T")

#: jmp's table (``jmp._src.policy.dtype_to_names``): the first name is the one ``str`` uses.
dtype_to_names = {
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16"),
    jnp.float32: ("full", "f32", "float32"),
    jnp.float64: ("f64", "float64"),
}

# np.dtype -> jnp scalar type: usable as a dtype and callable (``jnp.float16(2 ** 15)``).
_SCALAR_TYPES = {np.dtype(t): t for t in dtype_to_names}
_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")


def _key(policy: base.Policy) -> tuple[np.dtype, ...]:
  return tuple(np.dtype(getattr(policy, f)) for f in _FIELDS)


class Policy(base.Policy):
  """jmp's ``Policy``: a :class:`jmp_scaler.Policy` with jmp's fields and names.

  Everything a :class:`jmp_scaler.Policy` does (``autocast``, ``autocast_linen``,
  ``autocast_nnx``, ``loss_scaler()``, ``optimizer()``), with jmp's surface:

  * the dtype fields are JAX scalar types (``jnp.float16``), usable as dtypes
    and callable (``policy.compute_dtype(2 ** 15)``), as jmp's are; any
    spelling is accepted (``np.float16``, ``jnp.float16``, ``"float16"``,
    ``"f16"``, ``np.dtype("float16")``) and stored as that scalar type, so
    policies are equal and hash alike across spellings, and equal to the
    :class:`jmp_scaler.Policy` of the same dtypes;
  * ``str(policy)`` uses jmp's first names, ``"p=full,c=f16,o=full"``, and
    ``get_policy(str(policy)) == policy``.

  Unlike jmp, a non-floating dtype is refused (``ValueError`` naming the field).

  Examples:
    >>> import numpy as np
    >>> from jmp_scaler import jmp
    >>> policy = jmp.Policy(np.float32, "f16", "float32")
    >>> str(policy), policy.compute_dtype(2 ** 15).dtype
    ('p=full,c=f16,o=full', dtype('float16'))
  """

  def __post_init__(self):
    super().__post_init__()  # validates and canonicalises to np.dtype
    for field in _FIELDS:
      object.__setattr__(self, field, _SCALAR_TYPES[getattr(self, field)])

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, base.Policy):
      return NotImplemented
    return _key(self) == _key(other)

  def __hash__(self) -> int:
    return hash(_key(self))  # jmp_scaler.Policy's hash: equal policies hash alike

  def __str__(self) -> str:
    names = (dtype_to_names[getattr(self, f)][0] for f in _FIELDS)
    return "p={},c={},o={}".format(*names)


def get_policy(policy_name: str | Any) -> Policy:
  """Parses a policy string in jmp's grammar, as :func:`jmp_scaler.get_policy`.

  ``"params=float32,compute=float16,output=float32"``, ``"p=f32,c=bf16"``,
  ``"c=f16,o=full"`` or a bare dtype (``"half"``, ``"float32"``): params
  default to float32, compute follows params and output follows compute. A
  :class:`jmp_scaler.Policy` (or a dtype) is converted.

  Raises:
    ValueError: "Unknown dtype ..." (jmp's words) for a dtype name it does not
      know, and naming the part for unknown or repeated keys and malformed
      strings (jmp lets a repeated key win silently).
  """
  try:
    parsed = base.get_policy(policy_name)
  except ValueError as e:
    message = str(e)
    raise ValueError(message[:1].upper() + message[1:]) from e
  return Policy(*_key(parsed))


def half_dtype() -> Any:
  """The half-precision type of the default device: ``jnp.bfloat16`` on TPU, else ``jnp.float16``.

  A scalar type, so ``half_dtype()(2 ** 15)`` is a 16-bit scalar array.
  """
  return _SCALAR_TYPES[base._half_dtype()]  # jmp_scaler's "half", the one device check


def cast_to_full(tree: T) -> T:
  """Casts the floating array leaves of ``tree`` to float32 (anything else passes through)."""
  return base._cast_floating(tree, np.dtype(np.float32))


def cast_to_half(tree: T) -> T:
  """Casts the floating array leaves of ``tree`` to :func:`half_dtype`."""
  return base._cast_floating(tree, np.dtype(half_dtype()))
