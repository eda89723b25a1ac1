"""jmp_scaler.fp8_dot_general and Fp8Recipe: per-tensor current scaling, forward and backward.

The oracle is independent of the implementation: the scaling rule written
again in NumPy (ml_dtypes casts), and ``np.einsum`` in float64 on the
dequantised operands. On XLA:CPU an fp8 ``dot_general`` with a float32
result upcasts exactly, so only the float32 sum's rounding separates them.
"""

import functools
import pathlib
import re
import string

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jmp_scaler
from jmp_scaler.lowbit._fp8 import quantize
from tests import _xla

FAST = _xla.compile_options()
fast_jit = functools.partial(jax.jit, compiler_options=FAST)
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)
DN = (((1,), (0,)), ((), ()))  # x @ w
fp8_einsum = functools.partial(jnp.einsum, _dot_general=jmp_scaler.fp8_dot_general)
_quantize = fast_jit(quantize, static_argnums=(1, 2))


def _np_quantized(x, dtype, recipe=None):
  """The scaling rule in NumPy: the dequantised tensor, in float64."""
  recipe = recipe or jmp_scaler.Fp8Recipe()
  x = np.asarray(x, np.float32)
  fmax = np.float32(jnp.finfo(dtype).max)
  amax = max(np.float32(np.max(np.abs(x))), np.float32(recipe.amax_epsilon))
  s = np.float32(1) if amax == 0 else np.float32(fmax / 2**recipe.margin) / amax
  if recipe.use_power_2_scales:
    s = np.float32(2.0 ** np.floor(np.log2(s)))
  q = np.clip(x * s, -fmax, fmax).astype(dtype)
  return q.astype(np.float64) * np.float64(np.float32(1) / s)


def _subscripts(a_ndim, b_ndim, dn):
  """``np.einsum`` subscripts for ``lax.dot_general(a, b, dn)``: ``(a, b, out)``."""
  (lc, rc), (lb, rb) = dn
  letters = iter(string.ascii_letters)
  a, b = [None] * a_ndim, [None] * b_ndim
  for i, j in [*zip(lb, rb, strict=True), *zip(lc, rc, strict=True)]:
    a[i] = b[j] = next(letters)
  a = [c or next(letters) for c in a]
  b = [c or next(letters) for c in b]
  out = [a[i] for i in lb] + [a[i] for i in range(a_ndim) if i not in lb + lc]
  out += [b[j] for j in range(b_ndim) if j not in rb + rc]
  return "".join(a), "".join(b), "".join(out)


# ------------------------------------------------------------------ the recipe


def test_recipe_defaults_are_transformer_engines_float8_current_scaling():
  r = jmp_scaler.Fp8Recipe()
  assert (r.fp8_format, r.margin, r.use_power_2_scales, r.amax_epsilon, r.backward) == (
      "hybrid", 0, False, 0.0, "fp8")
  assert (r.forward_dtype, r.backward_dtype) == (E4M3, E5M2)
  assert jmp_scaler.Fp8Recipe(fp8_format="e4m3").backward_dtype == E4M3
  # Frozen and hashable: configuration, usable as a static argument.
  assert hash(r) == hash(jmp_scaler.Fp8Recipe()) and r == jmp_scaler.Fp8Recipe()
  with pytest.raises(AttributeError):
    r.margin = 1  # type: ignore[misc]
  f = jax.jit(lambda x, recipe: x * recipe.margin, static_argnums=1)
  assert float(f(jnp.ones(()), jmp_scaler.Fp8Recipe(margin=2))) == 2.0


@pytest.mark.parametrize("field, value, match", [
    ("fp8_format", "e5m2", "fp8_format must be one of"),
    ("margin", -1, r"margin must be an integer in \[0, 16\]"),
    ("margin", 1.5, "margin must be an integer"),
    ("use_power_2_scales", 1, "use_power_2_scales must be a bool"),
    ("amax_epsilon", -1e-12, "amax_epsilon must be a finite float32 >= 0"),
    ("amax_epsilon", float("inf"), "amax_epsilon must be a finite float32 >= 0"),
    ("backward", "bf16", "backward must be one of"),
])
def test_recipe_refuses_bad_fields_at_construction(field, value, match):
  with pytest.raises(ValueError, match=match):
    jmp_scaler.Fp8Recipe(**{field: value})


# ----------------------------------------------------------- quantisation edges


