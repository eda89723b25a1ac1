"""Block-scaled matmuls, MXFP8 and NVFP4, forward and backward, as the published recipes run them.

:func:`block_scaled_dot_general` has :func:`jax.lax.dot_general`'s signature. Each operand is
brought to ``[batch, free, contract]`` (``jax.nn.scaled_matmul``'s form), zero-padded to a
multiple of the block size along every dimension a GEMM contracts (zeros change no amax and no
sum), quantised block by block along the contracting axis of each GEMM, and multiplied by
``jax.nn.scaled_matmul`` (:mod:`jmp_scaler.jaxcompat._scaled`: the ``__op$block_scaled_dot``
custom call on CUDA; on CPU dequantised in float32 and one float32 dot, jax 0.11's lowering,
registered on jax 0.10).

MXFP8 (OCP MX v1.0; TransformerEngine's ``MXFP8BlockScaling``), blocks of 32 along the
contracting axis, one E8M0 (power of two) scale ``X`` per block, in float32 arithmetic::

  e = floor(log2(amax_block))                    # exact, float32 subnormals included
  X = 2**(e - emax)            "floor" (OCP)     # emax = 8 for E4M3 (448 = 1.75 * 2**8)
  X = 2**ceil(log2(amax / max))  "rceil"         # the smallest power of two with amax / X <= max
  byte = clip(log2(X) + 127, 1, 254)             # 0xFF (NaN) only for a block holding inf/NaN
  q = e4m3(clip(x / X, -448, 448))               # round to nearest even; floor can saturate

The byte 0 (``X = 2**-127``, a float32 subnormal) is never produced: XLA flushes float32
subnormals to zero on CPU and GPU, so ``x / 2**-127`` would be ``x / 0``; the smallest scale
is ``2**-126`` (byte 1). For the same reason a block whose values are all float32
subnormals is read as a zero block. A zero block gets the byte 1 and zeros.

Every GEMM requantises its operands from the saved high-precision tensors along its own
contracting axis (fprop along K, dgrad along N, wgrad along M), as TE's rowwise and
columnwise copies are.

NVFP4 (arXiv 2509.25149; TE's ``NVFP4BlockScaling``), blocks of 16 of E2M1 (the values
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``) with two scales, in float32::

  s_enc = 6 * 448 / amax_tensor                  # 1 if amax is 0, float32 max if it overflows
  d = e4m3(amax_block / 6 * s_enc)               # the block's decode scale, stored in E4M3
  q = e2m1(x * (s_enc / d))                      # 0 where d == 0
  x ~= q * d / s_enc

with, each switchable (:class:`Nvfp4Recipe`): the weight (the right operand of an unbatched
dot) quantised in 16x16 tiles, so fprop and dgrad use the same values; a 16x16 random Hadamard
transform of both wgrad operands along their contracting axis (``(H a)^T (H g) = a^T g``: H is
orthogonal); stochastic rounding of the output gradient ``g`` in dgrad and wgrad. An inf or NaN
in an operand gives a non-finite result, never a clipped one, so a loss scaler skips the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_scaler._validation import integer, one_of
from jmp_scaler.jaxcompat import _scaled
from jmp_scaler.jaxcompat._types import unreduced_axes
from jmp_scaler.lowbit._fp8 import Unsupported, amax_axes, check_precision, dot_dims

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
E8M0 = np.dtype(jnp.float8_e8m0fnu)
E2M1 = np.dtype(jnp.float4_e2m1fn)
_F32 = np.dtype(jnp.float32)
_OPERAND_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), _F32)
#: (largest exponent, mantissa bits of the largest value as a fraction of 2**23) per format.
_EMAX = {E4M3: (8, 6291456), E5M2: (15, 6291456)}  # 448 = 1.75 * 2**8; 57344 = 1.75 * 2**15
MX_BLOCK, NV_BLOCK = 32, 16
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_MAX, _FP8_MAX = 6.0, 448.0
#: The fixed random signs of the Hadamard transform (TE's RHT uses one fixed sign vector too).
_RHT_SIGNS = (1, -1, 1, 1, -1, 1, -1, -1, 1, 1, -1, 1, 1, -1, -1, 1)


def _bool(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {value!r}")
  return bool(value)


@dataclasses.dataclass(frozen=True)
class MxFp8Recipe:
  """How :func:`block_scaled_dot_general` runs a dot in MXFP8: 1x32 blocks, E8M0 scales.

  The defaults are TransformerEngine's ``MXFP8BlockScaling()``: E4M3 everywhere (the
  gradient included) and scales rounded up ("RCEIL", as cuBLAS and TE compute them, which
  arXiv 2506.08027 found needed for MXFP8 pretraining to match bf16). Frozen and hashable:
  configuration, never state.

  Attributes:
    scale_rounding: ``"rceil"`` (the default): ``X = 2**ceil(log2(amax / 448))``, so no
      element saturates; ``"floor"``: the OCP MX v1.0 rule ``X = 2**(floor(log2 amax) -
      8)``, which saturates the elements above ``448 * X`` to 448.
    fp8_format: ``"e4m3"`` (the default) for every operand, or ``"hybrid"``: the output
      gradient in E5M2 (its ``emax`` 15).

  Raises:
    ValueError: for a field outside the values above, naming it and its value.

  Examples:
    >>> import jmp_scaler
    >>> jmp_scaler.MxFp8Recipe(scale_rounding="floor").block_size
    32
  """

  scale_rounding: str = "rceil"
  fp8_format: str = "e4m3"

  def __post_init__(self):
    one_of("scale_rounding", self.scale_rounding, ("rceil", "floor"))
    one_of("fp8_format", self.fp8_format, ("e4m3", "hybrid"))

  block_size = MX_BLOCK

  @property
  def backward_dtype(self) -> np.dtype:
    """The float8 dtype of the output gradient in the backward GEMMs."""
    return E5M2 if self.fp8_format == "hybrid" else E4M3


@dataclasses.dataclass(frozen=True)
class Nvfp4Recipe:
  """How :func:`block_scaled_dot_general` runs a dot in NVFP4: E2M1, E4M3 block scales.

  The defaults are the recipe of arXiv 2509.25149 and TransformerEngine's
  ``NVFP4BlockScaling()``: each switch on. Frozen and hashable.

  Attributes:
    weight_2d: quantise the weight (the right operand of a dot with no batch dimension) in
      16x16 tiles, one scale per tile, so that fprop and dgrad use the same quantised
      values; otherwise 1x16 blocks along each GEMM's contracting axis.
    random_hadamard: apply a 16x16 random Hadamard transform to both wgrad operands along
      the contracting (token) axis before they are quantised; it spreads outliers over the
      block and leaves the exact product unchanged.
    stochastic_rounding: round the output gradient to E2M1 stochastically (unbiased) in
      dgrad and wgrad; forward operands round to nearest even.
    seed: a non-negative int: the stochastic rounding's key is ``jax.random.key(seed)``
      folded with a hash of the gradient's bits (no state to carry: the gradient changes
      every step).

  Raises:
    ValueError: for a field that is not a bool (or a ``seed`` that is not an int in
      ``[0, 2**31)``), naming it and its value.

  Examples:
    >>> import jmp_scaler
    >>> jmp_scaler.Nvfp4Recipe(random_hadamard=False).stochastic_rounding
    True
  """

  weight_2d: bool = True
  random_hadamard: bool = True
  stochastic_rounding: bool = True
  seed: int = 0

  def __post_init__(self):
    for name in ("weight_2d", "random_hadamard", "stochastic_rounding"):
      object.__setattr__(self, name, _bool(name, getattr(self, name)))
    object.__setattr__(self, "seed", integer("seed", self.seed, 0, 2**31 - 1))

  block_size = NV_BLOCK


# -------------------------------------------------------------- quantisers --


def _pow2(e: jax.Array) -> jax.Array:
  """``2.0**e`` in float32, exactly, for int32 ``e`` in ``[-126, 127]`` (normal numbers)."""
  return lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def _log2_floor(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(floor(log2 amax), mantissa bits)`` of a positive float32, exact for subnormals too
  (where the backend keeps them: XLA flushes them to zero, which the callers treat as 0)."""
  sub = amax < np.float32(2.0**-126)
  a = jnp.where(sub, amax * np.float32(2.0**64), amax)  # exact: subnormal -> normal
  bits = lax.bitcast_convert_type(a, jnp.int32)
  return (bits >> 23) - 127 - jnp.where(sub, 64, 0), bits & 0x7FFFFF


