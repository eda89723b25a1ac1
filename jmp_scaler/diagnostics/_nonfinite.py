"""Why did training go NaN? The per-leaf non-finite report (and shared helpers).

Both reports (this one and :func:`jmp_scaler.underflow_report`) are computed
by jittable functions (one reduction per leaf, no host sync) and returned as
pytrees, so they can leave a jitted train step
next to :func:`jmp_scaler.scale_metrics`. Naming and formatting happen on the
host: leaves are named by path (``params/Dense_1/kernel``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jmp_scaler._leaves import is_floating


def leaves_by_path(tree: Any) -> tuple[tuple[str, ...], tuple[int, ...], list[jax.Array]]:
  """Paths, sizes and values of the floating leaves of ``tree``, in tree order."""
  paths, sizes, leaves = [], [], []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if is_floating(leaf):
      paths.append(jax.tree_util.keystr(path, simple=True, separator="/") or "<root>")
      sizes.append(int(np.size(leaf)))
      leaves.append(jnp.asarray(leaf))
  return tuple(paths), tuple(sizes), leaves


def per_leaf(fn, leaves, dtype) -> jax.Array:
  if not leaves:
    return jnp.zeros([0], dtype)
  return jnp.stack([jnp.asarray(fn(x), dtype) for x in leaves])


def only_when(when, compute):
  """``compute()``, or zeros of its shape unless ``when`` (a traced bool) holds."""
  if when is None:
    return compute()
  zeros = lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(compute))  # noqa: E731
  return jax.lax.cond(jnp.asarray(when, jnp.bool_), compute, zeros)


def percent(part: int, whole: int) -> str:
  return f"{100.0 * part / whole:.3g}%" if whole else "-"


class Culprit(NamedTuple):
  """One leaf of a :class:`NonFiniteReport` that holds inf or NaN."""

  path: str
  nan: int
  inf: int
  size: int


class NonFiniteReport(struct.PyTreeNode):
  """Which floating leaves of a tree hold NaN or inf, and how many elements.

  A pytree (jittable, returnable from a jitted step); ``paths`` and
  ``sizes`` are static. Read it on the host with :meth:`culprits`,
  :meth:`format` (or ``print(report)``) and :meth:`to_dict`.

  Attributes:
    nan: int32 ``[n_leaves]``, NaN elements per floating leaf.
    inf: int32 ``[n_leaves]``, +-inf elements per floating leaf.
    paths: the leaves' paths, in tree order.
    sizes: the leaves' element counts.
  """

  nan: jax.Array
  inf: jax.Array
  paths: tuple[str, ...] = struct.field(pytree_node=False)
  sizes: tuple[int, ...] = struct.field(pytree_node=False)

  def count(self) -> jax.Array:
    """Non-finite elements in the whole tree (int32; jittable)."""
    return jnp.sum(self.nan + self.inf, dtype=jnp.int32)

  def culprits(self) -> list[Culprit]:
    """The leaves holding NaN or inf, in tree order (host side)."""
    nan, inf = jax.device_get((self.nan, self.inf))
    return [
        Culprit(p, int(n), int(i), s)
        for p, n, i, s in zip(self.paths, nan, inf, self.sizes, strict=True)
        if n or i
    ]

  def format(self, max_leaves: int = 20) -> str:
    """A readable report naming the culprit leaves (host side)."""
    bad = self.culprits()
    if not bad:
      return f"all {len(self.paths)} floating leaves are finite"
    total = sum(c.nan + c.inf for c in bad)
    lines = [
        f"{len(bad)} of {len(self.paths)} floating leaves hold inf/NaN "
        f"({total} elements); first in tree order: {bad[0].path}"
    ]
    width = max(len(c.path) for c in bad[:max_leaves])
    for c in bad[:max_leaves]:
      lines.append(
          f"  {c.path:<{width}}  nan {c.nan:>8}  inf {c.inf:>8}  "
          f"of {c.size:>8} ({percent(c.nan + c.inf, c.size)})"
      )
    if len(bad) > max_leaves:
      lines.append(f"  ... and {len(bad) - max_leaves} more")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.format()

  def to_dict(self, prefix: str = "nonfinite") -> dict[str, int]:
    """Scalars for a metric writer: totals, plus one key per culprit leaf."""
    bad = self.culprits()
    out = {
        f"{prefix}/elements": sum(c.nan + c.inf for c in bad),
        f"{prefix}/leaves": len(bad),
    }
    out.update({f"{prefix}/{c.path}": c.nan + c.inf for c in bad})
    return out


def nonfinite_report(tree: Any, *, when: Any = None) -> NonFiniteReport:
  """Counts the NaN and inf elements of every floating leaf of ``tree``.

  Jittable, with no host sync: call it inside the train step on the
  gradients (or on ``capture_intermediates`` activations to find the first
  layer whose forward pass overflows) and return it with the metrics.

  Args:
    tree: any pytree; non-floating leaves and ``None`` are ignored.
    when: optional traced bool; the counting then runs under ``lax.cond``
      only when it holds (zeros otherwise), e.g.
      ``when=new_state.scale_metrics()["skipped"]``: healthy steps then pay
      a branch, not a pass over the gradients.

  Returns:
    A :class:`NonFiniteReport`.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> grads = {"Dense_0": {"kernel": jnp.ones(3)},
    ...          "Dense_1": {"kernel": jnp.array([1.0, jnp.inf, jnp.nan])}}
    >>> print(jmp_scaler.nonfinite_report(grads))  # doctest: +NORMALIZE_WHITESPACE
    1 of 2 floating leaves hold inf/NaN (2 elements); first in tree order: Dense_1/kernel
      Dense_1/kernel  nan        1  inf        1  of        3 (66.7%)
  """
  paths, sizes, leaves = leaves_by_path(tree)
  nan, inf = _count_nonfinite(leaves, when)
  return NonFiniteReport(nan=nan, inf=inf, paths=paths, sizes=sizes)


@jax.jit  # one compilation when called outside jit; inlined inside a jitted step
def _count_nonfinite(leaves, when):
  def compute():
    count = lambda f: per_leaf(lambda x: jnp.sum(f(x), dtype=jnp.int32), leaves, jnp.int32)  # noqa: E731
    return count(jnp.isnan), count(jnp.isinf)

  return only_when(when, compute)
