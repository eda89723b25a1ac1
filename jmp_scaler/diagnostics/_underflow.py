"""Would a half dtype flush, subnormalise or overflow these gradients? Per leaf.

Computed by a jittable function (one reduction per leaf, no host sync) and
returned as a pytree; advice and formatting happen on the host.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jmp_scaler._leaves import real_parts
from jmp_scaler.diagnostics._nonfinite import leaves_by_path, only_when, per_leaf, percent
from jmp_scaler.precision._policy import canonical_dtype

# frexp exponents of finite nonzero float32 magnitudes: |x| in [2^(e-1), 2^e).
_EMIN, _EMAX = -149, 128


class UnderflowReport(struct.PyTreeNode):
  """What casting ``tree * scale`` to a half dtype would do, per leaf.

  Counts are exact (the backend's rounding) and taken over each leaf's
  finite nonzero elements (``nonzero``), the ones that carry information.
  A histogram of magnitudes lets the host estimate other scales and dtypes.
  Read it with :meth:`format` (or ``print(report)``), :meth:`advice`,
  :meth:`estimate` and :meth:`to_dict`.

  Attributes:
    zero, subnormal, overflow: int32 ``[n_leaves]``, elements that would
      flush to zero, become subnormal (fewer significant bits), become inf.
    nonzero: int32 ``[n_leaves]``, finite nonzero elements (a complex
      leaf's real and imaginary parts count as two elements).
    max_abs: float32 ``[n_leaves]``, largest finite magnitude.
    hist: int32 ``[278]``, the tree's finite nonzero elements by binade:
      bin ``i`` counts magnitudes in ``[2^(i-150), 2^(i-149))``.
    scale: the float32 scale the report was computed at.
    paths, sizes, dtype: leaf paths and sizes, and the half dtype (static).
  """

  zero: jax.Array
  subnormal: jax.Array
  overflow: jax.Array
  nonzero: jax.Array
  max_abs: jax.Array
  hist: jax.Array
  scale: jax.Array
  paths: tuple[str, ...] = struct.field(pytree_node=False)
  sizes: tuple[int, ...] = struct.field(pytree_node=False)
  dtype: np.dtype = struct.field(pytree_node=False)

  def _host(self) -> dict[str, np.ndarray]:
    names = ("zero", "subnormal", "overflow", "nonzero", "max_abs", "hist", "scale")
    return dict(zip(names, jax.device_get([getattr(self, n) for n in names]), strict=True))

  def best_scale(self) -> float:
    """The largest power of two at which no element overflows ``dtype``."""
    peak = float(np.max(self._host()["max_abs"], initial=0.0))
    if not peak:
      return math.inf
    return 2.0 ** math.floor(math.log2(float(jnp.finfo(self.dtype).max) / peak))

  def estimate(self, scale: float, dtype: Any = None) -> dict[str, float]:
    """Estimated zero/subnormal/overflow fractions at another scale or dtype
    (from the histogram: exact up to one binade at each boundary)."""
    fi = jnp.finfo(canonical_dtype("dtype", self.dtype if dtype is None else dtype))
    hist = self._host()["hist"]
    lo = 2.0 ** np.arange(_EMIN - 1, _EMAX, dtype=np.float64) * scale  # each bin's lower edge
    zero = 2 * lo <= float(fi.smallest_subnormal) / 2
    over = lo >= float(fi.max)
    sub = ~zero & (lo < float(fi.tiny))
    n = max(int(hist.sum()), 1)
    return {k: int(hist[m].sum()) / n for k, m in
            (("zero", zero), ("subnormal", sub), ("overflow", over))}

  def advice(self, tolerance: float = 1e-3) -> str:
    """Whether the scale is too low or too high, and whether bfloat16 is
    safer; losing up to ``tolerance`` of the elements is accepted."""
    h, name = self._host(), self.dtype.name
    zero, sub, over, nz = (int(h[k].sum()) for k in ("zero", "subnormal", "overflow", "nonzero"))
    if not nz:
      return "No finite nonzero element: nothing to lose."
    scale, best = float(h["scale"]), self.best_scale()
    at_best = self.estimate(best)
    lost = at_best["zero"] + at_best["subnormal"]
    msgs = [f"At scale {scale:.6g}, {percent(zero, nz)} flush to zero, {percent(sub, nz)} become "
            f"subnormal, {percent(over, nz)} overflow in {name}."]
    if over:
      msg = f"Scale too high: at most {best:.6g} keeps every element finite."
      if best < 1:
        msg += (" These values overflow unscaled: for gradients a loss scale below 1 fits them;"
                " activations and inputs are never multiplied by the loss scale: rescale them.")
      msgs.append(msg)
    elif (zero + sub) / nz > tolerance and best > scale:
      msgs.append(f"Scale too low: {best:.6g}, the largest without overflow for these leaves, "
                  f"would lose about {100 * lost:.3g}% to zero or subnormals (pass every "
                  f"gradient the loss scale multiplies).")
    else:
      msgs.append("The scale fits.")
    if self.dtype != np.dtype(jnp.bfloat16) and lost > tolerance:
      in_bf16 = self.estimate(1.0, jnp.bfloat16)
      bf = 100 * (in_bf16["zero"] + in_bf16["subnormal"])
      msgs.append(f"Even the best {name} scale loses about {100 * lost:.3g}%; bfloat16 "
                  f"(float32's range, no scaling) would lose {bf:.3g}%: safer.")
    return " ".join(msgs)

  def format(self, max_leaves: int = 20) -> str:
    """A per-leaf table followed by :meth:`advice` (host side)."""
    h = self._host()
    width = max([len(p) for p in self.paths[:max_leaves]] + [4])
    lines = [f"  {'leaf':<{width}}  {'zero':>7} {'subnorm':>7} {'overflow':>8} {'max|x|':>9}"]
    for i, p in enumerate(self.paths[:max_leaves]):
      nz = int(h["nonzero"][i])
      cells = (percent(int(h[k][i]), nz) for k in ("zero", "subnormal", "overflow"))
      lines.append(f"  {p:<{width}}  " + "{:>7} {:>7} {:>8}".format(*cells)
                   + f" {h['max_abs'][i]:>9.3g}")
    if len(self.paths) > max_leaves:
      lines.append(f"  ... and {len(self.paths) - max_leaves} more leaves")
    return "\n".join([*lines, self.advice()])

  def __str__(self) -> str:
    return self.format()

  def to_dict(self, prefix: str = "underflow") -> dict[str, float]:
    """Scalars for a metric writer: the tree's fractions at the scale, the
    best scale, and the flush-to-zero fraction of each leaf that has any."""
    h = self._host()
    nz = max(int(h["nonzero"].sum()), 1)
    out = {f"{prefix}/{k}_fraction": int(h[k].sum()) / nz
           for k in ("zero", "subnormal", "overflow")}
    out[f"{prefix}/best_scale"] = self.best_scale()
    for i, p in enumerate(self.paths):
      if h["zero"][i]:
        out[f"{prefix}/zero/{p}"] = int(h["zero"][i]) / int(h["nonzero"][i])
    return out


def underflow_report(
    tree: Any, scale: Any = 1.0, dtype: Any = jnp.float16, *, when: Any = None
) -> UnderflowReport:
  """Per leaf, what ``tree * scale`` cast to ``dtype`` would lose.

  ``tree`` holds true (unscaled) gradients, e.g. of a float32 baseline or
  ``jmp_scaler.unscale(grads, scale)``; ``scale`` is a candidate loss scale,
  e.g. ``jmp_scaler.get_scale(opt_state)``. Parameter gradients are sums
  over the batch, so the per-example activation gradients of a half-precision
  backward pass underflow first: include those (flax's ``perturb``) too.

  Args:
    tree: a pytree of gradients; non-floating leaves are ignored.
    scale: the loss scale; a positive number or a float32 scalar array.
    dtype: the half dtype, ``float16`` by default (``bfloat16`` works too).
    when: optional traced bool, as in :func:`nonfinite_report`.

  Returns:
    An :class:`UnderflowReport`; jittable, no host sync.

  Raises:
    ValueError: if ``dtype`` is not floating, or ``scale`` is a Python
      number that is not positive and finite.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> g = {"w": jnp.array([1e-9, 1e-6, 1e-3])}
    >>> r = jmp_scaler.underflow_report(g, scale=1.0)
    >>> [int(r.zero[0]), int(r.subnormal[0]), r.best_scale()]
    [1, 1, 33554432.0]
    >>> int(jmp_scaler.underflow_report(g, scale=2.0**15).zero[0])
    0
  """
  d = canonical_dtype("dtype", dtype)
  if isinstance(scale, numbers.Real) and not (math.isfinite(scale) and float(scale) > 0):
    raise ValueError(f"scale must be positive and finite, got {scale!r}")
  paths, sizes, leaves = leaves_by_path(tree)
  s = jnp.asarray(scale, jnp.float32)
  zero, sub, over, nz, peak, hist = _classify(leaves, s, when, d)
  return UnderflowReport(zero=zero, subnormal=sub, overflow=over, nonzero=nz, max_abs=peak,
                         hist=hist, scale=s, paths=paths, sizes=sizes, dtype=d)


@functools.partial(jax.jit, static_argnums=3)
def _classify(leaves, s, when, d):
  def stats(x):
    x = real_parts(x)  # a complex leaf: each part is cast on its own
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    live = jnp.isfinite(x) & (x != 0)
    r = jnp.abs((x * s).astype(d))
    masks = (r == 0, (r != 0) & (r < jnp.finfo(d).tiny), jnp.isinf(r), live)
    counts = [jnp.sum(live & m, dtype=jnp.int32) for m in masks]
    peak = jnp.max(jnp.where(live, jnp.abs(x), 0), initial=0).astype(jnp.float32)
    e = jnp.clip(jnp.frexp(jnp.where(live, x, 1))[1], _EMIN, _EMAX) - _EMIN
    hist = jnp.zeros([_EMAX - _EMIN + 1], jnp.int32).at[e.ravel()].add(live.ravel())
    return (*counts, peak, hist)

  def compute():
    per = [stats(x) for x in leaves]
    dts = (jnp.int32,) * 4 + (jnp.float32,)
    cols = [per_leaf(lambda p, k=k: p[k], per, dt) for k, dt in enumerate(dts)]
    hist = sum((p[5] for p in per), jnp.zeros([_EMAX - _EMIN + 1], jnp.int32))
    return (*cols, hist)

  return only_when(when, compute)
