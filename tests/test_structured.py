"""autocast through every structured primitive, the cases that break when JAX moves its internals.

Each case is a function a user writes (a scan over layers, a float16 carry, a region kept in
float32 inside a loop body, closed-over arrays in custom derivatives, linear algebra after a
half-precision matmul) and asserts both the dtypes autocast chose, read from the jaxpr of every
nested body, and the values against plain float32. CI runs them on the oldest and the newest
JAX the project declares (jax 0.10.2 and 0.12.x bind ``scan`` with different parameters and
close jaxprs differently: jmp_scaler/jaxcompat/).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_scaler import autocast, full_precision
from tests import _xla
from tests.test_autocast_fn import eqns, in_dtypes

F16 = "p=f32,c=f16,o=f32"
fast_jit = functools.partial(jax.jit, compiler_options=_xla.compile_options())
_RNG = np.random.default_rng(7)
W = jnp.asarray(_RNG.normal(size=(8, 8)) / 3, jnp.float32)
XS = jnp.asarray(_RNG.normal(size=(5, 8)), jnp.float32)
WS = jnp.asarray(_RNG.normal(size=(3, 8, 8)) / 3, jnp.float32)
ROW = jnp.arange(8.0, dtype=jnp.float32) / 8  # closed over by the functions below


def dtypes_of(fn, *args, names=("dot_general", "exp", "log1p", "reduce_sum")):
  return in_dtypes(fn, *args, names=names)


def assert_close_to_float32(fn, *args, tol=3e-2):
  """autocast(fn) and fn, and their gradients in the first argument, in one program."""
  loss = lambda f: lambda *a: jnp.sum(jax.tree.leaves(f(*a))[0].astype(jnp.float32))
  got, want, g_got, g_want = fast_jit(lambda *a: (
      autocast(fn, F16)(*a), fn(*a), jax.grad(loss(autocast(fn, F16)))(*a),
      jax.grad(loss(fn))(*a)))(*args)  # fmt: skip
  for a, b in zip(jax.tree.leaves((got, g_got)), jax.tree.leaves((want, g_want)), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)  # fmt: skip
  return got, g_got


def test_scan_over_layers_with_consts_nested_and_reversed():
  def stack(ws, x):  # a scan over layers, a closed-over array, a nested scan inside
    def layer(h, w):
      inner, _ = lax.scan(lambda g, r: (jnp.tanh(g @ w + r * ROW), None), h, XS[:2])
      return inner, jnp.log1p(jnp.abs(inner)).sum()
    h, logs = lax.scan(layer, x, ws, reverse=True, unroll=2)
    return h, logs

  x = XS[0]
  f = autocast(stack, F16)
  names = [e.primitive.name for e in eqns(jax.make_jaxpr(f)(WS, x))]
  assert names.count("scan") == 2  # the nested scan is rewritten, not run as traced
  got = dtypes_of(f, WS, x)
  assert got["dot_general"] == {"float16"} and got["log1p"] == {"float32"}
  (h, logs), _ = assert_close_to_float32(stack, WS, x)
  assert h.dtype == jnp.float32 and logs.shape == (3,)


def test_scan_without_xs_and_over_a_remat_body():
  body = jax.checkpoint(lambda h, _: (jnp.tanh(h @ W), jnp.exp(h).sum()))
  fn = lambda h: lax.scan(body, h, None, length=4)
  got = dtypes_of(autocast(fn, F16), XS[0])
  assert got["dot_general"] == {"float16"} and got["exp"] == {"float32"}
  names = {e.primitive.name for e in eqns(jax.make_jaxpr(autocast(fn, F16))(XS[0]))}
  assert "scan" in names and names & {"remat2", "checkpoint"}
  assert_close_to_float32(fn, XS[0])


def test_a_float16_carry_through_scan_is_widened_where_its_body_widens_it():
  # The carry starts in float16; exp(c) runs in float32 (torch's float32 list) and the add
  # promotes, so the carry the body returns is float32: the loop carries float32 from the
  # first step, as if the user had written the carry in float32.
  def fn(c, xs):
    return lax.scan(lambda c, x: (c * x.astype(c.dtype) + 0.1 * jnp.exp(c), c.sum()), c, xs)

  c16 = jnp.full(8, 0.5, jnp.float16)
  carry, ys = jax.jit(autocast(fn, F16))(c16, XS[:3])
  assert carry.dtype == jnp.float32 and ys.dtype == jnp.float32
  scan = next(e for e in eqns(jax.make_jaxpr(autocast(fn, F16))(c16, XS[:3]))
              if e.primitive.name == "scan")  # fmt: skip
  assert {str(v.aval.dtype) for v in scan.outvars} == {"float32"}
  ref = fn(c16.astype(jnp.float32), XS[:3])
  np.testing.assert_allclose(carry, ref[0], rtol=2e-3)
  # A carry that its body keeps in float16 (a matmul only) stays float16 through the loop
  # (the function's output is then cast to the policy's float32 output dtype).
  keep = lambda c, xs: lax.scan(lambda c, x: (jnp.tanh(c @ W.astype(c.dtype)), None), c, xs)[0]
  scan = next(e for e in eqns(jax.make_jaxpr(autocast(keep, F16))(c16, XS[:3]))
              if e.primitive.name == "scan")  # fmt: skip
  assert [str(v.aval.dtype) for v in scan.outvars] == ["float16"]


def test_full_precision_inside_a_scan_body():
  def fn(h, xs):
    def body(h, x):
      h = jnp.tanh(h @ W + x)  # float16 matmul
      return full_precision(lambda h: h @ W)(h), h.sum()  # this one in float32
    return lax.scan(body, h, xs)

  closed = jax.make_jaxpr(autocast(fn, F16))(XS[0], XS)
  regions = [e for e in eqns(closed) if e.primitive.name == "jit"
             and e.params["name"].startswith("jmp_full_precision")]  # fmt: skip
  assert len(regions) == 1
  inside = {str(v.aval.dtype) for e in eqns(regions[0].params["jaxpr"])
            if e.primitive.name == "dot_general" for v in e.invars}  # fmt: skip
  assert inside == {"float32"}
  assert dtypes_of(autocast(fn, F16), XS[0], XS)["dot_general"] == {"float16", "float32"}
  assert_close_to_float32(fn, XS[0], XS)


def test_while_fori_and_switch_with_closed_over_arrays():
  def fn(x):
    y = lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ W) + ROW, x)
    z = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.tanh(c[1] @ W) * ROW), (0, y))
    branches = [lambda v: v @ W, lambda v: jnp.exp(v), lambda v: v * ROW]
    return lax.switch(1, branches, z[1]) + lax.switch(0, branches, y)

  got = dtypes_of(autocast(fn, F16), XS)
  assert got["dot_general"] == {"float16"} and got["exp"] == {"float32"}
  out = jax.jit(autocast(fn, F16))(XS)
  np.testing.assert_allclose(out, fn(XS), rtol=3e-2, atol=3e-2)


@jax.custom_jvp
def scaled_sin(x):
  return jnp.sin(x) * ROW


scaled_sin.defjvp(lambda p, t: (scaled_sin(p[0]), t[0] * jnp.cos(p[0]) * ROW))


@jax.custom_vjp
def scaled_cos(x):
  return jnp.cos(x) * ROW


scaled_cos.defvjp(lambda x: (scaled_cos(x), x), lambda x, g: (-g * jnp.sin(x) * ROW,))


def test_custom_derivatives_closing_over_arrays_keep_their_rules():
  # Both close over ROW, which JAX passes as a constant input of the custom call; the
  # custom_vjp forward rule returns its input as a residual (JAX forwards it by index,
  # constants counted): an earlier autocast indexed the primals alone and failed here.
  fn = lambda x: scaled_sin(x @ W) + scaled_cos(x @ W)
  names = {e.primitive.name for e in eqns(jax.make_jaxpr(autocast(fn, F16))(XS))}
  assert {"custom_jvp_call", "custom_vjp_call"} <= names
  _, grad = assert_close_to_float32(fn, XS)
  assert grad.dtype == jnp.float32


def test_shard_map_inside_a_scan_and_a_scan_inside_shard_map():
  mesh = jax.make_mesh((1,), ("d",))
  body = lambda x: lax.psum(jnp.exp(x @ W), "d")
  sm = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P())
  x = jax.device_put(XS, NamedSharding(mesh, P("d")))
  outer = lambda x: lax.scan(lambda c, _: (c + sm(x).sum(), None), 0.0, None, length=2)[0]
  got = dtypes_of(autocast(outer, F16), x)
  assert got["dot_general"] == {"float16"} and got["exp"] == {"float32"}
  scanned = jax.shard_map(lambda x: lax.scan(lambda h, r: (jnp.tanh(h @ W + r), None),
                                             x[0] * 0, x)[0][None],  # fmt: skip
                          mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  assert dtypes_of(autocast(scanned, F16), x)["dot_general"] == {"float16"}
  both = fast_jit(lambda x: (autocast(outer, F16)(x), outer(x),
                             autocast(scanned, F16)(x), scanned(x)))(x)  # fmt: skip
  np.testing.assert_allclose(both[0], both[1], rtol=3e-2)
  np.testing.assert_allclose(both[2], both[3], rtol=3e-2, atol=3e-2)


LINALG = {
  "solve": lambda a, b: jnp.linalg.solve(a, b),
  "inv": lambda a, b: jnp.linalg.inv(a) @ b,
  "cholesky": lambda a, b: jnp.linalg.cholesky(a @ a.T + 8 * jnp.eye(8)) @ b,
  "eigh": lambda a, b: jnp.linalg.eigh(a + a.T)[0][:, None] * b,
  "qr": lambda a, b: jnp.linalg.qr(a)[1] @ b,
  "svd": lambda a, b: jnp.linalg.svd(a)[1][:, None] * b,
  "triangular": lambda a, b: jax.scipy.linalg.solve_triangular(jnp.tril(a) + 4 * jnp.eye(8), b),
  "slogdet": lambda a, b: jnp.linalg.slogdet(a)[1] * b,
}
_LINALG_PRIMS = ("lu", "cholesky", "eigh", "qr", "svd", "triangular_solve", "geqrf",
                 "householder_product", "custom_linear_solve")  # fmt: skip


@pytest.mark.parametrize("name", sorted(LINALG))
def test_linear_algebra_after_a_half_precision_matmul_runs_in_float32(name):
  # The matmul before the linear algebra is float16 under autocast; torch.autocast's float32
  # list (and jax >= 0.11, which refuses half inputs to its decompositions) keeps every
  # decomposition and solve in float32.
  a = jnp.eye(8) * 3 + W
  fn = lambda a, b: LINALG[name](a @ (jnp.eye(8) + 0.01 * W), b)
  found = dtypes_of(autocast(fn, F16), a, XS.T, names=_LINALG_PRIMS + ("dot_general",))
  assert "float16" in found.pop("dot_general")
  assert found and all(d == {"float32"} for d in found.values()), found
  got, want = fast_jit(lambda a, b: (autocast(fn, F16)(a, b), fn(a, b)))(a, XS.T)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