def test_quantisation_edges_signed_zero_subnormals_and_the_format_maximum():
  tiny = float(jnp.finfo(E4M3).smallest_subnormal)  # 2**-9
  x = jnp.array([0.0, -0.0, 448.0, -448.0, tiny, -tiny, 3 * tiny, tiny / 2, tiny / 4], jnp.float32)
  q, inv = _quantize(x, E4M3, jmp_scaler.Fp8Recipe())
  assert float(inv) == 1.0  # amax 448: the scale is 1
  got = np.asarray(q).astype(np.float32)
  # Subnormals stay on E4M3's grid; half the smallest one ties to even (0), a quarter is 0.
  np.testing.assert_array_equal(got, [0, 0, 448, -448, tiny, -tiny, 3 * tiny, 0, 0])
  assert np.signbit(got[1]) and not np.signbit(got[0])  # -0 stays -0


def test_values_past_448_saturate_by_the_scale_never_to_nan():
  x = jnp.array([1000.0, -1e6, 448.0, 1.0], jnp.float32)
  assert np.isnan(np.asarray(x.astype(E4M3), np.float32)[[0, 1]]).all()  # the raw cast: NaN
  q, inv = _quantize(x, E4M3, jmp_scaler.Fp8Recipe())
  got = np.asarray(q).astype(np.float64) * float(inv)
  assert float(q[1].astype(jnp.float32)) == -448.0  # the amax maps to the format's maximum
  assert np.isfinite(got).all() and abs(got[1] + 1e6) < 0.1
  np.testing.assert_allclose(got, _np_quantized(x, E4M3), rtol=1e-7)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_operand_gives_a_non_finite_result_never_a_clipped_448(bad):
  x = np.ones((6, 16), np.float32)  # numpy: an eager .at[].set compiles a program
  x[1, 2] = bad
  w = np.ones((16, 8), np.float32)
  f = _fwd_and_vjp(DN, None)
  y, _, _ = f(x, w, np.ones((6, 8), np.float32))
  assert not np.isfinite(np.asarray(y)).all()
  # And in the backward: a non-finite output gradient reaches both input gradients.
  g = np.ones((6, 8), np.float32)
  g[0, 0] = bad
  _, ga, gb = f(np.ones((6, 16), np.float32), w, g)
  assert not np.isfinite(np.asarray(ga)).all() and not np.isfinite(np.asarray(gb)).all()


def test_an_all_zero_operand_gives_zeros_and_zero_gradients_never_nan():
  x, w = jnp.zeros((6, 16), jnp.float32), jnp.ones((16, 8), jnp.float32)
  q, inv = _quantize(x, E4M3, jmp_scaler.Fp8Recipe())
  assert float(inv) == 1.0 and not np.asarray(q, np.float32).any()
  y, gx, gw = _fwd_and_vjp(DN, None)(x, w, jnp.ones((6, 8), jnp.float32))
  assert not np.asarray(y).any() and np.isfinite(np.asarray(gx)).all()
  assert not np.asarray(gw).any()  # dw = x^T g = 0


@pytest.mark.parametrize("recipe", [
    jmp_scaler.Fp8Recipe(margin=2), jmp_scaler.Fp8Recipe(use_power_2_scales=True),
    jmp_scaler.Fp8Recipe(amax_epsilon=1.0)])
def test_margin_power_of_two_scales_and_amax_epsilon(recipe):
  x = jnp.asarray(np.random.default_rng(0).normal(size=64) * 0.3, jnp.float32)
  q, inv = _quantize(x, E4M3, recipe)
  np.testing.assert_allclose(np.asarray(q).astype(np.float64) * float(inv),
                             _np_quantized(x, E4M3, recipe), rtol=1e-7)
  qmax = float(jnp.max(jnp.abs(q.astype(jnp.float32))))
  if recipe.margin:
    assert qmax <= 448 / 2**recipe.margin
  if recipe.use_power_2_scales:
    assert np.log2(float(inv)) == np.round(np.log2(float(inv)))  # unscaling is exact
  if recipe.amax_epsilon:  # amax 1.0 (the floor) instead of max|x| < 1
    assert float(inv) == np.float32(1) / np.float32(448)


# -------------------------------------------------------------------- numerics

CASES = {  # name: (lhs shape, rhs shape, dimension numbers)
    "dense": ((6, 16), (16, 8), DN),
    "dense_3d": ((2, 3, 16), (16, 8), (((2,), (0,)), ((), ()))),
    "rhs_transposed": ((6, 16), (8, 16), (((1,), (1,)), ((), ()))),
    "lhs_transposed": ((16, 6), (16, 8), (((0,), (0,)), ((), ()))),
    "batched": ((4, 6, 16), (4, 16, 8), (((2,), (1,)), ((0,), (0,)))),
    "attention_bqhd_bkhd": ((2, 5, 3, 8), (2, 7, 3, 8), (((3,), (3,)), ((0, 2), (0, 2)))),
    "two_contracting": ((2, 3, 4, 5), (4, 5, 6), (((2, 3), (0, 1)), ((), ()))),
    "interleaved": ((8, 3, 4), (8, 4, 5), (((0, 2), (0, 1)), ((), ()))),
    "vector": ((16,), (16, 8), (((0,), (0,)), ((), ()))),
}


