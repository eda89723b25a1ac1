"""The helpers' argument checks: a ``ValueError`` naming the helper, the argument and the value."""

from __future__ import annotations

from typing import Any

import numpy as np

from jmp_scaler.precision._policy import Policy, get_policy


def policy_arg(who: str, policy: Any) -> Policy:
  """``policy`` (a :class:`jmp_scaler.Policy` or a string such as ``"p=f32,c=f16,o=f32"``)
  as a :class:`jmp_scaler.Policy`.

  Raises:
    ValueError: naming ``who`` and the argument, for a policy that does not parse.
  """
  try:
    return get_policy(policy)
  except (ValueError, TypeError) as err:
    raise ValueError(
        f"jmp_tunix.{who}: policy={policy!r} is not a dtype policy ({err}); pass a "
        "jmp_scaler.Policy or a string such as 'p=f32,c=f16,o=f32'") from err


def dtype_arg(who: str, name: str, value: Any) -> np.dtype:
  """``value`` as a NumPy dtype; a ``ValueError`` naming ``who`` and ``name`` if it is none."""
  try:
    return np.dtype(get_policy(value).compute_dtype if isinstance(value, str) else value)
  except (ValueError, TypeError) as err:
    raise ValueError(f"jmp_tunix.{who}: {name}={value!r} is not a dtype ({err})") from err
