"""Block-scaled matmuls: MXFP8 and NVFP4 quantisers, GEMMs and the autocast rules.

The oracle is independent of the implementation: each recipe's quantiser written again in
NumPy (float64 logarithms, ml_dtypes casts) and ``np.einsum`` in float64 of the dequantised
operands. Every GEMM (fprop, dgrad, wgrad) is checked against it within the output dtype's
rounding; the quantisers at their edges by known answers.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jmp_scaler
from jmp_scaler.jaxcompat import _scaled
from jmp_scaler.lowbit import _block as B
from tests import _xla

fast_jit = functools.partial(jax.jit, compiler_options=_xla.compile_options())
DN = (((1,), (0,)), ((), ()))  # x @ w
F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
RNG = np.random.default_rng(0)


# ------------------------------------------------------------------- oracle --


def np_mx(x, dtype=ml_dtypes.float8_e4m3fn, rounding="rceil"):
  """MX quantisation along the last axis (blocks of 32), dequantised, in float64."""
  x = np.asarray(x, np.float32)
  xb = x.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
  amax = np.abs(xb).max(-1, keepdims=True)
  fmax = float(ml_dtypes.finfo(dtype).max)
  emax = int(np.floor(np.log2(fmax)))
  with np.errstate(divide="ignore"):
    e = np.ceil(np.log2(amax / fmax)) if rounding == "rceil" else np.floor(np.log2(amax)) - emax
  e = np.where(amax == 0, -126, np.clip(e, -126, 127))
  scale = 2.0**e
  q = np.clip(xb / scale, -fmax, fmax).astype(np.float32).astype(dtype).astype(np.float64)
  return (q * scale).reshape(x.shape)


def np_nv(x, tile_2d=False):
  """NVFP4 along the last axis (1x16, or 16x16 tiles over the last two), dequantised."""
  x = np.asarray(x, np.float32)
  r, k = x.shape[-2:]
  amax_t = np.float32(np.abs(x).max())
  s_enc = np.float32(1) if amax_t == 0 else np.float32(2688) / amax_t
  if tile_2d:
    t = np.abs(x).reshape(*x.shape[:-2], r // 16, 16, k // 16, 16).max((-3, -1), keepdims=True)
    amax = np.broadcast_to(t, (*x.shape[:-2], r // 16, 16, k // 16, 16)).reshape(x.shape)
  else:
    amax = np.repeat(np.abs(x).reshape(*x.shape[:-1], k // 16, 16).max(-1), 16, -1)
  d = np.minimum(amax / np.float32(6) * s_enc, np.float32(448))
  d = d.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  with np.errstate(divide="ignore", invalid="ignore"):
    mult = np.where(d == 0, np.float32(0), s_enc / d).astype(np.float32)
  v = np.clip(x * mult, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
  return v * d.astype(np.float64) / np.float64(s_enc)


def _within_rounding(got, want, k, out):
  """``got`` is the float64 ``want`` to the output dtype's rounding, plus a float32 sum of
  ``k`` products (each error bounded by 2^-24 of the sum of magnitudes)."""
  got = np.asarray(np.asarray(got, np.float32), np.float64)
  own = np.abs(want) * (2.0**-8 if out == BF16 else 2.0**-24)
  slack = k * 2.0**-23 * np.abs(want).max() + 1e-30
  np.testing.assert_array_less(np.abs(got - want), own + slack + 4 * 2.0**-24 * np.abs(want))


# ----------------------------------------------------------------- recipes --


def test_recipe_defaults_are_the_published_ones_and_bad_fields_raise():
  mx, nv = jmp_scaler.MxFp8Recipe(), jmp_scaler.Nvfp4Recipe()
  assert (mx.scale_rounding, mx.fp8_format, mx.block_size) == ("rceil", "e4m3", 32)
  assert (nv.weight_2d, nv.random_hadamard, nv.stochastic_rounding, nv.block_size) == (
    True, True, True, 16)
  with pytest.raises(ValueError, match="scale_rounding must be one of.*'up'"):
    jmp_scaler.MxFp8Recipe(scale_rounding="up")
  with pytest.raises(ValueError, match="fp8_format must be one of"):
    jmp_scaler.MxFp8Recipe(fp8_format="e5m2")
  with pytest.raises(ValueError, match="random_hadamard must be a bool, got 1"):
    jmp_scaler.Nvfp4Recipe(random_hadamard=1)
  with pytest.raises(ValueError, match="seed"):
    jmp_scaler.Nvfp4Recipe(seed=-1)
  with pytest.raises(ValueError, match="recipe must be a jmp_scaler.MxFp8Recipe"):
    jmp_scaler.block_scaled_dot_general(jnp.ones((2, 32)), jnp.ones((32, 2)), DN,
                                        recipe=jmp_scaler.Fp8Recipe())
  hash(mx), hash(nv)  # static configuration


# ------------------------------------------------------------ MXFP8 scales --


def _bytes(amax, rounding, dtype=B.E4M3):
  return np.asarray(B.mx_scale_exponent(jnp.asarray(amax, jnp.float32), dtype, rounding))


def test_e8m0_rceil_and_floor_at_the_edges():
  assert _bytes([448.0, 449.0, 500.0], "rceil").tolist() == [127, 128, 128]
  assert _bytes([448.0, 449.0, 500.0], "floor").tolist() == [127, 127, 127]
  # amax 500: floor keeps X = 1 and saturates 500 to 448; RCEIL takes X = 2 (500/2 -> 256).
  x = jnp.asarray([[500.0] + [1.0] * 31], jnp.float32)
  q, s = B.mx_quantize(x, rounding="floor")
  assert (float(q[0, 0]), float(s[0, 0])) == (448.0, 1.0)
  q, s = B.mx_quantize(x, rounding="rceil")
  assert (float(q[0, 0]) * float(s[0, 0]), float(s[0, 0])) == (512.0, 2.0)
  # E5M2 (hybrid gradients): 57344 = 1.75 * 2**15 is the edge.
  assert _bytes([57344.0, 57345.0], "rceil", B.E5M2).tolist() == [127, 128]


def test_e8m0_zero_block_subnormal_amax_and_never_0xff():
  q, s = B.mx_quantize(jnp.zeros((1, 32)))
  assert float(s[0, 0]) == 2.0**-126 and not np.any(np.asarray(q))  # byte 1, zeros
  # A float32-subnormal amax: XLA flushes it to zero, so the block is a zero block (byte 1,
  # zeros, never the subnormal byte 0 = 2**-127, which XLA would divide by as by 0).
  block = np.full((1, 32), 3e-39, np.float32)
  q, s = B.mx_quantize(jnp.asarray(block))
  assert float(s[0, 0]) == 2.0**-126 and not np.any(np.asarray(q))
  # The smallest normal amax: X = 2**-126 (clamped), 2**-126 / X = 1 exactly.
  block = np.full((1, 32), 2.0**-126, np.float32)
  q, s = B.mx_quantize(jnp.asarray(block))
  assert (float(s[0, 0]), float(q[0, 0])) == (2.0**-126, 1.0)
  assert _bytes([2.0**-126, 2.0**-120, 2.0**-118, 2.0**-117], "floor").tolist() == [1, 1, 1, 2]
  huge = np.float32([np.finfo(np.float32).max, 1e38, 1.0, 2.0**-140, 0.0])
  for rounding in ("rceil", "floor"):
    got = _bytes(huge, rounding)
    assert got.max() <= 254 and got.min() >= 1, got
  _, s = B.mx_quantize(jnp.asarray([[np.inf] + [1.0] * 31]))
  assert np.isnan(np.asarray(s)).all()  # 0xFF only for a block holding inf or NaN


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mx_quantise_matches_the_numpy_rule_across_magnitudes(rounding):
  x = (RNG.standard_normal((8, 256)) * 2.0 ** RNG.integers(-30, 30, (8, 1))).astype(np.float32)
  q, s = fast_jit(B.mx_quantize, static_argnums=(1, 2))(x, B.E4M3, rounding)
  got = np.asarray(q, np.float64).reshape(8, 8, 32) * np.asarray(s, np.float64)[..., None]
  np.testing.assert_array_equal(got.reshape(8, 256), np_mx(x, rounding=rounding))


# ------------------------------------------------------------- E2M1, NVFP4 --


def test_e2m1_round_to_nearest_even_is_ml_dtypes_cast():
  v = np.concatenate([np.arange(-7, 7, 0.125), RNG.uniform(-8, 8, 4000)]).astype(np.float32)
  want = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(B.e2m1_round(jnp.asarray(v))), want)
  assert np.isnan(np.asarray(B.e2m1_round(jnp.asarray([np.nan])))).all()


def test_e2m1_stochastic_rounding_is_unbiased_on_its_grid():
  vals = np.array([0.1, 0.3, 0.7, 1.2, 1.9, 2.4, 3.3, 4.5, 5.9, -2.7, 1.0, 6.0], np.float32)
  n = 200_000
  v = jnp.asarray(np.repeat(vals[:, None], n, 1))
  q = np.asarray(fast_jit(B.e2m1_round)(v, jax.random.key(7)), np.float64)
  grid = np.array(B.E2M1_GRID)
  for i, x in enumerate(vals):
    lo = grid[grid <= abs(x)].max()
    hi = grid[grid >= abs(x)].min()
    assert set(np.unique(np.abs(q[i]))) <= {lo, hi}, x  # only the two neighbours
    # the mean is x to within 8 standard errors (p(1-p) <= 1/4): a fixed key, no flake
    assert abs(q[i].mean() - x) <= 8 * (hi - lo) * 0.5 / np.sqrt(n), (x, q[i].mean())


def test_nvfp4_two_level_scale_is_exact_for_constant_blocks():
  for c_max in (8.0, 0.375, 3.0e-3):
    blocks = [c_max * 2.0**-j for j in range(6)] + [-c_max * 2.0**-3, 0.0]
    x = np.repeat(np.asarray(blocks, np.float32), 16)[None, :]
    s = B.nv_tensor_scale(jnp.asarray(x))
    assert float(s) == np.float32(2688) / np.float32(c_max)
    q, d = B.nv_quantize(jnp.asarray(x), s)
    deq = np.asarray(q, np.float64) * np.asarray(d, np.float64) / np.float64(np.float32(s))
    assert np.all(np.asarray(q)[np.asarray(x) != 0] != 0)
    np.testing.assert_allclose(deq, x, rtol=2.0**-22)  # q = +-6 each: one float32 rounding
    if np.log2(c_max).is_integer():
      np.testing.assert_array_equal(deq, x)
    np.testing.assert_array_equal(deq, np_nv(x))


def test_nvfp4_quantise_matches_the_numpy_rule_1x16_and_16x16():
  x = (RNG.standard_normal((32, 64)) * RNG.uniform(0.01, 10, (32, 1))).astype(np.float32)
  for tile in (False, True):
    s = B.nv_tensor_scale(jnp.asarray(x))
    q, d = B.nv_quantize(jnp.asarray(x), s, tile_2d=tile)
    deq = np.asarray(q, np.float64) * np.asarray(d, np.float64) / np.float64(np.float32(s))
    np.testing.assert_array_equal(deq, np_nv(x, tile))


def test_random_hadamard_transform_is_orthogonal():
  h = B.hadamard16().astype(np.float64)
  np.testing.assert_array_equal(h @ h.T, np.eye(16))
  x, g = RNG.standard_normal((24, 64)), RNG.standard_normal((40, 64))  # contract the 64
  xh = np.asarray(B.rht(jnp.asarray(x, jnp.float32)), np.float64)
  gh = np.asarray(B.rht(jnp.asarray(g, jnp.float32)), np.float64)
  np.testing.assert_allclose(xh @ gh.T, x @ g.T, atol=1e-5)
  assert np.abs(xh - x).max() > 0.1  # it did transform


# ---------------------------------------------------------------- the GEMMs --


def _grads(recipe, x, w, gout, out=F32):
  f = lambda x, w: jmp_scaler.block_scaled_dot_general(
    x, w, DN, preferred_element_type=out, recipe=recipe)
  y, vjp = jax.vjp(f, x, w)
  return (y, *vjp(jnp.asarray(gout, y.dtype)))


def jit_grads(recipe, x, w, gout):
  return fast_jit(_grads, static_argnums=0)(recipe, x, w, gout)


@pytest.mark.parametrize("out", [F32, BF16])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mxfp8_fprop_dgrad_wgrad_against_the_float64_oracle(rounding, out):
  m, k, n = 64, 96, 32
  x = RNG.standard_normal((m, k)).astype(np.float32)
  w = (RNG.standard_normal((k, n)) / 8).astype(np.float32)
  g = RNG.standard_normal((m, n)).astype(np.float32)
  y, dx, dw = fast_jit(_grads, static_argnums=(0, 4))(
    jmp_scaler.MxFp8Recipe(rounding), x, w, g, out)
  q = functools.partial(np_mx, rounding=rounding)
  _within_rounding(y, q(x) @ q(w.T).T, k, out)
  g_rows = np.asarray(np.asarray(g, out), np.float32)  # the cotangent arrives in y's dtype
  _within_rounding(dx, q(g_rows) @ q(w).T, n, F32)         # over N
  _within_rounding(dw, (q(g_rows.T) @ q(x.T).T).T, m, F32)  # over M


def test_mxfp8_hybrid_quantises_the_gradient_in_e5m2():
  x = RNG.standard_normal((32, 64)).astype(np.float32)
  w = RNG.standard_normal((64, 32)).astype(np.float32)
  g = (RNG.standard_normal((32, 32)) * 1e3).astype(np.float32)
  _, dx, _ = jit_grads(jmp_scaler.MxFp8Recipe(fp8_format="hybrid"), x, w, g)
  _within_rounding(dx, np_mx(g, ml_dtypes.float8_e5m2) @ np_mx(w).T, 32, F32)


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_fprop_dgrad_wgrad_against_the_float64_oracle(rht, two_d):
  m, k, n = 48, 64, 32
  x = RNG.standard_normal((m, k)).astype(np.float32)
  w = (RNG.standard_normal((k, n)) / 8).astype(np.float32)
  g = RNG.standard_normal((m, n)).astype(np.float32)
  recipe = jmp_scaler.Nvfp4Recipe(weight_2d=two_d, random_hadamard=rht, stochastic_rounding=False)
  y, dx, dw = fast_jit(_grads, static_argnums=(0,))(recipe, x, w, g)
  wq = np_nv(w.T, two_d)  # [N, K] as the right operand
  _within_rounding(y, np_nv(x) @ wq.T, k, F32)
  _within_rounding(dx, np_nv(g) @ (wq if two_d else np_nv(w).T), n, F32)
  gt, xt = g.T, x.T
  if rht:
    gt, xt = (np.asarray(B.rht(jnp.asarray(a))) for a in (gt, xt))
  _within_rounding(dw, (np_nv(gt) @ np_nv(xt).T).T, m, F32)


def test_nvfp4_stochastic_rounding_of_the_gradient_is_seeded_and_unbiased():
  x = RNG.standard_normal((32, 64)).astype(np.float32)
  w = RNG.standard_normal((64, 32)).astype(np.float32)
  g = RNG.standard_normal((32, 32)).astype(np.float32)
  run = fast_jit(_grads, static_argnums=(0,))
  r0, r1 = jmp_scaler.Nvfp4Recipe(seed=0), jmp_scaler.Nvfp4Recipe(seed=1)
  a, b, c = run(r0, x, w, g), run(r0, x, w, g), run(r1, x, w, g)
  np.testing.assert_array_equal(a[1], b[1])  # deterministic for one seed and gradient
  assert not np.array_equal(a[1], c[1]) and not np.array_equal(a[2], c[2])
  np.testing.assert_array_equal(a[0], c[0])  # the forward pass never rounds stochastically


@pytest.mark.parametrize("recipe", [jmp_scaler.MxFp8Recipe(), jmp_scaler.Nvfp4Recipe()])
def test_shapes_off_the_block_are_zero_padded_exactly(recipe):
  m, k, n = 20, 40, 24  # none a multiple of 16 or 32
  x = RNG.standard_normal((m, k)).astype(np.float32)
  w = RNG.standard_normal((k, n)).astype(np.float32)
  g = RNG.standard_normal((m, n)).astype(np.float32)
  pad = lambda a, r, c: np.pad(a, ((0, r - a.shape[0]), (0, c - a.shape[1])))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    y, dx, dw = jit_grads(recipe, x, w, g)
  up = lambda d: -(-d // recipe.block_size) * recipe.block_size  # the same padded shapes
  yp, dxp, dwp = jit_grads(recipe, pad(x, up(m), up(k)), pad(w, up(k), up(n)), pad(g, up(m), up(n)))
  np.testing.assert_array_equal(y, yp[:m, :n])
  np.testing.assert_array_equal(dx, dxp[:m, :k])
  np.testing.assert_array_equal(dw, dwp[:k, :n])
  assert y.shape == (m, n) and dx.shape == (m, k) and dw.shape == (k, n)


@pytest.mark.parametrize("recipe", [jmp_scaler.MxFp8Recipe(), jmp_scaler.Nvfp4Recipe()])
def test_non_finite_operands_give_non_finite_results_and_zeros_give_zeros(recipe):
  x = RNG.standard_normal((32, 64)).astype(np.float32)
  w = RNG.standard_normal((64, 32)).astype(np.float32)
  dot = fast_jit(lambda x, w: jmp_scaler.block_scaled_dot_general(x, w, DN, recipe=recipe))
  assert np.isfinite(np.asarray(dot(x, w))).all()
  for bad in (np.inf, np.nan):
    y = dot(np.where(np.arange(64) == 3, bad, x), w)
    assert not np.isfinite(np.asarray(y)).all()
  y, dx, dw = jit_grads(recipe, np.zeros_like(x), w, np.ones((32, 32), np.float32))
  assert not np.asarray(y).any() and not np.asarray(dw).any() and np.isfinite(dx).all()


def test_batched_and_multi_dimensional_dots():
  a = RNG.standard_normal((2, 3, 16, 32)).astype(np.float32)
  b = RNG.standard_normal((2, 32, 5, 16)).astype(np.float32)
  dn = (((3,), (1,)), ((0,), (0,)))
  dot = fast_jit(jmp_scaler.block_scaled_dot_general, static_argnums=2,
                 static_argnames="recipe")
  y = dot(a, b, dn, recipe=jmp_scaler.MxFp8Recipe())
  want = np.einsum("bijk,bklm->bijlm", np_mx(a), np_mx(np.moveaxis(b, 1, -1)).transpose(0, 3, 1, 2))
  _within_rounding(y, want, 32, F32)
  # NVFP4: a batched right operand is no weight: 1x16 blocks along K, never 16x16 tiles.
  y = dot(a, b, dn, recipe=jmp_scaler.Nvfp4Recipe())
  bt = np.moveaxis(b, 1, -1).reshape(2, 80, 32)  # [batch, l*m, k], the op's canonical form
  want = np.einsum("bijk,blk->bijl", np_nv(a.reshape(2, 48, 32)).reshape(a.shape), np_nv(bt))
  _within_rounding(y, want.reshape(2, 3, 16, 5, 16), 32, F32)


def test_every_gemm_lowers_to_the_block_scaled_dot_on_cuda():
  x, w = jnp.ones((64, 64)), jnp.ones((64, 32))
  for recipe, elem, scale in ((jmp_scaler.MxFp8Recipe(), "f8E4M3FN", "f8E8M0FNU"),
                              (jmp_scaler.Nvfp4Recipe(), "f4E2M1FN", "f8E4M3FN")):
    loss = lambda x, w, r=recipe: jnp.sum(jmp_scaler.block_scaled_dot_general(x, w, DN, recipe=r))
    exp = jax.export.export(
      jax.jit(jax.value_and_grad(loss, (0, 1))), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_scaled.BLOCK_SCALED_DOT)],
    )(x, w)
    calls = [ln for ln in exp.mlir_module().splitlines() if _scaled.BLOCK_SCALED_DOT in ln]
    assert len(calls) == 3, calls  # fprop, dgrad, wgrad
    assert all(f"x{elem}>" in c and f"x{scale}>" in c and "dequantize_type" in c for c in calls)


# ---------------------------------------------------------------- autocast --


def _net(p, x):
  return jax.nn.relu(x @ p["w1"]) @ p["w2"]


def _mlp(p, x):
  return jnp.mean((_net(p, x) - 1.0) ** 2)


def _rules_and_net():
  p = {"w1": jnp.asarray(RNG.standard_normal((32, 64)) / 6, jnp.float32),
       "w2": jnp.asarray(RNG.standard_normal((64, 16)) / 8, jnp.float32)}
  x = jnp.asarray(RNG.standard_normal((48, 32)), jnp.float32)
  for rule in ("mxfp8", "nvfp4", jmp_scaler.Nvfp4Recipe(random_hadamard=False)):
    net = jmp_scaler.autocast(_net, "p=f32,c=bf16,o=f32", rules={"dot_general": rule})
    yield rule, net, p, x


def test_autocast_rules_mxfp8_and_nvfp4_bind_the_block_scaled_op():
  for rule, net, p, x in _rules_and_net():
    recipe = jmp_scaler.MxFp8Recipe() if rule == "mxfp8" else (
      rule if not isinstance(rule, str) else jmp_scaler.Nvfp4Recipe())
    bsd = functools.partial(jmp_scaler.block_scaled_dot_general, recipe=recipe,
                            preferred_element_type=jnp.bfloat16)
    # the rule quantises the operands as they come (float32 here), the result in bfloat16
    by_hand = fast_jit(lambda p, x, bsd=bsd: bsd(jax.nn.relu(bsd(x, p["w1"], DN)), p["w2"], DN))
    np.testing.assert_array_equal(fast_jit(net)(p, x), by_hand(p, x))


@pytest.mark.slow  # compiles and runs a training step per rule
def test_autocast_rules_mxfp8_and_nvfp4_train():
  for _, net, p, x in _rules_and_net():
    f = lambda p, x, net=net: jnp.mean((net(p, x).astype(jnp.float32) - 1.0) ** 2)
    step = jax.jit(lambda p, f=f, x=x: jax.tree.map(lambda a, g: a - 0.2 * g, p, jax.grad(f)(p, x)))
    q = p
    for _ in range(30):
      q = step(q)
    assert float(f(q, x)) < 0.7 * float(f(p, x))


def test_autocast_block_rules_validate_and_fall_back_with_a_warning_naming_the_op():
  with pytest.raises(ValueError, match=r"rules\['conv_general_dilated'\] is 'nvfp4'"):
    jmp_scaler.autocast(_mlp, "p=f32,c=bf16,o=f32", rules={"conv_general_dilated": "nvfp4"})
  with pytest.raises(ValueError, match=r"must be one of .*'mxfp8'.*Nvfp4Recipe"):
    jmp_scaler.autocast(_mlp, "p=f32,c=bf16,o=f32", rules={"dot_general": "mxfp6"})
  f = lambda w, x: jnp.sum(jnp.dot(x, w, precision=lax.Precision.HIGHEST))
  g = jmp_scaler.autocast(f, "p=f32,c=bf16,o=f32", rules={"dot_general": "mxfp8"})
  with pytest.warns(UserWarning, match="dot_general at .* does not run in fp8.*precision"):
    g(jnp.ones((32, 4)), jnp.ones((4, 32)))


def test_the_head_stays_in_bfloat16_under_a_nested_autocast():
  p = {"w1": jnp.asarray(RNG.standard_normal((32, 64)) / 6, jnp.float32),
       "w2": jnp.asarray(RNG.standard_normal((64, 16)) / 8, jnp.float32)}
  x = jnp.asarray(RNG.standard_normal((48, 32)), jnp.float32)
  head = jmp_scaler.autocast(lambda w, h: h @ w, "p=f32,c=bf16,o=f32")

  def model(p, x):
    return jnp.sum(head(p["w2"], jax.nn.relu(x @ p["w1"])))

  f = jmp_scaler.autocast(model, "p=f32,c=bf16,o=f32", rules={"dot_general": "nvfp4"})
  text = str(jax.make_jaxpr(f)(p, x))
  plain = jmp_scaler.autocast(lambda w, h: jnp.sum(h @ w), "p=f32,c=bf16,o=f32")
  h = jax.nn.relu(jmp_scaler.block_scaled_dot_general(
    x, p["w1"], DN, recipe=jmp_scaler.Nvfp4Recipe(),
    preferred_element_type=jnp.bfloat16))
  assert float(f(p, x)) == float(plain(p["w2"], h))  # the head: an ordinary bf16 dot
  assert "bf16[48,64]" in text


@pytest.mark.parametrize("rule", ["mxfp8", "nvfp4"])
def test_an_overflowing_operand_through_the_block_rules_makes_the_step_skip_exactly(rule):
  from tests.test_fp8 import _bits, _f16_run

  # tests/test_fp8.py's linen MLP, float16 input overflowing at the second step (an inf
  # operand of the first dot), jitted once (chex.assert_max_traces) with no host transfer.
  f16 = lambda apply: jmp_scaler.autocast(apply, "p=f32,c=f16,o=f32", rules={"dot_general": rule})
  s0, s1, s2, s3 = _f16_run(lax.dot_general, f16, None)
  m = lambda s: jmp_scaler.to_scalars(s.scale_metrics())
  assert [m(s)["skipped"] for s in (s1, s2, s3)] == [0, 1, 0]
  assert _bits(s2.params) == _bits(s1.params) and _bits(s2.opt_state[1]) == _bits(s1.opt_state[1])
  assert int(s2.step) == 1 and int(s3.step) == 2 and _bits(s3.params) != _bits(s2.params)


@pytest.mark.parametrize("recipe", [jmp_scaler.MxFp8Recipe(), jmp_scaler.Nvfp4Recipe()])
def test_the_op_called_by_hand_inside_autocast_keeps_its_numerics(recipe):
  # autocast enters the op's custom_vjp: it meets scaled_matmul of 8-bit operands (on jax 0.10
  # too, through the registered CPU lowering), never a float32 dot it would narrow to float16.
  x = RNG.standard_normal((32, 64)).astype(np.float32)
  w = RNG.standard_normal((64, 32)).astype(np.float32)
  f = lambda x, w: jmp_scaler.block_scaled_dot_general(x, w, DN, recipe=recipe)
  for policy in ("p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"):
    np.testing.assert_array_equal(jmp_scaler.autocast(f, policy)(x, w), f(x, w))
  assert "scaled_matmul" in str(jax.make_jaxpr(f)(x, w))


@pytest.mark.slow  # traces the char-GPT three times (a few seconds)
def test_the_char_gpt_nvfp4_recipe_keeps_attention_the_last_block_and_the_head_in_bf16():
  # docs/fp8.md's "NVFP4 recipe" row (bench_autocast.py --block-scaled): nested autocast
  # regions with no rule keep what the recipe keeps in bf16; the other linear layers are FP4.
  import argparse
  import pathlib
  import runpy
  import sys

  bench = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
  sys.path.insert(0, str(bench))
  try:
    setups = runpy.run_path(str(bench / "bench_autocast.py"))["block_setups"]
    import bench_bf16
  finally:
    sys.path.remove(str(bench))
  task = bench_bf16.gpt_task(argparse.Namespace(
    seq=16, d_model=16, gpt_layers=2, gpt_batch=4, gpt_steps=1, gpt_lr=1e-3))
  p = task.init(jax.random.key(0))
  x, y = jnp.asarray(task.x_train[:4]), jnp.asarray(task.y_train[:4])
  fns = setups(task, jmp_scaler.get_policy("p=f32,c=bf16,o=f32"))
  assert list(fns) == ["mxfp8", "nvfp4", "nvfp4 -rht -sr", "nvfp4 recipe"]
  one = str(jax.make_jaxpr(lambda a, b: jmp_scaler.block_scaled_dot_general(
    a, b, DN, recipe=jmp_scaler.Nvfp4Recipe()))(jnp.ones((16, 16)), jnp.ones((16, 16))))
  per_dot = one.count("scaled_matmul")
  recipe = str(jax.make_jaxpr(fns["nvfp4 recipe"])(p, x, y))
  every = str(jax.make_jaxpr(fns["nvfp4"])(p, x, y))
  bf16_dots = lambda t: len(re.findall(r"bf16\[[^\]]*\] = dot_general", t))
  # FP4: the first block's qkv, out, up and down; bf16: both blocks' two attention einsums,
  # the last block's four projections and the tied head
  assert recipe.count("scaled_matmul") == 4 * per_dot and bf16_dots(recipe) == 2 * 2 + 4 + 1
  assert bf16_dots(every) == 0 and every.count("scaled_matmul") > recipe.count("scaled_matmul")
  loss = lambda f: float(f(p, x, y)[0])
  assert abs(loss(fns["nvfp4 recipe"]) - float(task.loss_acc(p, x, y)[0])) < 0.05