@functools.cache
def _fwd_and_vjp(dn, preferred):
  def f(a, b, g):
    y, vjp = jax.vjp(lambda a, b: jmp_scaler.fp8_dot_general(
        a, b, dn, preferred_element_type=preferred), a, b)
    return y, *vjp(g)

  return fast_jit(f)


@pytest.mark.parametrize("name, dtype, preferred", [
    *[(n, F32, None) for n in CASES],
    ("dense", BF16, None), ("batched", BF16, None), ("dense", F16, None),
    ("dense", BF16, F32),
])
def test_forward_and_backward_match_the_float64_oracle(name, dtype, preferred):
  a_shape, b_shape, dn = CASES[name]
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.normal(size=a_shape), dtype)
  b = jnp.asarray(rng.normal(size=b_shape) * 0.1, dtype)
  out_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), a, b).shape
  out_dtype = np.dtype(preferred or dtype)
  g = jnp.asarray(rng.normal(size=out_shape) * 1e-3, out_dtype)  # gradients are small
  y, ga, gb = _fwd_and_vjp(dn, preferred)(a, b, g)
  assert (y.shape, y.dtype, ga.dtype, gb.dtype) == (out_shape, out_dtype, dtype, dtype)
  sa, sb, so = _subscripts(a.ndim, b.ndim, dn)
  qa, qb = _np_quantized(a, E4M3), _np_quantized(b, E4M3)
  qg = _np_quantized(g, E5M2)
  for got, want in [(y, np.einsum(f"{sa},{sb}->{so}", qa, qb)),
                    (ga, np.einsum(f"{so},{sb}->{sa}", qg, qb)),
                    (gb, np.einsum(f"{sa},{so}->{sb}", qa, qg))]:
    # float32: the float32 sum's rounding; 16 bits: a rounding of the result and the scale.
    rtol = {F32: 1e-5, BF16: 2**-7, F16: 2**-10}[np.dtype(got.dtype)]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol,
                               atol=rtol * np.max(np.abs(want)))


@pytest.mark.parametrize("backward", ["dequantized", "high_precision"])
def test_the_16_bit_backward_modes(backward):
  recipe = jmp_scaler.Fp8Recipe(backward=backward)
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.normal(size=(6, 16)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
  f = lambda a, b: jmp_scaler.fp8_dot_general(a, b, DN, recipe=recipe)
  ga, gb = jax.jit(lambda a, b, g: jax.vjp(f, a, b)[1](g))(a, b, g)  # one program
  qa, qb = (_np_quantized(a, E4M3), _np_quantized(b, E4M3)) if backward == "dequantized" else (
      np.asarray(a, np.float64), np.asarray(b, np.float64))
  g64 = np.asarray(g, np.float64)  # not quantised
  np.testing.assert_allclose(ga, g64 @ qb.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gb, qa.T @ g64, rtol=1e-5, atol=1e-5)
  dots = _dots(jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), (0, 1))).lower(a, b).as_text())
  assert [d["operands"] for d in dots] == [("f8E4M3FN", "f8E4M3FN"), ("f32", "f32"),
                                          ("f32", "f32")]


def test_error_against_float32_is_flat_across_input_scales():
  rng = np.random.default_rng(0)
  a0, b0 = rng.normal(size=(32, 128)), rng.normal(size=(128, 32)) / np.sqrt(128)

  def unscaled(a, b):  # a careful cast with no scale: clipped, never NaN
    c = lambda v: jnp.clip(v, -448, 448).astype(E4M3)
    return lax.dot_general(c(a), c(b), DN, preferred_element_type=jnp.float32)

  def rel(y, ref):
    return float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))

  both = jax.jit(lambda a, b: (jmp_scaler.fp8_dot_general(a, b, DN), unscaled(a, b)))
  errs, naive = [], []
  for scale in (2.0**-10, 1.0, 2.0**10):  # one program for the three scales
    a, b = np.asarray(a0 * scale, np.float32), np.asarray(b0 * scale, np.float32)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    fp8, cast = both(a, b)
    errs.append(rel(fp8, ref))
    naive.append(rel(cast, ref))
  # A power-of-two input scale only shifts every scale: the same fp8 operands, the same error.
  assert max(errs) < 0.05 and max(errs) - min(errs) < 1e-6 * max(errs), errs
  assert naive[0] > 0.3 and naive[2] > 0.3, naive  # underflow at 2**-10, clipping at 2**10


