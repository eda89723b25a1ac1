"""FP8 matmuls with per-tensor current scaling, in the form XLA:GPU runs as an fp8 GEMM.

:func:`fp8_dot_general` has :func:`jax.lax.dot_general`'s signature. Each call
scales each operand by its own amax (no state: nothing to checkpoint, skip or
synchronise), casts it to float8, and runs one ``dot_general`` of float8
operands whose float32 result is multiplied by a broadcast float32 scalar and
then cast to the result dtype: the pattern XLA:GPU's ``gemm_rewriter`` turns
into one cuBLASLt fp8 GEMM with the scale folded in, rounded once. The backward
pass (a ``custom_vjp``) casts the output gradient to E5M2 and reuses the saved
float8 operands.

The scaling rule (TransformerEngine's ``Float8CurrentScaling``, torchao's
``amax_to_scale``), per tensor ``x``, in float32::

  amax = max(max(|x|), amax_epsilon)             # over the whole tensor, every device
  s = fp8_max / amax / 2**margin                 # 448 (E4M3FN) or 57344 (E5M2)
  s = 1 if amax == 0;  s = float32_max if s == inf
  s = 2**floor(log2(s)) if use_power_2_scales
  q = clip(x * s, -fp8_max, fp8_max).astype(fp8)   # x == q / s, to fp8's precision

and ``dot(x, w) = dot(q_x, q_w) * (1/s_x * 1/s_w)``, in float32, rounded once
to the result dtype. An inf or NaN in ``x`` makes ``amax`` non-finite, ``s`` 0
or NaN and the result non-finite: it is never clipped to 448, so a loss scaler
sees the overflow and skips the step.
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

from jmp_scaler._validation import integer, one_of, real
from jmp_scaler.jaxcompat._types import unreduced_axes, varying_axes

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_F32 = np.dtype(jnp.float32)
_F16 = np.dtype(jnp.float16)
_BF16 = np.dtype(jnp.bfloat16)
_OPERAND_DTYPES = (_F16, _BF16, _F32)
_FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}
_BACKWARDS = ("fp8", "dequantized", "high_precision")
_MAX_MARGIN = 16


class Unsupported(ValueError):
  """A dot that cannot run as an fp8 GEMM (its dtypes, precision, sharding): what the
  autocast rule catches to keep such a dot in the compute dtype, with a warning."""


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How :func:`fp8_dot_general` scales and casts: per-tensor current scaling.

  The defaults are TransformerEngine's ``Float8CurrentScaling()``: the HYBRID
  format, no margin, scales that are not rounded to a power of two, no amax
  floor, and a backward pass in fp8 on the saved fp8 operands. The recipe is
  frozen and hashable: it is configuration, never state, and can be a static
  argument of :func:`jax.jit`.

  Attributes:
    fp8_format: ``"hybrid"`` (the default): forward operands in E4M3FN (max
      448, 3 mantissa bits), the output gradient in E5M2 (max 57344, 2
      mantissa bits); ``"e4m3"``: E4M3FN everywhere. E5M2 everywhere is
      refused, as TransformerEngine refuses it: cuBLASLt has no E5M2 x E5M2
      GEMM, and XLA:GPU would fall back to a 16-bit dot.
    margin: a non-negative integer ``m`` (at most 16): scales are divided by
      ``2**m``, leaving headroom below the format's maximum (TE's
      ``DelayedScaling.margin``; under current scaling the amax is exact, so
      0 is the usual choice).
    use_power_2_scales: round each scale down to a power of two, so that
      scaling and unscaling are exact (TE's ``use_power_2_scales``) and a
      bfloat16 result comes straight from the GEMM (the factor is exact in
      bfloat16).
    amax_epsilon: a non-negative float32: the amax is at least this (TE's
      ``amax_epsilon``; torchao uses 1e-12). With 0, an all-zero tensor gets
      the scale 1 (and a zero result, never NaN).
    backward: ``"fp8"`` (the default): both backward GEMMs take the output
      gradient in the backward format and the saved fp8 operands;
      ``"dequantized"``: the saved fp8 operands, dequantised, and the output
      gradient in its own dtype, by 16/32-bit GEMMs; ``"high_precision"``:
      the original operands are saved and the backward is the ordinary one
      (TE's ``backward_override`` None, ``"dequantized"``,
      ``"high_precision"``).

  Raises:
    ValueError: for a field outside the ranges above, naming it and its value.

  Examples:
    >>> import jmp_scaler
    >>> recipe = jmp_scaler.Fp8Recipe(use_power_2_scales=True)
    >>> recipe.forward_dtype, recipe.backward_dtype
    (dtype(float8_e4m3fn), dtype(float8_e5m2))
  """

  fp8_format: str = "hybrid"
  margin: int = 0
  use_power_2_scales: bool = False
  amax_epsilon: float = 0.0
  backward: str = "fp8"

  def __post_init__(self):
    one_of("fp8_format", self.fp8_format, tuple(_FORMATS))
    object.__setattr__(self, "margin", integer("margin", self.margin, 0, _MAX_MARGIN))
    if not isinstance(self.use_power_2_scales, (bool, np.bool_)):
      raise ValueError(f"use_power_2_scales must be a bool, got {self.use_power_2_scales!r}")
    object.__setattr__(self, "use_power_2_scales", bool(self.use_power_2_scales))
    eps = real("amax_epsilon", self.amax_epsilon)
    if not (math.isfinite(eps) and 0 <= eps <= float(np.finfo(np.float32).max)):
      raise ValueError(f"amax_epsilon must be a finite float32 >= 0, got {self.amax_epsilon!r}")
    object.__setattr__(self, "amax_epsilon", float(np.float32(eps)))
    one_of("backward", self.backward, _BACKWARDS)

  @property
  def forward_dtype(self) -> np.dtype:
    """The float8 dtype of both forward operands."""
    return _FORMATS[self.fp8_format][0]

  @property
  def backward_dtype(self) -> np.dtype:
    """The float8 dtype of the output gradient in the backward GEMMs."""
    return _FORMATS[self.fp8_format][1]


