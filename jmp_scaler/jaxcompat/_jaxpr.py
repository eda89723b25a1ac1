"""The jaxpr types of ``jax.extend.core``, and what jmp_scaler's interpreters do with a jaxpr.

Version notes (each difference is handled here):

* jax 0.10: ``ClosedJaxpr`` wraps a ``Jaxpr`` and its constants; the bodies of ``jit``,
  ``scan``, ``while``, ``cond`` and the custom derivatives are ``ClosedJaxpr``, those of
  ``remat`` and ``shard_map`` bare ``Jaxpr``.
* jax 0.12: one class, ``Jaxpr``, carries its constants (``jaxpr.consts``, ``jaxpr.jaxpr``
  is the jaxpr itself) and ``jax.extend.core.ClosedJaxpr`` is that class; the legacy
  ``ClosedJaxpr(jaxpr, consts)`` re-attaches ``consts``, so ``ClosedJaxpr(jaxpr, [])`` on a
  jaxpr holding constants would turn them into inputs: :func:`closed` never does that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jmp_scaler.jaxcompat._errors import missing

try:
  from jax.extend.core import (
    ClosedJaxpr,
    Jaxpr,
    Literal,
    Primitive,
    jaxpr_as_fun,
    jaxprs_in_params,
  )
except ImportError as e:  # pragma: no cover - only on a JAX that moved them
  raise missing(f"the jaxpr types ({e})", "jax.extend.core") from e

__all__ = [
  "ClosedJaxpr", "Jaxpr", "Literal", "Primitive", "bind", "closed", "function_name",
  "has_sub_jaxprs", "is_literal", "read_literal", "run_closed",
]  # fmt: skip


def closed(jaxpr: Any, consts: Sequence[Any] = ()) -> Any:
  """``jaxpr`` closed over ``consts`` (a jaxpr and the constants a JAX API returned apart),
  or as it is when it is closed already (jax 0.12: every jaxpr carries its constants)."""
  consts = list(consts)
  if consts:
    return ClosedJaxpr(jaxpr, consts)
  if isinstance(jaxpr, ClosedJaxpr):
    return jaxpr
  return ClosedJaxpr(jaxpr, [])  # jax 0.10: a bare Jaxpr (remat's, shard_map's body)


def has_sub_jaxprs(eqn: Any) -> bool:
  return any(True for _ in jaxprs_in_params(eqn.params))


def is_literal(v: Any) -> bool:
  return isinstance(v, Literal)


def read_literal(v: Any, env: dict) -> Any:
  """The value of the atom ``v``: a literal's own, else ``env[v]``."""
  return v.val if isinstance(v, Literal) else env[v]


def bind(eqn: Any, args: Sequence[Any], params: dict | None = None) -> list:
  """``eqn``'s primitive bound again on ``args`` (with ``params`` in place of its own), as a
  list of outputs."""
  prim = eqn.primitive
  out = prim.bind(*args, **prim.get_bind_params(eqn.params if params is None else params))
  return list(out) if prim.multiple_results else [out]


def run_closed(jaxpr: Any) -> Callable:
  """A function evaluating the closed ``jaxpr`` on its inputs."""
  return jaxpr_as_fun(closed(jaxpr))


def function_name(jaxpr: Any) -> str:
  """The name of the function ``jaxpr`` (open or closed) was traced from, or ``""``."""
  inner = closed(jaxpr).jaxpr
  name = getattr(getattr(inner, "debug_info", None), "func_name", None)
  return name.split(" ")[0] if isinstance(name, str) else ""