def _rel(y, ref):
  return float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))


@functools.cache
def _rounding_cases():
  """(label, output dtype, recipe, scale, result, float64 product of the quantised operands)
  for every output dtype, both kinds of scale and input scales 2^-10, 1 and 2^10, computed as
  one program. bfloat16 and float32: both operands at the input scale; float16: the lhs only,
  so that the product stays inside float16's normal range (2^-14 to 65504)."""
  rng = np.random.default_rng(3)
  a0, b0 = rng.normal(size=(128, 256)), rng.normal(size=(256, 96)) / 16
  cases = []
  for out in (BF16, F16, F32):
    for pow2 in (False, True):
      for scale in (2.0**-10, 1.0, 2.0**10):
        a = np.asarray(a0 * scale, np.float32)
        b = np.asarray(b0 * (1.0 if out == F16 else scale), np.float32)
        cases.append((out, jmp_scaler.Fp8Recipe(use_power_2_scales=pow2), scale, a, b))
  run = fast_jit(lambda ab: [jmp_scaler.fp8_dot_general(
      a, b, DN, preferred_element_type=out, recipe=r) for (out, r, *_), (a, b) in zip(
          cases, ab, strict=True)])  # fmt: skip
  ys = run([(a, b) for *_, a, b in cases])
  return [(out, r, scale, y, _np_quantized(a, E4M3, r) @ _np_quantized(b, E4M3, r))
          for (out, r, scale, a, b), y in zip(cases, ys, strict=True)]  # fmt: skip


def test_the_scale_is_applied_in_float32_and_the_product_rounded_once_at_every_input_scale():
  # The error against the float64 product of the same fp8 operands is the output dtype's own
  # rounding of that product: no bfloat16-rounded factor (2^-9 relative, one sign everywhere).
  k = 256
  for out, recipe, scale, y, ref in _rounding_cases():
    assert y.dtype == out
    own = _rel(np.asarray(ref, out), ref)  # rounding the exact product to the output dtype
    err = _rel(y, ref)
    # float32: the float32 sum of k products adds up to sqrt(k) roundings of its own.
    slack = np.sqrt(k) * 2.0**-24 if out == F32 else 1e-3 * own
    assert err <= own + slack, (out, recipe.use_power_2_scales, scale, err, own)
    if out == BF16:  # about 1e-3: bfloat16's own rounding, nothing added
      assert 1e-3 < err < 2e-3, (recipe.use_power_2_scales, scale, err)


# ---------------------------------------------------------- the GPU pattern

_DOT = re.compile(r"(%[\w#]+) = stablehlo\.dot_general (%[\w#]+), (%[\w#]+),.*: "
                  r"\(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>")


def _elem(tensor_type):
  return tensor_type.rsplit("x", 1)[-1]


def _indent(line):
  return len(line) - len(line.lstrip())


def _definition(lines, j, name):
  """The line that defines ``name`` as seen from line ``j``: the nearest one before it in its
  own region or an enclosing one (MLIR numbers the values of sibling regions alike: jax 0.12
  inlines each scan body into a ``stablehlo.while`` region of the caller)."""
  level = _indent(lines[j])
  for k in range(j - 1, -1, -1):
    if not lines[k].strip():
      continue
    if _indent(lines[k]) < level:
      level = _indent(lines[k])
    if _indent(lines[k]) == level and re.match(r"\s*" + re.escape(name) + r"(:\d+)? = ", lines[k]):
      return lines[k]
  return ""


def _users(lines, i, name):
  """The lines that use ``name``, defined on line ``i``: those of its own region after it."""
  users = []
  for j in range(i + 1, len(lines)):
    if lines[j].strip() and _indent(lines[j]) < _indent(lines[i]):
      break  # the end of the region
    if re.search(re.escape(name) + r"(?![\w#])", lines[j]):
      users.append(j)
  return users


_SCALAR = re.compile(r"stablehlo\.broadcast_in_dim %[\w#]+, dims = \[\] : \(tensor<(\w+)>\)")
_CONVERT = re.compile(r"(%[\w#]+) = stablehlo\.convert (%[\w#]+) : \(tensor<[^>]*>\) -> "
                      r"tensor<([^>]*)>")


