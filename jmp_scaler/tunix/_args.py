"""The helpers' argument checks: a ``ValueError`` naming the helper, the argument and the value."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from jmp_scaler.precision._autocast import autocast
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


def rules_arg(who: str, policy: Policy, rules: Any) -> Any:
  """``rules`` as :func:`jmp_scaler.autocast` takes them (``None``: the default rules),
  validated now; a ``ValueError`` naming ``who`` for bad ones."""
  if rules is None:
    return None
  if not isinstance(rules, Mapping):
    raise ValueError(f"jmp_tunix.{who}: rules must be a mapping, as jmp_scaler.autocast's "
                     f"rules, got {type(rules).__name__}")
  try:
    autocast(lambda x: x, policy, rules=rules)  # autocast checks its rules when it is built
  except ValueError as err:
    raise ValueError(f"jmp_tunix.{who}: {err}") from err
  return dict(rules)


def rules_key(rules: Any) -> str:
  """A short digest of ``rules`` that names the loss :func:`jmp_scaler.tunix.policy_loss`
  registers for them ("" for none): the same rules give the same name in every process."""
  if not rules:
    return ""
  text = repr(sorted((_name(k), _name(v)) for k, v in rules.items()))
  return hashlib.sha256(text.encode()).hexdigest()[:8]


def _name(x: Any) -> str:
  if isinstance(x, tuple):
    return repr(tuple(_name(i) for i in x))
  return getattr(x, "name", None) or repr(x)