def mx_scale_exponent(amax: jax.Array, dtype: np.dtype, rounding: str) -> jax.Array:
  """The E8M0 scale byte (int32, ``log2(X) + 127``) of blocks whose largest magnitude is
  ``amax`` (float32), for elements in ``dtype``: from 1 (a zero block's) to 254."""
  emax, frac_max = _EMAX[np.dtype(dtype)]
  e, frac = _log2_floor(jnp.maximum(amax, np.float32(np.finfo(np.float32).smallest_subnormal)))
  e = e - emax
  if rounding == "rceil":
    e = e + (frac > frac_max).astype(jnp.int32)
  return jnp.where(amax == 0, 1, jnp.clip(e + 127, 1, 254))


def mx_quantize(x: jax.Array, dtype: np.dtype = E4M3, rounding: str = "rceil",
                block: int = MX_BLOCK) -> tuple[jax.Array, jax.Array]:
  """``x`` (last axis a multiple of ``block``) in MX blocks along its last axis.

  Returns:
    ``(q, X)``: float32 ``q`` of ``x``'s shape holding values exact in ``dtype``, and the
    float32 scales ``X`` (powers of two, NaN for a block with an inf or NaN), one per block
    (last axis divided by ``block``): ``x ~= q * repeat(X, block)``.
  """
  x32 = x.astype(_F32)
  xb = x32.reshape(*x.shape[:-1], x.shape[-1] // block, block)
  amax = jnp.max(jnp.abs(xb), axis=-1)
  byte = mx_scale_exponent(amax, dtype, rounding)
  scale = jnp.where(jnp.isfinite(amax), _pow2(byte - 127), np.float32(np.nan))
  m = np.float32(np.finfo(dtype).max)
  q = lax.clamp(-m, xb / scale[..., None], m).astype(dtype).astype(_F32)
  return q.reshape(x.shape), scale


def e2m1_round(v: jax.Array, key: jax.Array | None = None) -> jax.Array:
  """float32 ``v`` rounded to the E2M1 grid (saturating at 6): to nearest even, or, with a
  ``key``, stochastically (up with probability ``(|v| - lo) / (hi - lo)``, unbiased)."""
  a = jnp.minimum(jnp.abs(v), np.float32(_FP4_MAX))
  step = jnp.where(a >= 4, np.float32(2), jnp.where(a >= 2, np.float32(1), np.float32(0.5)))
  n = jnp.floor(a / step)  # exact: step is a power of two
  lo = n * step
  r = a - lo
  if key is None:
    odd = jnp.mod(n, 2) == 1
    up = (r > step / 2) | ((r == step / 2) & odd)
  else:
    up = jax.random.uniform(key, v.shape, jnp.float32) * step < r
  q = jnp.minimum(lo + jnp.where(up, step, np.float32(0)), np.float32(_FP4_MAX))
  return jnp.where(jnp.isnan(v), v, jnp.sign(v) * q)


def nv_tensor_scale(x: jax.Array) -> jax.Array:
  """NVFP4's float32 tensor (encode) scale ``6 * 448 / amax``: 1 for a zero tensor, float32
  max where it would overflow, NaN for a tensor holding an inf or NaN. The amax is the whole
  tensor's: inside ``shard_map`` a ``pmax`` runs over the axes ``x`` is split along (as
  :func:`jmp_scaler.fp8_dot_general`'s), so the scale does not depend on the device count."""
  axes = amax_axes(x)
  amax = jnp.max(jnp.abs(x.astype(_F32)))
  if axes:
    amax = lax.pmax(amax, axes)
  s = np.float32(_FP4_MAX * _FP8_MAX) / amax
  s = jnp.where(amax == 0, np.float32(1), jnp.minimum(s, np.float32(np.finfo(np.float32).max)))
  return jnp.where(jnp.isfinite(amax), s, np.float32(np.nan))


def nv_quantize(x: jax.Array, s_enc: jax.Array, key: jax.Array | None = None,
                tile_2d: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x`` (``[..., R, K]``, ``K`` and with ``tile_2d`` ``R`` multiples of 16) in NVFP4.

  Returns:
    ``(q, d)``: float32 ``q`` on the E2M1 grid, of ``x``'s shape, and the float32 block
    decode scales ``d`` (exact in E4M3), one per element (each block's repeated), so that
    ``x ~= q * d / s_enc``; for 1x16 blocks take ``d[..., ::16]``.
  """
  x32 = x.astype(_F32)
  *lead, r, k = x.shape
  if tile_2d:
    t = x32.reshape(*lead, r // NV_BLOCK, NV_BLOCK, k // NV_BLOCK, NV_BLOCK)
    amax = jnp.max(jnp.abs(t), axis=(-3, -1), keepdims=True)
    amax = jnp.broadcast_to(amax, t.shape).reshape(x.shape)
  else:
    t = x32.reshape(*lead, r, k // NV_BLOCK, NV_BLOCK)
    amax = jnp.max(jnp.abs(t), axis=-1, keepdims=True)
    amax = jnp.broadcast_to(amax, t.shape).reshape(x.shape)
  d = (amax / np.float32(_FP4_MAX)) * s_enc
  m = np.float32(_FP8_MAX)
  d = jnp.where(jnp.isnan(d), d, lax.clamp(np.float32(0), d, m)).astype(E4M3).astype(_F32)
  mult = jnp.where(d == 0, np.float32(0), s_enc / d)
  return e2m1_round(x32 * mult, key), d


def hadamard16(signs: tuple[int, ...] = _RHT_SIGNS) -> np.ndarray:
  """The orthogonal 16x16 random Hadamard matrix ``diag(signs) @ H16 / 4`` (entries +-1/4)."""
  h = np.array([[1.0]])
  for _ in range(4):
    h = np.block([[h, h], [h, -h]])
  return (np.diag(np.array(signs, np.float64)) @ h / 4).astype(np.float32)


def rht(x: jax.Array) -> jax.Array:
  """``x`` (float32, last axis a multiple of 16) times the block-diagonal random Hadamard
  matrix: each 16 consecutive elements of the last axis mixed by :func:`hadamard16`."""
  *lead, k = x.shape
  xb = x.reshape(*lead, k // NV_BLOCK, NV_BLOCK)
  h = jnp.asarray(hadamard16())
  y = lax.dot_general(xb, h, (((xb.ndim - 1,), (0,)), ((), ())),
                      precision=lax.Precision.HIGHEST, preferred_element_type=_F32)
  return y.reshape(x.shape)


# ------------------------------------------------------------ one GEMM each --


class _Site(NamedTuple):
  """Everything static about one canonical block-scaled matmul (a custom_vjp argument)."""

  recipe: Any  # MxFp8Recipe | Nvfp4Recipe
  batched: bool
  a_dtype: np.dtype
  b_dtype: np.dtype
  out_dtype: np.dtype


def _mx_gemm(x, y, x_dtype, y_dtype, rounding, out_dtype):
  """``x [B, P, C] . y [B, Q, C] -> [B, P, Q]``, each operand in MX blocks along C."""
  qx, sx = mx_quantize(x, x_dtype, rounding)
  qy, sy = mx_quantize(y, y_dtype, rounding)
  return _scaled.scaled_matmul(qx, qy, sx, sy, x_dtype, y_dtype, E8M0).astype(out_dtype)


def _nv_gemm(qx, dx, sx, qy, dy, sy, out_dtype):
  """The NVFP4 GEMM of quantised operands (``d`` per element, block scales every 16th)."""
  y = _scaled.scaled_matmul(qx, qy, dx[..., ::NV_BLOCK], dy[..., ::NV_BLOCK], E2M1, E2M1,
                             E4M3)
  return (y * ((np.float32(1) / sx) * (np.float32(1) / sy))).astype(out_dtype)


def _grad_key(recipe: Nvfp4Recipe, g: jax.Array) -> jax.Array:
  """A key for the gradient's stochastic rounding: the seed folded with a hash of ``g``."""
  bits = lax.bitcast_convert_type(g.astype(_F32), jnp.uint32)
  h = jnp.sum(bits * jnp.uint32(2654435761), dtype=jnp.uint32)  # wraps: a cheap hash
  return jax.random.fold_in(jax.random.key(recipe.seed), h)


def _t(x):
  return jnp.swapaxes(x, 1, 2)


def _forward(a, b, site):
  """fprop of ``a [B, M, K]`` and ``b [B, N, K]`` (every dimension a block multiple)."""
  r = site.recipe
  if isinstance(r, MxFp8Recipe):
    return _mx_gemm(a, b, E4M3, E4M3, r.scale_rounding, site.out_dtype)
  sa, sb = nv_tensor_scale(a), nv_tensor_scale(b)
  qa, da = nv_quantize(a, sa)
  qb, db = nv_quantize(b, sb, tile_2d=r.weight_2d and not site.batched)
  return _nv_gemm(qa, da, sa, qb, db, sb, site.out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _block_matmul(a, b, site):
  return _forward(a, b, site)


def _block_matmul_fwd(a, b, site):
  return _forward(a, b, site), (a, b)


def _block_matmul_bwd(site, saved, g):
  a, b = saved  # a [B, M, K], b [B, N, K], g [B, M, N]
  r = site.recipe
  if isinstance(r, MxFp8Recipe):
    gd = r.backward_dtype
    da = _mx_gemm(g, _t(b), gd, E4M3, r.scale_rounding, site.a_dtype)      # over N
    db = _mx_gemm(_t(g), _t(a), gd, E4M3, r.scale_rounding, site.b_dtype)  # over M
    return da, db
  key = _grad_key(r, g) if r.stochastic_rounding else None
  k1, k2 = (None, None) if key is None else jax.random.split(key)
  # dgrad: g in 1x16 blocks along N; b as in fprop (2D tiles: the same values), transposed.
  sg, sb = nv_tensor_scale(g), nv_tensor_scale(b)
  qg, dg = nv_quantize(g, sg, k1)
  if r.weight_2d and not site.batched:
    qb, dbs = nv_quantize(b, sb, tile_2d=True)
    qb, dbs = _t(qb), _t(dbs)
  else:
    qb, dbs = nv_quantize(_t(b), sb)
  da = _nv_gemm(qg, dg, sg, qb, dbs, sb, site.a_dtype)
  # wgrad: g^T and a^T along M, each through the random Hadamard transform first.
  gt, at = _t(g).astype(_F32), _t(a).astype(_F32)
  if r.random_hadamard:
    gt, at = rht(gt), rht(at)
  sgt, sat = nv_tensor_scale(gt), nv_tensor_scale(at)
  qgt, dgt = nv_quantize(gt, sgt, k2)
  qat, dat = nv_quantize(at, sat)
  db = _nv_gemm(qgt, dgt, sgt, qat, dat, sat, site.b_dtype)
  return da, db


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


# ------------------------------------------------------------- the public op --


def _to_bmk(x, batch, contract, free):
  """``x`` transposed and reshaped to ``[batch, free, contract]`` (batch 1 if none)."""
  size = lambda dims: math.prod(x.shape[d] for d in dims)
  y = lax.transpose(x, (*batch, *free, *contract))
  return jnp.reshape(y, (size(batch), size(free), size(contract)))


def _pad_to(x, multiple):
  pads = [(0, 0)] + [(0, -n % multiple) for n in x.shape[1:]]
  return jnp.pad(x, pads) if any(p[1] for p in pads) else x


def block_scaled_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                             preferred_element_type: Any = None, *, out_sharding: Any = None,
                             recipe: MxFp8Recipe | Nvfp4Recipe | None = None) -> jax.Array:
  """:func:`jax.lax.dot_general` as a block-scaled MXFP8 or NVFP4 GEMM, forward and backward.

  A drop-in replacement for ``lax.dot_general`` (any dimension numbers). The operands are
  brought to ``[batch, m, k]`` and ``[batch, n, k]``, zero-padded to a multiple of the block
  size (32 for MXFP8, 16 for NVFP4) along ``m``, ``n`` and ``k`` (exact: zeros add nothing),
  and each of the three GEMMs quantises its operands along its own contracting axis as the
  recipe says (see :class:`MxFp8Recipe`, :class:`Nvfp4Recipe` and the module docstring):

  * fprop ``y = a . b`` over ``k``;
  * dgrad ``da = g . b`` over ``n``;
  * wgrad ``db = g^T . a`` over ``m`` (NVFP4: both through the random Hadamard transform).

  Each GEMM is :func:`jax.nn.scaled_matmul` (on CUDA the ``__op$block_scaled_dot`` custom
  call that XLA:GPU sends to cuDNN on Blackwell and dequantises elsewhere; on CPU the
  operands dequantised in float32 and one float32 dot, jax 0.11's lowering, which jax 0.10
  lacks and jmp_scaler registers) with a float32 result, times NVFP4's tensor scales, cast
  once to the result dtype. An inf or NaN operand gives a non-finite result.

  Args:
    lhs: a float16, bfloat16 or float32 array.
    rhs: a float16, bfloat16 or float32 array (the weight, for NVFP4's 2D tiles).
    dimension_numbers: as for ``lax.dot_general``.
    precision: ``None`` or ``lax.Precision.DEFAULT``.
    preferred_element_type: the result dtype (float32, bfloat16 or float16).
    out_sharding: only ``None``.
    recipe: an :class:`MxFp8Recipe` (the default ``MxFp8Recipe()``) or an
      :class:`Nvfp4Recipe`.

  Returns:
    An array of ``lax.dot_general(lhs, rhs, dimension_numbers)``'s shape and dtype (or
    ``preferred_element_type``).

  Raises:
    ValueError: for a ``recipe`` of another type, dimension numbers that do not fit,
      and (the autocast rule's cue to keep the dot in the compute dtype, with a warning)
      an operand or result dtype other than float16, bfloat16 or float32, a non-default
      precision, an ``out_sharding``, or an unreduced operand.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> x, w = jnp.ones((4, 32)), jnp.full((32, 8), 0.5)
    >>> y = jmp_scaler.block_scaled_dot_general(x, w, (((1,), (0,)), ((), ())))
    >>> y.shape, float(y[0, 0])
    ((4, 8), 16.0)
  """
  recipe = MxFp8Recipe() if recipe is None else recipe
  if not isinstance(recipe, (MxFp8Recipe, Nvfp4Recipe)):
    raise ValueError(f"recipe must be a jmp_scaler.MxFp8Recipe or Nvfp4Recipe, got {recipe!r}")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if np.dtype(x.dtype) not in _OPERAND_DTYPES:
      raise Unsupported(
        f"block_scaled_dot_general takes float16, bfloat16 or float32 operands, got {name} "
        f"of dtype {x.dtype}")
    if unreduced_axes(x):
      raise Unsupported(f"block_scaled_dot_general got an unreduced {name}: reduce it first")
  check_precision(precision, "block_scaled_dot_general", "fp8/fp4")
  if out_sharding is not None:
    raise Unsupported("block_scaled_dot_general does not take out_sharding")
  lc, rc, lb, rb, want = dot_dims("block_scaled_dot_general", lhs, rhs, dimension_numbers,
                                  preferred_element_type)  # fmt: skip
  out_dtype = np.dtype(want.dtype)
  lf = tuple(d for d in range(lhs.ndim) if d not in lc + lb)
  rf = tuple(d for d in range(rhs.ndim) if d not in rc + rb)
  a, b = _to_bmk(lhs, lb, lc, lf), _to_bmk(rhs, rb, rc, rf)
  m, n = a.shape[1], b.shape[1]
  bs = recipe.block_size
  site = _Site(recipe, bool(lb), np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype)
  y = _block_matmul(_pad_to(a, bs), _pad_to(b, bs), site)[:, :m, :n]
  return jnp.reshape(y, want.shape)