def _dots(text):
  """Every ``dot_general`` of a StableHLO module: its operand and result dtypes; ``scale``, the
  dtype of the broadcast scalar that multiplies it when that multiply is its one consumer (what
  gemm_rewriter folds into the fp8 GEMM), else None; ``out``, the dtype after a float32
  multiply and the cast that is its one consumer, if any (a cast of an f32 result reads as
  the op's own: a StableHLO module does not say who wrote it). Names are resolved by region: the
  users of a value are the lines of its own region after it."""
  found = []
  lines = text.splitlines()
  for i, ln in enumerate(lines):
    m = _DOT.search(ln)
    if not m:
      continue
    name, users = m.group(1), _users(lines, i, m.group(1))
    scale, out = None, _elem(m.group(6))
    mul = re.match(r"\s*(%[\w#]+) = stablehlo\.multiply ", lines[users[0]]) if len(
        users) == 1 else None
    if mul:
      use = lines[users[0]]
      other = [o for o in re.findall(r"%[\w#]+", use.split("=", 1)[1]) if o != name]
      src = _SCALAR.search(_definition(lines, users[0], other[0])) if len(other) == 1 else None
      scale = src.group(1) if src else None
      after = _users(lines, users[0], mul.group(1))
      conv = _CONVERT.search(lines[after[0]]) if len(after) == 1 else None
      if scale == "f32" and conv and conv.group(2) == mul.group(1):
        out = _elem(conv.group(3))
    found.append({"operands": (_elem(m.group(4)), _elem(m.group(5))),
                  "result": _elem(m.group(6)), "scale": scale, "scaled": scale is not None,
                  "out": out})
  return found


def _assert_every_dot_is_an_fp8_gemm(dots, expected, pow2=False):
  """Every dot is gemm_rewriter's fp8 GEMM with its scale applied in float32 before the one
  rounding to the output dtype: ``dot(f8, f8) -> f32``, times a broadcast float32 scalar,
  then an optional cast. With power-of-two scales a bfloat16 GEMM result times a bfloat16
  scalar (exact) is the same product, and is accepted too."""
  assert len(dots) == expected, dots
  for d in dots:
    assert all(o.startswith("f8E") for o in d["operands"]), d  # no 16/32-bit dot is left
    assert d["operands"] != ("f8E5M2", "f8E5M2"), d
    forms = [("f32", "f32")] + [("bf16", "bf16")] * pow2
    assert (d["result"], d["scale"]) in forms, d
    assert d["out"] in ("f32", "bf16", "f16"), d


class DenseStack(nn.Module):
  dtype: object = None
  dot: object = staticmethod(jmp_scaler.fp8_dot_general)

  @nn.compact
  def __call__(self, x):  # x: [batch, 4, 8]
    x = nn.relu(nn.Dense(16, dtype=self.dtype, dot_general=self.dot)(x))
    x = nn.DenseGeneral((2, 4), dtype=self.dtype, dot_general=self.dot)(x)  # two free dims
    return nn.DenseGeneral(3, axis=(-2, -1), dtype=self.dtype, dot_general=self.dot)(x)