_DEFAULT_RECIPE = Fp8Recipe()


# ------------------------------------------------------------------ scaling --


def _check_reduced(x: jax.Array) -> None:
  unreduced = unreduced_axes(x)
  if unreduced:
    raise Unsupported(
        f"fp8_dot_general got an operand that is unreduced along {sorted(unreduced)} (a "
        "partial sum): its amax is not known until it is summed; reduce it first")


def amax_axes(x: jax.Array) -> tuple[str, ...]:
  """The mesh axes whose devices each hold a block of ``x``, inside ``shard_map``.

  With ``check_vma=True`` (the default) these are the axes ``x`` varies
  along; without it JAX does not track them, so every manual axis is taken
  (the ``pmax`` of a replicated value is the value itself).
  """
  _check_reduced(x)
  varying = varying_axes(x)
  mesh = jax.sharding.get_abstract_mesh()
  manual = tuple(getattr(mesh, "manual_axes", ()))
  if not manual:
    return ()
  tracked = manual[0] in varying_axes(lax.axis_index(manual[0]))  # check_vma is on
  return tuple(a for a in manual if a in varying) if tracked else manual


def _scale(amax: jax.Array, fp8_max: float, recipe: Fp8Recipe) -> jax.Array:
  """The float32 scale ``s`` of a tensor whose largest magnitude is ``amax``."""
  amax = jnp.maximum(amax, jnp.float32(recipe.amax_epsilon))
  s = jnp.float32(fp8_max * 2.0**-recipe.margin) / amax
  s = lax.select(amax == 0, jnp.float32(1), s)
  s = lax.select(s == jnp.inf, jnp.float32(np.finfo(np.float32).max), s)
  if recipe.use_power_2_scales:  # keep sign and exponent: round down to a power of two
    bits = lax.bitcast_convert_type(s, jnp.uint32) & jnp.uint32(0xFF800000)
    s = lax.select(lax.is_finite(s), lax.bitcast_convert_type(bits, jnp.float32), s)
  return s


