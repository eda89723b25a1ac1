"""Per-module precision: what the linen and NNX autocasts share.

A policy applies to a module and to everything inside it, as in Haiku's
``hk.mixed_precision.set_policy``: the outermost module runs under the main
policy, a module whose type has an override runs (with its own submodules)
under the override. A module that *enters* a policy casts its floating inputs
to the policy's ``compute_dtype`` and its floating outputs to the policy's
``output_dtype``; every Flax layer inside runs with ``dtype=compute_dtype``
(its parameters are cast to it where computed) and ``param_dtype`` (its
parameters are stored in it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jmp_scaler._leaves import FLOAT32
from jmp_scaler.precision._policy import Policy, get_policy


def as_policy(name: str, value: Any) -> Policy:
  """A :class:`Policy` from a ``Policy`` or a policy string."""
  if isinstance(value, Policy):
    return value
  if isinstance(value, str):
    return get_policy(value)
  raise ValueError(f"{name} must be a jmp_scaler.Policy or a policy string, got {value!r}")


def float32_policy(policy: Policy) -> Policy:
  """The default override for normalisation layers under ``policy``.

  Parameters stored as ``policy`` stores them, computation in float32, and
  outputs in ``policy.compute_dtype`` so that the next layer stays in half
  precision (Haiku's ``p=f32,c=f32,o=f16`` recipe for ``hk.BatchNorm``).
  """
  return Policy(policy.param_dtype, FLOAT32, policy.compute_dtype)


def override_table(
    policy: Policy,
    overrides: Mapping[type, Any] | None,
    float32_types: tuple[type, ...],
    base: type,
) -> dict[type, Policy]:
  """Validates ``overrides`` and merges them over the float32 defaults.

  Args:
    policy: the main policy.
    overrides: module type -> ``Policy`` or policy string; wins over the
      defaults.
    float32_types: types computed in float32 by default (normalisation).
    base: the module base class every key must derive from.

  Returns:
    A dict from module type to its policy.
  """
  if overrides is not None and not isinstance(overrides, Mapping):
    raise ValueError(f"overrides must be a mapping from module type to policy, got {overrides!r}")
  table = {t: float32_policy(policy) for t in float32_types}
  for key, value in (overrides or {}).items():
    if not (isinstance(key, type) and issubclass(key, base)):
      raise ValueError(
          f"overrides keys must be subclasses of {base.__module__}.{base.__qualname__}, "
          f"got {key!r}"
      )
    table[key] = as_policy(f"overrides[{key.__name__}]", value)
  return table


def policy_for_type(table: Mapping[type, Policy], cls: type) -> Policy | None:
  """The override for ``cls``: that of its nearest class in the MRO, if any."""
  for klass in cls.__mro__:
    if klass in table:
      return table[klass]
  return None


def is_half(dtype: Any) -> bool:
  """Whether ``dtype`` is narrower than float32."""
  return np.dtype(dtype).itemsize < 4