class Attention(nn.Module):
  heads: int = 2
  dot: object = staticmethod(jmp_scaler.fp8_dot_general)

  @nn.compact
  def __call__(self, x):  # x: [batch, time, d]
    d = x.shape[-1]
    einsum = functools.partial(jnp.einsum, _dot_general=self.dot)
    proj = lambda: nn.DenseGeneral((self.heads, d // self.heads), dot_general=self.dot)
    q, k, v = proj()(x), proj()(x), proj()(x)  # [b, t, h, hd]
    s = einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
    o = einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return nn.DenseGeneral(d, axis=(-2, -1), dot_general=self.dot)(o)  # two contracting dims


DOT = jmp_scaler.fp8_dot_general


def _grad_text(model, x, transform=lambda apply: apply):
  """The lowered StableHLO of the gradient of ``transform(model.apply)``, to params and x."""
  params = jax.eval_shape(model.init, jax.random.key(0), x)  # lowering needs only shapes
  apply = transform(model.apply)
  loss = lambda p, x: jnp.sum(apply(p, x).astype(jnp.float32) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_every_dot_of_a_dense_stack_forward_dgrad_wgrad_is_the_fp8_gemm_pattern(dtype):
  dots = _dots(_grad_text(DenseStack(dtype=dtype), jnp.ones((2, 4, 8))))
  _assert_every_dot_is_an_fp8_gemm(dots, expected=9)  # 3 layers x (forward, dgrad, wgrad)
  assert {d["out"] for d in dots} == {"bf16" if dtype else "f32"}


def test_every_dot_of_an_attention_block_with_multi_dimensional_einsums_is_fp8():
  dots = _dots(_grad_text(Attention(), jnp.ones((2, 4, 8))))
  _assert_every_dot_is_an_fp8_gemm(dots, expected=18)  # 6 sites x 3


def test_power_of_two_scales_take_a_bfloat16_gemm_result_and_scale_exactly():
  # The factor is a power of two, exact in bfloat16: the GEMM's result can be bfloat16.
  pow2 = functools.partial(DOT, recipe=jmp_scaler.Fp8Recipe(use_power_2_scales=True))
  dots = _dots(_grad_text(DenseStack(dtype=jnp.bfloat16, dot=pow2), jnp.ones((2, 4, 8))))
  _assert_every_dot_is_an_fp8_gemm(dots, expected=9, pow2=True)
  assert {(d["result"], d["scale"], d["out"]) for d in dots} == {("bf16", "bf16", "bf16")}
  with pytest.raises(AssertionError):  # refused where the factor is not a power of two
    _assert_every_dot_is_an_fp8_gemm(dots, expected=9)


def _bf16_factor_dot(a, b, dn, precision=None, preferred_element_type=None, **kw):
  """The form before: the fp8 GEMM's bfloat16 result times the factor rounded to bfloat16."""
  recipe = jmp_scaler.Fp8Recipe()
  (qa, ia), (qb, ib) = quantize(a, E4M3, recipe), quantize(b, E4M3, recipe)
  y = lax.dot_general(qa, qb, dn, preferred_element_type=jnp.bfloat16)
  return y * lax.stop_gradient(ia * ib).astype(jnp.bfloat16)  # as the op's own backward


def test_the_pattern_check_catches_a_bfloat16_factor():
  dots = _dots(_grad_text(DenseStack(dtype=jnp.bfloat16, dot=_bf16_factor_dot),
                          jnp.ones((2, 4, 8))))
  fwd = [d for d in dots if d["operands"] == ("f8E4M3FN", "f8E4M3FN")]
  assert fwd and all((d["result"], d["scale"]) == ("bf16", "bf16") for d in fwd), fwd
  with pytest.raises(AssertionError):
    _assert_every_dot_is_an_fp8_gemm(fwd, expected=len(fwd))


def test_the_pattern_check_catches_a_16_bit_dot():
  # The control: the same stack with lax.dot_general fails the check the tests above pass.
  dots = _dots(_grad_text(DenseStack(dtype=jnp.bfloat16, dot=lax.dot_general),
                          jnp.ones((2, 4, 8))))
  assert len(dots) == 9 and not any(d["scaled"] for d in dots)
  with pytest.raises(AssertionError):
    _assert_every_dot_is_an_fp8_gemm(dots, expected=9)


# ------------------------------------------------------------- flax, NNX, jit


def test_the_docs_example_runs_and_routes_the_einsum_through_fp8():
  doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "fp8.md").read_text()
  namespace = {}
  exec(re.findall(r"```python\n(.*?)```", doc, flags=re.S)[0], namespace)  # noqa: S102
  ones = jnp.ones((2, 4, 2, 8))
  want = DOT(ones, ones, (((3,), (3,)), ((0, 2), (0, 2))))  # b, h, q, k
  np.testing.assert_array_equal(np.asarray(namespace["scores"]), np.asarray(want))
  assert namespace["pow2"].keywords["recipe"].use_power_2_scales


def test_linen_dot_general_cls_and_nnx_linear_and_einsum_run_the_same_op():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 8)), jnp.float32)
  dense = nn.Dense(4, dot_general=DOT)
  params = dense.init(jax.random.key(0), x)
  want = np.asarray(DOT(x, params["params"]["kernel"], DN) + params["params"]["bias"])
  via_cls = nn.Dense(4, dot_general_cls=lambda: DOT).apply(params, x)
  np.testing.assert_array_equal(np.asarray(dense.apply(params, x)), want)
  np.testing.assert_array_equal(np.asarray(via_cls), want)
  lin = nnx.Linear(8, 4, dot_general=DOT, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(
      np.asarray(lin(x)), np.asarray(DOT(x, lin.kernel[...], DN) + lin.bias[...]))
  ein = nnx.Einsum("bd,df->bf", (8, 4), einsum_op=fp8_einsum, rngs=nnx.Rngs(0))
  assert ein.bias is None  # nnx.Einsum has no bias unless asked
  np.testing.assert_array_equal(np.asarray(ein(x)), np.asarray(DOT(x, ein.kernel[...], DN)))
  assert not np.array_equal(np.asarray(ein(x)), np.asarray(x @ ein.kernel[...]))


@pytest.mark.parametrize("call, match", [
    (lambda: DOT(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2)), DN), "lhs of dtype int32"),
    (lambda: DOT(jnp.ones((2, 3)), jnp.ones((4, 2)), DN), r"do not fit lhs \(2, 3\)"),
    (lambda: DOT(jnp.ones((2, 3)), jnp.ones((3, 2)), DN, precision=lax.Precision.HIGHEST),
     "cannot honour precision"),
    (lambda: DOT(jnp.ones((2, 3)), jnp.ones((3, 2)), DN, preferred_element_type=jnp.int32),
     "returns float32, bfloat16 or float16"),
    (lambda: DOT(jnp.ones((2, 3)), jnp.ones((3, 2)), DN, recipe="hybrid"),
     "recipe must be a jmp_scaler.Fp8Recipe"),
    (lambda: DOT(jnp.ones((2, 3, 4)), jnp.ones((4, 2)), (((2,), (0,)), ((), ())),
                 out_sharding=jax.sharding.PartitionSpec()), "out_sharding only for a dot"),
])
def test_bad_arguments_raise_value_errors_naming_them(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_remat_and_scan_over_fp8_layers_match_the_unrolled_stack():
  ws = jnp.asarray(np.random.default_rng(3).normal(size=(3, 8, 8)) / 3, jnp.float32)
  x = jnp.asarray(np.random.default_rng(4).normal(size=(4, 8)), jnp.float32)
  layer = lambda h, w: jnp.tanh(DOT(h, w, DN))

  def scanned(ws, x):
    h, _ = lax.scan(lambda h, w: (jax.checkpoint(layer)(h, w), None), x, ws)
    return jnp.sum(h**2)

  def unrolled(ws, x):
    for w in ws:
      x = layer(x, w)
    return jnp.sum(x**2)

  got = fast_jit(jax.value_and_grad(scanned))(ws, x)
  want = fast_jit(jax.value_and_grad(unrolled))(ws, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
  dots = _dots(jax.jit(jax.grad(scanned)).lower(ws, x).as_text())
  assert dots and all(d["operands"][0].startswith("f8") and d["scaled"] for d in dots)


def test_under_vmap_each_slice_is_scaled_as_its_own_tensor():
  rng = np.random.default_rng(6)
  xs = jnp.asarray(rng.normal(size=(3, 4, 16)) * np.array([1e-3, 1.0, 1e3])[:, None, None],
                   jnp.float32)
  w = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  f = fast_jit(lambda x: DOT(x, w, DN))
  got = fast_jit(jax.vmap(lambda x: DOT(x, w, DN)))(xs)
  for i in range(3):
    np.testing.assert_allclose(got[i], f(xs[i]), rtol=1e-6)


class F16Mlp(nn.Module):
  dot: object = staticmethod(jmp_scaler.fp8_dot_general)
  dtype: object = jnp.float16

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dtype=self.dtype, dot_general=self.dot)(x))
    return nn.Dense(4, dtype=self.dtype, dot_general=self.dot)(x)