def quantize(x: jax.Array, dtype: np.dtype, recipe: Fp8Recipe) -> tuple[jax.Array, jax.Array]:
  """``x`` cast to the float8 ``dtype`` with its current per-tensor scale.

  Returns:
    ``(q, inv)``: ``q`` in ``dtype``, of ``x``'s shape, and the float32
    scalar ``inv = 1 / s`` that dequantises it (``x ~= q * inv``). The amax
    is the whole tensor's: under ``jit`` XLA reduces over every shard, and
    inside ``shard_map`` a ``pmax`` runs over the axes ``x`` is split along.
  """
  axes = amax_axes(x)
  x32 = x.astype(_F32)
  amax = jnp.max(jnp.abs(x32))
  if axes:
    amax = lax.pmax(amax, axes)
  fp8_max = float(jnp.finfo(dtype).max)
  s = _scale(amax, fp8_max, recipe)
  m = jnp.float32(fp8_max)
  q = lax.clamp(-m, x32 * s, m).astype(dtype)  # XLA turns 500 into NaN: clip first
  return q, jnp.float32(1) / s


def _explicit_sharding(like: jax.Array) -> Any:
  """``like``'s sharding under a mesh with explicit axes (where a dot must be told), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if not any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    return None
  return jax.typeof(like).sharding


def _scaled_dot(qa, qb, factor, dims, out_dtype, out_sharding=None, pow2=False):
  """``dot_general(qa, qb) * factor``, rounded once to ``out_dtype``: the fp8 GEMM and the
  float32 scalar XLA:GPU folds into it.

  The GEMM's result is float32 and is multiplied by the float32 ``factor`` before it is
  cast to ``out_dtype``: ``convert(dot(qa, qb) -> f32 * broadcast(factor: f32))``. XLA:GPU's
  ``gemm_rewriter`` folds the multiply into the cuBLASLt fp8 GEMM as its float32 scale
  (``F8ScaleD``); the cast is an elementwise op after it. A bfloat16 factor would be rounded
  to 8 significant bits, the same relative error in every element. float16 results need the
  float32 product anyway: the unscaled product of two fp8 tensors reaches ``448**2 * k``.
  With power-of-two scales (``pow2``) the factor is exact in bfloat16, so a bfloat16 result
  comes straight from the GEMM (``dot(qa, qb) -> bf16 * broadcast(factor: bf16)``, the same
  values: scaling by a power of two does not round) and the GEMM writes half the bytes.
  """
  acc = out_dtype if out_dtype == _F32 or (pow2 and out_dtype == _BF16) else _F32
  y = lax.dot_general(qa, qb, dims, preferred_element_type=acc, out_sharding=out_sharding)
  return (y * factor.astype(acc)).astype(out_dtype)


def _hp_dot(a, b, dims, dtype, out_sharding=None):
  """The 16/32-bit GEMM of the ``"dequantized"`` and ``"high_precision"`` backwards."""
  return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=dtype,
                         out_sharding=out_sharding)


# ---------------------------------------------------- the canonical fp8 GEMM --


class _Site(NamedTuple):
  """Everything static about one canonical matmul (hashable: a custom_vjp argument).

  Each operand is ``[batch,]`` then one free and one contracting dimension, in
  either order: ``a_contract`` and ``b_contract`` are the contracting ones'
  positions (``a_free``, ``b_free`` the others'). The output is ``[batch,] m, n``.
  """

  recipe: Fp8Recipe
  batched: bool
  a_contract: int
  b_contract: int
  a_dtype: np.dtype
  b_dtype: np.dtype
  out_dtype: np.dtype
  out_sharding: Any = None  # the forward GEMM's, under explicit sharding

  @property
  def nb(self) -> int:
    return int(self.batched)

  @property
  def a_free(self) -> int:
    return 2 * self.nb + 1 - self.a_contract

  @property
  def b_free(self) -> int:
    return 2 * self.nb + 1 - self.b_contract

  def dims(self, lc: int, rc: int):
    batch = ((0,), (0,)) if self.batched else ((), ())
    return ((lc,), (rc,)), batch


def _psum_to(ct: jax.Array, like: jax.Array) -> jax.Array:
  """``ct`` summed over the manual axes it varies along and the primal ``like`` does not.

  This is the transpose of the implicit ``pvary`` of a replicated operand
  (a weight inside ``shard_map``) in the forward pass.
  """
  extra = varying_axes(ct) - varying_axes(like)
  if not extra:
    return ct
  order = jax.sharding.get_abstract_mesh().axis_names
  return lax.psum(ct, tuple(a for a in order if a in extra))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(a, b, site):
  return _fp8_matmul_fwd(a, b, site)[0]


def _fp8_matmul_fwd(a, b, site):
  recipe = site.recipe
  qa, ia = quantize(a, recipe.forward_dtype, recipe)
  qb, ib = quantize(b, recipe.forward_dtype, recipe)
  y = _scaled_dot(qa, qb, ia * ib, site.dims(site.a_contract, site.b_contract), site.out_dtype,
                  site.out_sharding, recipe.use_power_2_scales)
  return y, ((a, b) if recipe.backward == "high_precision" else (qa, qb, ia, ib))


def _fp8_matmul_bwd(site, saved, g):
  recipe, nb = site.recipe, site.nb
  if recipe.backward == "fp8":
    qa, qb, ia, ib = saved
    qg, ig = quantize(g, recipe.backward_dtype, recipe)
    # Each GEMM: one saved fp8 operand and the fp8 gradient, never E5M2 x E5M2.
    dot = lambda x, y, lc, rc, s, dtype, like: _scaled_dot(
        x, y, s, site.dims(lc, rc), dtype, _explicit_sharding(like), recipe.use_power_2_scales)
    a, b, g, sa, sb, sg = qa, qb, qg, ia, ib, ig
  else:
    if recipe.backward == "high_precision":
      a, b = saved
    else:
      qa, qb, ia, ib = saved
      a = (qa.astype(_F32) * ia).astype(site.a_dtype)
      b = (qb.astype(_F32) * ib).astype(site.b_dtype)
    dot = lambda x, y, lc, rc, s, dtype, like: _hp_dot(
        x, y, site.dims(lc, rc), dtype, _explicit_sharding(like))
    sa = sb = sg = jnp.float32(1)
  # da = g . b over n, laid out as a is; db = a . g over m, laid out as b is: the
  # operand order puts the result's dimensions where the primal has them.
  if site.a_free < site.a_contract:
    da = dot(g, b, nb + 1, site.b_free, sg * sb, site.a_dtype, saved[0])
  else:
    da = dot(b, g, site.b_free, nb + 1, sb * sg, site.a_dtype, saved[0])
  if site.b_contract < site.b_free:
    db = dot(a, g, site.a_free, nb, sa * sg, site.b_dtype, saved[1])
  else:
    db = dot(g, a, nb, site.a_free, sg * sa, site.b_dtype, saved[1])
  return _psum_to(da, saved[0]), _psum_to(db, saved[1])


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


# ------------------------------------------------------------- the public op --


def _operand(name: str, x: Any) -> jax.Array:
  x = jnp.asarray(x)
  if np.dtype(x.dtype) not in _OPERAND_DTYPES:
    raise Unsupported(
        f"fp8_dot_general takes float16, bfloat16 or float32 operands, got {name} of dtype "
        f"{x.dtype}")
  return x


def check_precision(precision: Any, op: str = "fp8_dot_general", fmt: str = "fp8") -> None:
  """Only the default precision: an explicit request for more cannot be met in ``fmt``."""
  default = (None, lax.Precision.DEFAULT, "default", "DEFAULT", "fastest")
  parts = precision if isinstance(precision, (tuple, list)) else (precision,)
  if not all(any(p is d or p == d for d in default) for p in parts):
    raise Unsupported(
        f"{op} runs in {fmt} and cannot honour precision={precision!r}: pass "
        f"precision=None (or keep this dot out of {fmt})")


def dot_dims(op: str, lhs: Any, rhs: Any, dimension_numbers: Any,
             preferred_element_type: Any) -> tuple[tuple, tuple, tuple, tuple, Any]:
  """(lhs contracting, rhs contracting, lhs batch, rhs batch, the result's shape and dtype)
  of a dot that ``op`` (a low-precision dot_general) computes; raises where
  ``lax.dot_general`` would, and :class:`Unsupported` for a result dtype other than float32,
  bfloat16 or float16."""
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in dims) for dims in (lc, rc, lb, rb))
    want = jax.eval_shape(
        lambda a, b: lax.dot_general(a, b, ((lc, rc), (lb, rb)),
                                     preferred_element_type=preferred_element_type),
        jax.ShapeDtypeStruct(lhs.shape, lhs.dtype), jax.ShapeDtypeStruct(rhs.shape, rhs.dtype))
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"dimension_numbers {dimension_numbers!r} do not fit lhs {lhs.shape} {lhs.dtype} and "
        f"rhs {rhs.shape} {rhs.dtype} (preferred_element_type={preferred_element_type!r}): "
        f"{e}") from None
  out_dtype = np.dtype(want.dtype)
  if out_dtype not in _OPERAND_DTYPES:
    raise Unsupported(
        f"{op} returns float32, bfloat16 or float16, got preferred_element_type="
        f"{preferred_element_type!r} (result dtype {out_dtype})")
  return lc, rc, lb, rb, want


def _canonical(x, batch, contract, free, contract_first):
  """``x`` transposed and reshaped to ``[batch,] free, contract`` (or ``contract, free``)."""
  inner = (contract, free) if contract_first else (free, contract)
  perm = (*batch, *inner[0], *inner[1])
  size = lambda dims: math.prod(x.shape[d] for d in dims)
  shape = ((size(batch),) if batch else ()) + (size(inner[0]), size(inner[1]))
  return jnp.reshape(lax.transpose(x, perm), shape)


def _before(first, second) -> bool:
  """Whether every dimension of ``first`` precedes every one of ``second``."""
  return bool(first) and bool(second) and max(first) < min(second)


def fp8_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                    preferred_element_type: Any = None, *, out_sharding: Any = None,
                    recipe: Fp8Recipe | None = None) -> jax.Array:
  """:func:`jax.lax.dot_general` as an fp8 GEMM with per-tensor current scaling.

  A drop-in replacement for ``lax.dot_general``, for any dimension numbers
  (batch dimensions, several contracting or free dimensions): the operands
  are transposed and reshaped to ``[batch,] m, k`` and ``[batch,] k, n``
  (one batch, one contracting and one free dimension, the only form
  XLA:GPU's ``gemm_rewriter`` makes an fp8 cuBLASLt GEMM of), each is cast
  to float8 with its own scale (see :class:`Fp8Recipe` and the module
  docstring), and the result is reshaped back. Forward and backward:

  * forward: ``dot(q(lhs), q(rhs))`` of E4M3FN operands, times
    ``1/s_lhs * 1/s_rhs``;
  * backward (``custom_vjp``): the output gradient is cast to E5M2 with its
    own scale; the input gradient is ``dot(q(g), q(rhs))`` and the weight
    gradient ``dot(q(lhs), q(g))``, on the saved fp8 operands (never E5M2 x
    E5M2).

  Each GEMM is a ``dot_general`` of float8 operands with a float32 (or
  bfloat16) result, whose only consumer is a multiply by a broadcast scalar:
  the rewriter folds the scale into the GEMM. A float16 result is computed
  in float32 and cast (the unscaled product would pass float16's range).

  Use it wherever a ``dot_general`` is injected: ``nn.Dense(dot_general=...)``,
  ``nn.DenseGeneral``, ``nnx.Linear(dot_general=...)``, ``nnx.Einsum(einsum_op=
  functools.partial(jnp.einsum, _dot_general=fp8_dot_general))``; a
  non-default recipe goes in with ``functools.partial(fp8_dot_general,
  recipe=...)``, and ``dot_general_cls=lambda: fp8_dot_general`` works too.

  An inf or NaN in an operand (or in the output gradient) gives a non-finite
  result, never a value clipped to 448; an all-zero operand gives zeros.
  Inside ``shard_map`` the amax is reduced (``pmax``) over the mesh axes the
  operand varies along, so every device uses the whole tensor's scale.

  Args:
    lhs: a float16, bfloat16 or float32 array.
    rhs: a float16, bfloat16 or float32 array.
    dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
      rhs_batch))``, as for ``lax.dot_general``.
    precision: ``None`` or ``lax.Precision.DEFAULT`` (anything else asks for
      more precision than fp8 has, and raises).
    preferred_element_type: the result dtype (float32, bfloat16 or float16);
      by default ``lax.dot_general``'s.
    out_sharding: as for ``lax.dot_general`` (explicit sharding), for a dot
      with at most one batch and one free dimension per operand.
    recipe: an :class:`Fp8Recipe` (default ``Fp8Recipe()``).

  Returns:
    An array of ``lax.dot_general(lhs, rhs, dimension_numbers)``'s shape and
    dtype (or ``preferred_element_type``).

  Raises:
    ValueError: for an operand or result dtype other than float16, bfloat16
      or float32, dimension numbers that do not fit the shapes, a
      non-default ``precision``, a ``recipe`` that is not an ``Fp8Recipe``,
      an ``out_sharding`` for a dot whose result is reshaped, or an operand
      unreduced along a ``shard_map`` axis.

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> x, w = jnp.ones((4, 32)), jnp.full((32, 8), 0.5)
    >>> y = jmp_scaler.fp8_dot_general(x, w, (((1,), (0,)), ((), ())))
    >>> y.shape, y.dtype, round(float(y[0, 0]), 4)
    ((4, 8), dtype('float32'), 16.0)
  """
  recipe = _DEFAULT_RECIPE if recipe is None else recipe
  if not isinstance(recipe, Fp8Recipe):
    raise ValueError(f"recipe must be a jmp_scaler.Fp8Recipe, got {recipe!r}")
  lhs, rhs = _operand("lhs", lhs), _operand("rhs", rhs)
  check_precision(precision)
  _check_reduced(lhs)
  _check_reduced(rhs)  # all checks before anything is bound
  lc, rc, lb, rb, want = dot_dims("fp8_dot_general", lhs, rhs, dimension_numbers,
                                  preferred_element_type)  # fmt: skip
  out_dtype = np.dtype(want.dtype)
  lf = tuple(d for d in range(lhs.ndim) if d not in lc + lb)
  rf = tuple(d for d in range(rhs.ndim) if d not in rc + rb)
  # Keep each operand's own order of free and contracting dimensions where it has one
  # (x @ w needs no transpose); otherwise [m, k] and [k, n].
  lhs_k_first = _before(lc, lf)
  rhs_k_first = not _before(rf, rc)
  size = lambda x, dims: math.prod(x.shape[d] for d in dims)
  flat = ((size(lhs, lb),) if lb else ()) + (size(lhs, lf), size(rhs, rf))  # [batch,] m, n
  if out_sharding is not None and flat != want.shape:
    raise Unsupported(
        f"fp8_dot_general takes out_sharding only for a dot whose result needs no reshape "
        f"(one batch, one free dimension per operand), got dimension_numbers "
        f"{dimension_numbers!r} for lhs {lhs.shape} and rhs {rhs.shape}")
  a = _canonical(lhs, lb, lc, lf, lhs_k_first)
  b = _canonical(rhs, rb, rc, rf, rhs_k_first)
  nb = int(bool(lb))
  site = _Site(recipe, bool(lb), nb + (0 if lhs_k_first else 1), nb + (0 if rhs_k_first else 1),
               np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype, out_sharding)
  return jnp.reshape(_fp8_matmul(a, b, site), want.shape)
