"""``fn(*args, **kwargs)`` as a function of its array leaves, and the user's lines of an equation.

Shared by :func:`jmp_scaler.find_nonfinite` and :func:`jmp_scaler.compare_precision`: NNX
modules are split into their graph and state, array leaves are traced and every other leaf is
static (as under ``jax.jit``), and the floating leaves of the first argument are the ones
differentiated (as :func:`jmp_scaler.value_and_grad` does).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_scaler._leaves import is_inexact_array
from jmp_scaler.jaxcompat import _source as S

#: The name scope of the scale multiply ``loss.astype(float32) * scale`` of the backward pass.
SCALE_SCOPE = "jmp_find_nonfinite.scale"
#: The packages whose frames ``source`` skips, to name the user's line.
LIBRARIES = ("jax", "flax", "optax", "equinox", "jmp_scaler")


@jax.tree_util.register_pytree_node_class
class Module:
  """An NNX module as its graph (static), its ``nnx.Param`` state and the rest of its state."""

  def __init__(self, graphdef: Any, params: Any, rest: Any):
    self.graphdef, self.params, self.rest = graphdef, params, rest

  def tree_flatten(self):
    return (self.params, self.rest), self.graphdef

  @classmethod
  def tree_unflatten(cls, graphdef, children):
    return cls(graphdef, *children)

  def merge(self) -> Any:
    return nnx.merge(self.graphdef, self.params, self.rest)


def split(x: Any) -> Any:
  if isinstance(x, nnx.Module):
    return Module(*nnx.split(x, nnx.Param, ...))
  return x


def merge(x: Any) -> Any:
  return x.merge() if isinstance(x, Module) else x


class Call:
  """``fn(*args, **kwargs)`` as a function of its array leaves (NNX modules split first)."""

  def __init__(self, fn: Any, args: tuple, kwargs: dict):
    parts = (split(fn), tuple(split(a) for a in args), {k: split(v) for k, v in kwargs.items()})
    with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(parts)
    leaves = [x for _, x in with_paths]
    self.mask = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
    self.static = [None if m else x for x, m in zip(leaves, self.mask, strict=True)]
    self.dynamic = [x for x, m in zip(leaves, self.mask, strict=True) if m]
    self.names = [leaf_name(p) for (p, _), m in zip(with_paths, self.mask, strict=True) if m]
    #: each dynamic leaf's key path in ``(fn, args, kwargs)``
    self.paths = [p for (p, _), m in zip(with_paths, self.mask, strict=True) if m]
    # The dynamic inexact leaves of the first argument (of an NNX module: its nnx.Param
    # leaves): the ones jmp_scaler.value_and_grad differentiates.
    n_fn = len(jax.tree.leaves(parts[0]))
    first = parts[1][0].params if args and isinstance(parts[1][0], Module) else (
      parts[1][0] if args else ())
    n_first = len(jax.tree.leaves(first))
    dyn_index = np.cumsum(self.mask) - 1
    self.first = [int(dyn_index[i]) for i in range(n_fn, n_fn + n_first)
                  if is_inexact_array(leaves[i])]
    self.rest = [i for i in range(len(self.dynamic)) if i not in set(self.first)]
    self.has_args = bool(args)

  def flat(self, *dynamic: Any) -> Any:
    it = iter(dynamic)
    leaves = [next(it) if m else s for m, s in zip(self.mask, self.static, strict=True)]
    fn, args, kwargs = jax.tree.unflatten(self.treedef, leaves)
    fn = merge(fn)
    return fn(*[merge(a) for a in args], **{k: merge(v) for k, v in kwargs.items()})

  def split_first(self) -> tuple[list, list]:
    if not self.has_args:
      raise ValueError("with scale, fn needs a first positional argument to differentiate")
    if not self.first:
      raise ValueError("with scale, the first argument of fn must hold floating arrays (the "
                       "parameters to differentiate), it holds none")
    return [self.dynamic[i] for i in self.first], [self.dynamic[i] for i in self.rest]

  def scaled(self, scale: float, flat: Callable | None = None) -> Callable:
    """``loss(diff, other)``: the first argument's floating leaves and the other leaves to
    ``fn(...)`` (or ``flat(*leaves)``) as float32 times ``scale``."""
    flat = self.flat if flat is None else flat

    def loss(diff, other):
      dynamic = [None] * len(self.dynamic)
      for i, x in zip(self.first, diff, strict=True):
        dynamic[i] = x
      for i, x in zip(self.rest, other, strict=True):
        dynamic[i] = x
      out = jax.tree.leaves(flat(*dynamic))[0]
      with jax.named_scope(SCALE_SCOPE):  # as jmp_scaler.value_and_grad: in float32
        return jnp.asarray(out).astype(jnp.float32) * jnp.float32(scale)

    return loss


def leaf_name(path: tuple) -> str:
  head, tail = path[0].idx, path[1:]
  if head == 0:
    return "fn" + jax.tree_util.keystr(tail)
  if head == 1:
    return f"args[{tail[0].idx}]" + jax.tree_util.keystr(tail[1:])
  return f"kwargs[{tail[0].key!r}]" + jax.tree_util.keystr(tail[1:])


def user_lines(eqn: Any) -> list[str]:
  """The frames of ``eqn``'s traceback outside :data:`LIBRARIES` (those imported), innermost
  first, their files relative to the working directory when under it."""
  found = S.user_frames(eqn, [sys.modules[name] for name in LIBRARIES if name in sys.modules])
  return [relative(str(f)) for f in found]


def relative(where: str) -> str:
  """``"file:line (function)"`` with ``file`` relative to the working directory if under it."""
  m = re.match(r"(.*)(:\d+(:\d+)? \(.*\))$", where)
  if not m:
    return where
  try:
    rel = os.path.relpath(m.group(1))
  except ValueError:  # another drive
    return where
  return where if rel.startswith(os.pardir) else rel + m.group(2)