def _clipping_dot(a, b, dn, precision=None, preferred_element_type=None, **kw):
  """A dot whose operands are clipped to [-448, 448] (an inf becomes 448), in float32."""
  c = lambda v: jnp.clip(jnp.nan_to_num(v.astype(jnp.float32)), -448, 448)
  return lax.dot_general(c(a), c(b), dn).astype(a.dtype)


@functools.cache
def _f16_run(dot, transform=lambda apply: apply, dtype=jnp.float16):
  """Three steps of float16 inputs through fp8 Dense layers (the second one's input
  overflows), jitted once, run with no host transfer; the states after each step.
  ``transform`` is applied to the model's ``apply`` (an autocast)."""
  chex.clear_trace_counter()  # the count is per step function, not per dot
  model = F16Mlp(dot=dot, dtype=dtype)
  x = jnp.asarray(np.random.default_rng(5).normal(size=(8, 6)), jnp.float32)
  y = jnp.zeros((8, 4), jnp.float32)
  tx = optax.chain(jmp_scaler.dynamic_scale(1.0), optax.adam(1e-2))  # no overflow of its own
  params = fast_jit(model.init)(jax.random.key(0), x)["params"]
  state = jmp_scaler.TrainState.create(apply_fn=transform(model.apply), params=params, tx=tx)

  @fast_jit
  @chex.assert_max_traces(n=1)
  def step(state, x):
    def loss(p):
      out = state.apply_fn({"params": p}, x.astype(jnp.float16)).astype(jnp.float32)
      return jnp.mean((out - y) ** 2)

    _, grads = jmp_scaler.value_and_grad(loss, state)(state.params)
    return state.apply_gradients(grads=grads)

  bad = x.at[2, 1].set(1e5)  # past float16's 65504: inf in the compute dtype
  states = [state]
  with jax.transfer_guard("disallow"):
    for batch in (x, bad, x):
      states.append(step(states[-1], batch))
  return states


def _bits(tree):
  return [np.asarray(a).tobytes() for a in jax.tree.leaves(tree)]


def test_an_overflowing_fp8_operand_makes_the_float16_step_skip_exactly():
  s0, s1, s2, s3 = _f16_run(jmp_scaler.fp8_dot_general)  # jitted once, no host sync
  m = lambda s: jmp_scaler.to_scalars(s.scale_metrics())
  assert [m(s)["skipped"] for s in (s1, s2, s3)] == [0, 1, 0]
  assert [float(s.loss_scale) for s in (s1, s2, s3)] == [1.0, 0.5, 0.5]
  assert _bits(s2.params) == _bits(s1.params) and _bits(s2.opt_state[1]) == _bits(s1.opt_state[1])
  assert int(s2.step) == 1 and int(s3.step) == 2 and _bits(s3.params) != _bits(s2.params)
  # The control: a dot that clipped the inf to 448 would have applied the poisoned step.
  c1, c2 = _f16_run(_clipping_dot)[1:3]
  assert m(c2)["skipped"] == 0 and _bits(c2.params) != _bits(c1.params)


# -------------------------------------------------------------------- fidelity


@functools.cache
def _digits():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  return jnp.asarray(x / 16.0, jnp.float32), jnp.asarray(y, jnp.int32)


def _bf16_dot(a, b, dn, precision=None, preferred_element_type=None, **kw):
  return lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dn,
                         preferred_element_type=jnp.float32)


def _unscaled_fp8_dot(a, b, dn, precision=None, preferred_element_type=None, **kw):
  c = lambda v: jnp.clip(v, -448, 448).astype(E4M3)  # a cast with no scale (clipped)
  return lax.dot_general(c(a), c(b), dn, preferred_element_type=jnp.float32)


@functools.cache
def _digits_trainer(dot):
  """A 64-64-64-10 MLP, 100 Adam steps of 128 examples, compiled once per dot; returns the
  final loss on all 1797 digits. ``shift`` multiplies the inputs and divides the first
  layer's initial weights: the same function, its first matmul 2**10 smaller or larger."""
  x, y = _digits()
  tx = optax.adam(1e-2)

  def loss(p, xb, yb, shift):
    h = xb * shift
    for w, b in p[:-1]:
      h = jax.nn.relu(dot(h, w, DN) + b)
    logits = dot(h, p[-1][0], DN) + p[-1][1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  @fast_jit
  def train(params, key, shift):
    def step(carry, i):
      p, o = carry
      idx = jax.random.randint(jax.random.fold_in(key, i), (128,), 0, x.shape[0])
      g = jax.grad(loss)(p, x[idx], y[idx], shift)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), None

    (p, _), _ = lax.scan(step, (params, tx.init(params)), jnp.arange(100))
    return loss(p, x, y, shift)

  def run(seed, shift):
    sizes = [(64, 64), (64, 64), (64, 10)]
    ks = jax.random.split(jax.random.key(seed), 3)
    ws = [jax.random.normal(k, s) * np.sqrt(2 / s[0]) for k, s in zip(ks, sizes, strict=True)]
    ws[0] = ws[0] / shift
    params = [(w, jnp.zeros(w.shape[1])) for w in ws]
    return float(train(params, jax.random.key(seed + 100), jnp.float32(shift)))

  return run


def test_digits_mlp_with_fp8_dense_layers_trains_within_noise_of_bf16():
  # Seeds 0-2: bf16 0.052 +- 0.012, fp8 0.060 +- 0.011 (f32 0.057 +- 0.009); the bar is
  # 2.5 seed sds of bf16 (seed 0 differs by 0.007, the largest of the three by 0.023).
  bf16 = _digits_trainer(_bf16_dot)(0, 1.0)
  fp8 = _digits_trainer(jmp_scaler.fp8_dot_general)(0, 1.0)
  assert bf16 < 0.1 and abs(fp8 - bf16) < 0.03, (fp8, bf16)


def test_magnitude_shifted_digits_learn_in_fp8_where_unscaled_casts_learn_nothing():
  fp8 = _digits_trainer(jmp_scaler.fp8_dot_general)(0, 2.0**-10)
  unscaled = _digits_trainer(_unscaled_fp8_dot)(0, 2.0**-10)
  assert fp8 < 2.0, fp8  # seeds 0-2: 0.106 +- 0.009 (f32 0.110 +- 0.009)
  assert unscaled > 2.29, unscaled  # ln 10 = 2.303: the inputs flush to zero in E4M3
