"""``from jmp_scaler import jmp``: jmp 0.0.4's API, checked case for case and against the real jmp.

* jmp's own ``policy_test.py`` and ``loss_scale_test.py`` (google-deepmind/jmp), their cases
  written here for this module: casts, ``with_output_dtype``, ``get_policy``, ``half_dtype``,
  ``cast_to_full``/``cast_to_half``, ``str``, the three loss scales, ``all_finite``,
  ``select_tree``;
* ``DynamicLossScale`` follows the real jmp's scale history bit for bit: every overflow pattern
  of 8 steps for five (period, factor, floor) settings, random long patterns, growth refused
  at float32's top;
* jmp's bugs, fixed and measured against the real jmp: ``min_loss_scale`` under ``jit``, the
  float16 scale of jmp's README, the second trace;
* a policy from this module drives ``autocast``, ``autocast_linen``, ``autocast_nnx`` and
  ``loss_scaler()`` as a ``jmp_scaler.Policy`` does, and dm-haiku's ``hk.mixed_precision``
  as the real jmp's does;
* the loss-scale step of dm-haiku's ImageNet example (``examples/imagenet/train.py``), run
  with the real jmp and with this module, for each of its three loss scales;
* the migration guide's one-line switch runs, with the real jmp's results.
"""

import functools
import itertools
import pathlib
import re
import warnings

import chex
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import jmp as real_jmp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_scaler
from jmp_scaler import jmp

ROOT = pathlib.Path(__file__).resolve().parents[1]
HALF_DTYPES = (np.float16, jnp.float16, jnp.bfloat16)
FULL_DTYPES = (np.float32, jnp.float32)
DTYPES = HALF_DTYPES + FULL_DTYPES
NUMPYS = (np, jnp)
NAMES = {np.float16: "float16", jnp.bfloat16: "bfloat16", np.float32: "float32"}  # jnp's hash alike
CASES = list(itertools.product(DTYPES, NUMPYS))


def _name(dtype):
  """``"jnp.float16"`` or ``"np.float16"``: jnp's scalar types compare equal to NumPy's."""
  return f"{'jnp' if isinstance(dtype, type(jnp.float32)) else 'np'}.{np.dtype(dtype).name}"


CASE_IDS = [f"{_name(d)}-{n.__name__}" for d, n in CASES]


def _bits(x):
  x = np.asarray(x)
  return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" else x


def _same_bits(a, b):
  return all(np.array_equal(_bits(x), _bits(y)) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# ---------------------------------------------------------------- policies: jmp's policy_test


@pytest.mark.parametrize(("dtype", "np_"), CASES, ids=CASE_IDS)
def test_each_cast_gives_its_fields_dtype_to_floating_leaves(dtype, np_):
  policy = jmp.Policy(dtype, dtype, dtype)
  tree = {"a": np_.ones([]), "i": np_.ones([], np.int32)}
  for field, cast in (("param_dtype", policy.cast_to_param),
                      ("compute_dtype", policy.cast_to_compute),
                      ("output_dtype", policy.cast_to_output)):
    assert getattr(policy, field) == dtype
    out = cast(tree)
    assert out["a"].dtype == dtype and type(out["a"]) is type(tree["a"])
    assert out["i"] is tree["i"]  # integers pass through


@pytest.mark.parametrize(("dtype", "np_"), CASES, ids=CASE_IDS)
def test_with_output_dtype(dtype, np_):
  policy = jmp.Policy(np_.float32, np_.float32, np_.float32).with_output_dtype(dtype)
  assert type(policy) is jmp.Policy
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      np.float32, np.float32, dtype)


@pytest.mark.parametrize(("name", "dtype"), [("float16", np.float16), ("float32", np.float32),
                                             ("bfloat16", jnp.bfloat16)])
def test_get_policy_of_one_dtype_sets_all_three(name, dtype):
  policy = jmp.get_policy(name)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (dtype,) * 3


def test_get_policy_of_an_almost_dtype_raises_unknown_dtype():
  with pytest.raises(ValueError, match="Unknown dtype"):
    jmp.get_policy("compute_float16")
  with pytest.raises(ValueError, match="Unknown dtype 'f8'"):
    jmp.get_policy("p=f32,c=f8")
  with pytest.raises(ValueError, match="Policy key 'compute' repeated"):
    jmp.get_policy("c=f16,compute=bf16")  # jmp lets the last one win, silently


@pytest.mark.parametrize(("dtype", "np_"), CASES, ids=CASE_IDS)
def test_get_policy_compute_only_and_compute_with_full_output(dtype, np_):
  name = NAMES[dtype]
  policy = jmp.get_policy(f"c={name}")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      np_.float32, dtype, dtype)  # output follows compute
  policy = jmp.get_policy(f"c={name},o=full")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      np_.float32, dtype, np_.float32)


def test_half_dtype_is_float16_off_tpu_and_callable():
  assert jax.local_devices()[0].platform == "cpu"
  assert jmp.half_dtype() == jnp.float16 == real_jmp.half_dtype()
  half = jmp.half_dtype()(2**15)  # jmp's README: DynamicLossScale(jmp.half_dtype()(2 ** 15))
  assert half.dtype == np.float16 and float(half) == 32768.0


def test_cast_to_full_and_cast_to_half_touch_floating_arrays_only():
  half, o = jmp.half_dtype(), object()
  half_tree = dict(o=o, h=jnp.ones([], half), f=jnp.ones([]), i=jnp.ones([], jnp.int16))
  full = jmp.cast_to_full(half_tree)
  assert full["o"] is o and full["i"] is half_tree["i"] and full["f"] is half_tree["f"]
  assert full["h"].dtype == np.float32 and float(full["h"]) == 1.0
  full_tree = dict(o=o, h=jnp.ones([], half), f=jnp.ones([]), i=jnp.ones([], jnp.int16))
  halved = jmp.cast_to_half(full_tree)
  assert halved["o"] is o and halved["i"] is full_tree["i"] and halved["h"] is full_tree["h"]
  assert halved["f"].dtype == half
  assert jmp.cast_to_full(np.float64(2.0)) == 2.0  # a NumPy scalar is not an array: kept


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_str_uses_jmps_first_names(dtype):
  policy = jmp.Policy(dtype, dtype, dtype)
  assert [p.split("=")[1] for p in str(policy).split(",")] == [jmp.dtype_to_names[dtype][0]] * 3


def test_str_reads_back_for_every_policy_and_is_the_real_jmps():
  dtypes = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
  for p, c, o in itertools.product(dtypes, repeat=3):
    policy = jmp.Policy(p, c, o)
    assert str(policy) == str(real_jmp.Policy(p, c, o))
    assert jmp.get_policy(str(policy)) == policy and real_jmp.get_policy(str(policy)) == \
        real_jmp.Policy(p, c, o)
  assert str(jmp.get_policy("p=f32,c=bf16")) == "p=full,c=bf16,o=bf16"
  assert str(jmp_scaler.get_policy("p=f32,c=bf16")) == "p=f32,c=bf16,o=bf16"  # unchanged


def test_policies_are_equal_and_hash_alike_across_spellings():
  spellings = [jmp.Policy(np.float32, np.float16, np.float32),
               jmp.Policy(jnp.float32, jnp.float16, jnp.float32),
               jmp.Policy("float32", "f16", "full"),
               jmp.Policy(np.dtype("float32"), np.dtype("float16"), np.dtype("float32")),
               jmp.Policy(compute_dtype=jnp.float16, param_dtype=jnp.float32,
                          output_dtype=jnp.float32),
               jmp.get_policy("params=float32,compute=float16,output=float32"),
               jmp.get_policy("p=f32,c=f16,o=f32"),
               jmp.get_policy(jmp_scaler.get_policy("c=f16,o=f32")),
               jmp_scaler.get_policy("p=f32,c=f16,o=f32")]  # the main class: equal too
  assert all(p == spellings[0] and spellings[0] == p for p in spellings)
  assert len({hash(p) for p in spellings}) == 1 and len(set(spellings)) == 1
  assert jmp.get_policy("c=f16") != jmp.get_policy("c=bf16")
  assert jmp.get_policy("f32") != "p=f32,c=f32,o=f32"


def test_dtype_fields_are_dtypes_and_scalar_types():
  policy = jmp.get_policy("p=f32,c=bf16,o=f16")
  assert policy.compute_dtype is jnp.bfloat16 and policy.output_dtype is jnp.float16
  assert policy.compute_dtype(1.5).dtype == jnp.bfloat16  # callable, as jmp's fields are
  assert jnp.zeros(2, policy.output_dtype).dtype == np.float16
  assert np.dtype(policy.param_dtype) == np.float32 and jnp.dtype(policy.compute_dtype).name == \
      "bfloat16"
  with pytest.raises(ValueError, match="compute_dtype must be a floating dtype"):
    jmp.Policy(jnp.float32, jnp.int32, jnp.float32)  # jmp accepts it


def test_a_policy_is_a_static_jit_argument_and_a_levanter_style_config_value():
  # levanter encodes a policy from its dtypes' names and decodes it with get_policy.
  policy = jmp.get_policy("p=f32,c=bf16,o=f32")
  encoded = ",".join(f"{k}={jnp.dtype(getattr(policy, f'{k}_dtype')).name}"
                     for k in ("compute", "param", "output")).replace("param=", "params=")
  assert encoded == "compute=bfloat16,params=float32,output=float32"
  assert jmp.get_policy(encoded) == policy
  cast = jax.jit(lambda x, p: p.cast_to_compute(x), static_argnums=1)
  assert cast(jnp.ones(2), policy).dtype == jnp.bfloat16
  assert cast(jnp.ones(2), jmp.get_policy(encoded)).dtype == jnp.bfloat16
  assert cast._cache_size() == 1  # equal policies: one compiled program


# ---------------------------------------------------------------- a jmp policy drives the library

W = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
X = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4)), jnp.float32)
POLICIES = (jmp.get_policy("p=f32,c=f16,o=f32"), jmp_scaler.get_policy("p=f32,c=f16,o=f32"))


def test_a_jmp_policy_drives_autocast_as_a_jmp_scaler_policy():
  f = lambda w, x: jax.nn.softmax(jnp.tanh(x @ w))  # noqa: E731
  outs = [jmp_scaler.autocast(f, p)(W, X) for p in POLICIES]
  assert outs[0].dtype == np.float32 and _same_bits(*outs)
  inner = [[str(e.outvars[0].aval.dtype) for e in jax.make_jaxpr(jmp_scaler.autocast(f, p))(
      W, X).eqns[0].params["jaxpr"].eqns] for p in POLICIES]
  assert inner[0] == inner[1] and "float16" in inner[0]


def test_a_jmp_policy_drives_autocast_linen_and_autocast_nnx():
  model = nn.Dense(3)
  outs, kinds = [], []
  for p in POLICIES:
    with jmp_scaler.autocast_linen(p):
      variables = model.init(jax.random.key(0), X)
      outs.append(model.apply(variables, X))
      kinds.append(jax.tree.map(lambda v: v.dtype, variables))
    nnx_model = jmp_scaler.autocast_nnx(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), p)
    outs.append(nnx_model(X))
  assert kinds[0] == kinds[1] == {"params": {"kernel": np.float32, "bias": np.float32}}
  assert [o.dtype for o in outs] == [np.float32] * 4
  assert _same_bits(outs[0], outs[2]) and _same_bits(outs[1], outs[3])


def test_a_jmp_policy_recommends_the_same_loss_scaler():
  params = {"w": W}
  for spec, kind in (("p=f32,c=f16,o=f32", "dynamic"), ("p=f32,c=bf16,o=f32", "none")):
    states = [p.loss_scaler().init(params) for p in (jmp.get_policy(spec),
                                                     jmp_scaler.get_policy(spec))]
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])
    assert _same_bits(*states)
    assert (float(states[0].scale) > 1) == (kind == "dynamic")
  assert jmp.get_policy("c=f16").needs_loss_scaling and not jmp.get_policy("c=bf16") \
      .needs_loss_scaling


# ------------------------------------------------------------ loss scales: jmp's loss_scale_test


def test_no_op_loss_scale_returns_the_tree_itself():
  loss_scale = jmp.NoOpLossScale()
  tree = {"a": jnp.ones([])}
  assert loss_scale.scale(tree) is tree and loss_scale.unscale(tree) is tree
  assert loss_scale.loss_scale == 1 and loss_scale.adjust(jnp.bool_(False)) is loss_scale


@pytest.mark.parametrize(("cls", "scale"), [(jmp.StaticLossScale, 2), (jmp.StaticLossScale, 3),
                                            (jmp.StaticLossScale, 4), (jmp.DynamicLossScale, 2.),
                                            (jmp.DynamicLossScale, 3.), (jmp.DynamicLossScale, 4.)])
def test_scale_and_unscale(cls, scale):
  loss_scale = cls(scale)
  scaled = loss_scale.scale({"a": jnp.array(1.)})
  assert float(scaled["a"]) == 1. * scale
  assert float(loss_scale.unscale(scaled)["a"]) == 1.
  # The same numbers as the real jmp's.
  assert float(getattr(real_jmp, cls.__name__)(scale).unscale(scaled)["a"]) == 1.


@pytest.mark.parametrize("create", [jmp.NoOpLossScale, lambda: jmp.StaticLossScale(0)],
                         ids=["NoOpLossScale", "StaticLossScale"])
def test_no_op_and_static_scales_are_pytrees_without_leaves(create):
  loss_scale = create()
  assert jax.tree.leaves(loss_scale) == []
  assert jax.tree.map(lambda x: x, loss_scale) == loss_scale


def test_a_dynamic_loss_scale_from_a_float_gives_no_warning():
  with warnings.catch_warnings(record=True) as logged:
    warnings.simplefilter("always")
    jmp.DynamicLossScale(2.**15)
  assert logged == []


def test_a_dynamic_loss_scale_is_a_pytree_of_its_scale_and_counter():
  scale, counter = jnp.ones([]), jnp.zeros([], jnp.int32)
  loss_scale = jmp.DynamicLossScale(scale, counter, 2000, 2)
  leaves = jax.tree.leaves(loss_scale)
  assert leaves == [scale, counter] and [x.dtype for x in leaves] == [np.float32, np.int32]
  assert jax.tree.map(lambda x: x, loss_scale) == loss_scale
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(loss_scale)[0]]
  assert paths == [".loss_scale", ".counter"]


def _adjust_script(loss_scale, finites):
  """The scales and counters after each ``adjust``, eagerly (as jmp's tests run)."""
  out = []
  for finite in finites:
    loss_scale = loss_scale.adjust(jnp.bool_(finite))
    out.append((float(loss_scale.loss_scale), int(loss_scale.counter)))
  return loss_scale, out


@pytest.mark.parametrize(("period", "factor"), [(20, 2), (30, 3)])
def test_adjust_grows_when_the_counter_reaches_period_minus_one(period, factor):
  loss_scale = jmp.DynamicLossScale(jnp.float32(10), jnp.int32(0), period, factor)
  loss_scale, out = _adjust_script(loss_scale, [True] * period)
  assert out == [(10., i) for i in range(1, period)] + [(10. * factor, 0)]  # wraps
  assert (loss_scale.period, loss_scale.factor) == (period, factor)


@pytest.mark.parametrize(("period", "factor", "min_loss_scale"),
                         [(20, 2, None), (30, 3, None), (20, 2, .3125), (30, 3, .37),
                          (5., 2., 0.)])
def test_adjust_backs_off_on_overflow_down_to_the_floor(period, factor, min_loss_scale):
  init = 10.0
  args = () if min_loss_scale is None else (jnp.asarray(min_loss_scale),)
  loss_scale = jmp.DynamicLossScale(jnp.float32(init), jnp.int32(0), period, factor, *args)
  floor = 1 if min_loss_scale is None else min_loss_scale
  assert init / factor**100 < 1  # 100 steps reach a floor of 1
  step = jax.jit(lambda ls, finite: ls.adjust(finite))  # one program for the 100 steps
  for i in range(100):
    loss_scale = step(loss_scale, jnp.bool_(False))
    np.testing.assert_allclose(loss_scale.loss_scale, max(floor, init / factor**(i + 1)),
                               rtol=1e-5)
    assert int(loss_scale.counter) == 0
  assert (loss_scale.period, loss_scale.factor) == (period, factor)
  assert step._cache_size() == 1


def test_adjust_requires_a_boolean_scalar():
  loss_scale = jmp.DynamicLossScale(2.**15)
  for bad in (jnp.ones([2], bool), jnp.float32(1), jnp.int32(1)):
    with pytest.raises(ValueError, match="grads_finite: expected boolean scalar"):
      loss_scale.adjust(bad)
  assert float(loss_scale.adjust(True).loss_scale) == 2.**15  # a Python bool is a scalar


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_a_16_bit_or_fp8_scalar_scale_is_taken_as_jmps_readme_builds_it(dtype):
  # jmp.half_dtype() is bfloat16 on a TPU: DynamicLossScale(jmp.half_dtype()(2 ** 15)).
  loss_scale = jmp.DynamicLossScale(dtype(2**8), min_loss_scale=dtype(2))
  assert loss_scale.loss_scale.dtype == np.float32 and float(loss_scale.loss_scale) == 256
  assert float(loss_scale.min_loss_scale) == 2
  assert float(jmp.StaticLossScale(dtype(2**8)).loss_scale) == 256


@pytest.mark.parametrize("field", ["loss_scale", "min_loss_scale"])
def test_a_non_floating_scale_warns_as_in_jmp(field):
  kwargs = {"loss_scale": jnp.asarray(1, jnp.float32), field: jnp.asarray(1, jnp.int32)}
  with pytest.warns(UserWarning, match=f"Expected floating type for {field}"):
    loss_scale = jmp.DynamicLossScale(**kwargs)
  assert loss_scale.loss_scale.dtype == np.float32  # then kept in float32


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"loss_scale": 0.}, "loss_scale must be positive and finite in float32 .*, got 0.0"),
    ({"loss_scale": np.inf}, "loss_scale must be positive and finite"),
    # Checked as stored in float32: 1e39 is inf there (every step would then overflow),
    # 1e-40 subnormal (1 / scale is inf); 1 + 1e-9 is 1 (the scale would never move).
    ({"loss_scale": 1e39}, "loss_scale must be positive and finite in float32"),
    ({"loss_scale": 1e-40}, "loss_scale must be positive and finite in float32"),
    ({"loss_scale": jnp.ones(2)}, r"loss_scale must be a scalar, got shape \(2,\)"),
    ({"loss_scale": 1., "period": 0}, r"period must be an integer in \[1, 2\*\*31 - 1\]"),
    ({"loss_scale": 1., "period": 2.5}, "period must be an integer .*, got 2.5"),
    ({"loss_scale": 1., "period": 2**31}, "period must be an integer .*, got 2147483648"),
    ({"loss_scale": 1., "factor": 1}, "factor must be finite and > 1 in float32, got 1"),
    ({"loss_scale": 1., "factor": 1 + 1e-9}, "factor must be finite and > 1 in float32"),
    ({"loss_scale": 1., "factor": 1e39}, "factor must be finite and > 1 in float32"),
    ({"loss_scale": 1., "min_loss_scale": -1.}, "min_loss_scale must be finite in float32"),
    ({"loss_scale": 1., "min_loss_scale": 1e39}, "min_loss_scale must be finite in float32"),
    ({"loss_scale": 1., "counter": 0.5}, "counter must be an integer, got 0.5"),
    ({"loss_scale": 1., "counter": 5, "period": 5}, r"counter must lie in \[0, period=5\)"),
    ({"loss_scale": "big"}, "loss_scale must be a real number, got 'big'"),
])
def test_bad_arguments_raise_when_built(kwargs, match):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "big" is not floating either
    with pytest.raises(ValueError, match=match):
      jmp.DynamicLossScale(**kwargs)


def test_static_scale_is_configuration():
  with pytest.raises(ValueError, match="loss_scale must be finite in float32 and >= 0, got -1"):
    jmp.StaticLossScale(-1)
  with pytest.raises(ValueError, match="loss_scale must be finite in float32"):
    jmp.StaticLossScale(1e39)  # inf as stored
  with pytest.raises(ValueError, match="StaticLossScale is configuration"):
    jax.jit(lambda s: jmp.StaticLossScale(s).scale(1.0))(2.0)
  scaled = jax.jit(lambda ls, x: ls.scale(x))(jmp.StaticLossScale(2**15), jnp.float16(3))
  assert scaled.dtype == np.float32 and float(scaled) == 3 * 2**15  # float16 would be inf


@pytest.mark.parametrize("non_finite", [jnp.inf, jnp.nan])
def test_all_finite(non_finite):
  assert jmp.all_finite(None) and jmp.all_finite({})
  assert not jmp.all_finite({"a": jnp.array(non_finite)})
  assert not jmp.all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
  assert not jmp.all_finite({"a": jnp.array(non_finite), "b": jnp.ones([])})
  assert jmp.all_finite({"a": jnp.ones([]), "b": jnp.ones([])})
  assert jmp.all_finite({"i": jnp.ones(3, jnp.int32)}).dtype == np.bool_


def test_select_tree():
  a = {"a": jnp.ones([]), "b": jnp.zeros([])}
  b = {"a": jnp.zeros([]), "b": jnp.ones([])}
  assert jmp.select_tree(jnp.bool_(True), None, None) is None
  assert jmp.select_tree(jnp.bool_(False), None, None) is None
  assert jmp.select_tree(jnp.bool_(True), a, b) == a
  assert jmp.select_tree(jnp.bool_(False), a, b) == b
  neg_zero = {"a": jnp.float32(-0.0)}  # bit for bit: -0.0 stays -0.0
  assert _same_bits(jmp.select_tree(jnp.bool_(True), neg_zero, {"a": jnp.float32(0)}), neg_zero)


def test_select_tree_rejects_a_non_scalar_as_jmp_does_and_with_a_value_error():
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    jmp.select_tree(jnp.ones([1]), None, None)
  with pytest.raises(ValueError, match=r"pred: expected boolean scalar .* shape \(1,\)"):
    jmp.select_tree(jnp.ones([1], bool), None, None)


# ------------------------------------------------------------ the real jmp's history, bit for bit

EXHAUSTIVE = jnp.asarray((np.arange(256)[:, None] >> np.arange(8)) & 1, bool)  # every 8 steps
RANDOM = jnp.asarray(np.random.default_rng(2).random((16, 96)) < 0.85)  # mostly finite


def _histories(init, period, factor, floor, patterns):
  """The scales and counters of the real jmp and of ours, for each pattern, in one program.

  The real jmp's adjust runs on a DynamicLossScale rebuilt each step (so that its floor is
  kept); ours is carried as users carry it, the object itself through scan.
  """

  def real(carry, finite):
    ls = real_jmp.DynamicLossScale(carry[0], carry[1], int(period), factor, np.float32(floor))
    ls = ls.adjust(finite)
    return (ls.loss_scale, ls.counter), (ls.loss_scale, ls.counter)

  def ours(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter)

  start = jmp.DynamicLossScale(np.float32(init), 0, period, factor, floor)
  both = lambda pat: (jax.lax.scan(real, (jnp.float32(init), jnp.int32(0)), pat)[1],  # noqa: E731
                      jax.lax.scan(ours, start, pat)[1])
  return jax.jit(jax.vmap(both))(patterns)


@pytest.mark.parametrize(("init", "period", "factor", "floor", "patterns"), [
    (2.**15, 1, 2, 1., EXHAUSTIVE),
    (10., 2, 3, .37, EXHAUSTIVE),
    (10., 3, 2, .3125, EXHAUSTIVE),
    (10., 5., 2., 0., EXHAUSTIVE),  # jmp's float period: its counter turns float, ours int32
    (3., 4, 1.5, 1., RANDOM),
    (2.**125, 2, 2, 1., RANDOM),  # growth past float32's top is refused (first_finite)
], ids=["period1-every8", "factor3-floor.37-every8", "period3-floor.3125-every8",
        "float-period-floor0-every8", "factor1.5-random", "float32-top-random"])
def test_the_scale_history_is_the_real_jmps_for_every_pattern(init, period, factor, floor,
                                                              patterns):
  (want_scales, want_counters), (scales, counters) = _histories(init, period, factor, floor,
                                                                patterns)
  assert scales.dtype == np.float32 and counters.dtype == np.int32
  assert np.array_equal(_bits(scales), _bits(want_scales))
  assert np.array_equal(counters, want_counters)
  assert bool(jnp.all(jnp.isfinite(scales))) and float(scales.min()) >= floor
  assert float(scales.max()) > init  # each setting grows somewhere


# ---------------------------------------------------------------- jmp's bugs, fixed


def test_min_loss_scale_survives_jit_and_flattening():
  # jmp drops it in tree_flatten: under jit its floor falls back to 1 (PR #44, never merged).
  step = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))
  ours, real = jmp.DynamicLossScale(jnp.float32(10), min_loss_scale=.3125), \
      real_jmp.DynamicLossScale(jnp.float32(10), min_loss_scale=np.float32(.3125))
  for _ in range(8):
    ours, real = step(ours), step(real)
  assert float(ours.loss_scale) == .3125 and float(ours.min_loss_scale) == .3125
  assert float(real.loss_scale) == 1.0 and float(real.min_loss_scale) == 1.0  # jmp's bug
  leaves, treedef = jax.tree.flatten(ours)
  assert float(jax.tree.unflatten(treedef, leaves).min_loss_scale) == .3125


def test_a_float16_scale_is_kept_in_float32_and_grows_past_float16():
  ours = jmp.DynamicLossScale(jmp.half_dtype()(2**15), period=1)  # jmp's README line
  assert ours.loss_scale.dtype == np.float32
  history = []
  for _ in range(3):
    ours = ours.adjust(jnp.bool_(True))
    history.append(float(ours.loss_scale))
  assert history == [2.**16, 2.**17, 2.**18]  # float16 would be inf from 2**16
  real = real_jmp.DynamicLossScale(real_jmp.half_dtype()(2**15), period=1)
  with pytest.raises(TypeError, match="lax.select requires arguments to have the same dtypes"):
    real.adjust(jnp.bool_(True))  # jmp#47
  loss = ours.scale(jnp.float16(3.0))
  assert loss.dtype == np.float32 and float(loss) == 3 * 2.**18


def test_a_jitted_step_traces_once():
  finites = [True, True, False, True, True, True]  # growth (period 2) and a backoff

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(ls, finite):
    return ls.adjust(finite)

  ours = jmp.DynamicLossScale(2.**15, period=2)  # a Python float, as in jmp's README
  for finite in finites:
    ours = step(ours, jnp.bool_(finite))
  assert float(ours.loss_scale) == 2.**16

  traces = []
  real_step = jax.jit(lambda ls, finite: (traces.append(None), ls.adjust(finite))[1])
  real = real_jmp.DynamicLossScale(2.**15, period=2)
  for finite in finites:
    real = real_step(real, jnp.bool_(finite))
  assert float(real.loss_scale) == 2.**16 and len(traces) == 2  # jmp's weak-typed first scale


# ---------------------------------------------------------------- dm-haiku's hk.mixed_precision


class Net(hk.Module):
  def __call__(self, x, is_training):
    h = hk.Linear(16)(x)
    h = hk.BatchNorm(True, True, 0.9)(h, is_training)
    return hk.Linear(10)(jax.nn.relu(h))


def _with_policies(lib, fun):
  """``fun()`` with the ImageNet example's two policies set from ``lib``, then cleared."""
  policy = lib.get_policy("p=f32,c=f16,o=f32")
  bn_policy = lib.get_policy("p=f32,c=f32,o=f32").with_output_dtype(policy.compute_dtype)
  hk.mixed_precision.set_policy(hk.BatchNorm, bn_policy)
  hk.mixed_precision.set_policy(Net, policy)
  try:
    assert hk.mixed_precision.get_policy(Net) == policy
    return fun()
  finally:
    hk.mixed_precision.clear_policy(hk.BatchNorm)
    hk.mixed_precision.clear_policy(Net)


FORWARD = hk.transform_with_state(lambda x, is_training: Net()(x, is_training))
IMAGES = np.random.default_rng(3).normal(size=(8, 12)).astype(np.float32)
LABELS = np.random.default_rng(4).integers(0, 10, size=8).astype(np.int32)


def test_hk_mixed_precision_runs_this_modules_policies_as_jmps():
  def run():
    params, state = FORWARD.init(jax.random.key(0), IMAGES, True)
    jaxpr = jax.make_jaxpr(lambda p, s: FORWARD.apply(p, s, None, IMAGES, True))(params, state)
    out, new_state = jax.jit(FORWARD.apply, static_argnums=4)(params, state, None, IMAGES, True)
    dots = [str(e.outvars[0].aval.dtype) for e in jaxpr.jaxpr.eqns if "dot" in e.primitive.name]
    return params, out, new_state, dots

  ours, real = _with_policies(jmp, run), _with_policies(real_jmp, run)
  params, out, _, dots = ours
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
  assert out.dtype == np.float32 and dots == ["float16", "float16"]  # both Linears in float16
  assert _same_bits(ours[:3], real[:3]) and ours[3] == real[3]
  with hk.mixed_precision.push_policy(Net, jmp.get_policy("o=bf16")):
    assert hk.mixed_precision.get_policy(Net) == jmp.get_policy("p=f32,c=f32,o=bf16")
  assert hk.mixed_precision.get_policy(Net) is None


# ---------------------------------------------------------------- the ImageNet example's step


def _imagenet_run(jmp, kind, steps=5, bad_step=3):
  """examples/imagenet/train.py's train_step and loss-scale handling, on a small model.

  The loss-scale lines are the example's (``mp_skip_nonfinite=True``). The example maps
  ``initial_state`` and ``train_step`` over the devices with ``jax.pmap(axis_name='i')``;
  here over one device, with ``jax.vmap(axis_name='i')``, op by op. The batch of
  ``bad_step`` holds an inf.
  """
  get_policy = lambda: jmp.get_policy("p=f32,c=f16,o=f32")  # noqa: E731
  make_optimizer = lambda: optax.chain(optax.trace(decay=0.9), optax.scale(-0.1))  # noqa: E731

  def get_initial_loss_scale():
    cls = getattr(jmp, f"{kind}LossScale")
    return cls(2.**15) if cls is not jmp.NoOpLossScale else cls()

  def loss_fn(params, state, loss_scale, batch):
    logits, state = FORWARD.apply(params, state, None, batch["images"], True)
    labels = jax.nn.one_hot(batch["labels"], 10)
    loss = optax.softmax_cross_entropy(logits=logits, labels=labels).mean()
    return loss_scale.scale(loss), (loss, state)

  def train_step(train_state, batch):
    params, state, opt_state, loss_scale = train_state
    grads, (loss, new_state) = jax.grad(loss_fn, has_aux=True)(params, state, loss_scale, batch)
    policy = get_policy()
    grads = policy.cast_to_compute(grads)
    grads = loss_scale.unscale(grads)
    grads = jax.lax.pmean(grads, axis_name="i")
    grads = policy.cast_to_param(grads)
    updates, new_opt_state = make_optimizer().update(grads, opt_state)
    new_params = optax.apply_updates(params, updates)
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    new_params, new_state, new_opt_state = jmp.select_tree(
        grads_finite, (new_params, new_state, new_opt_state), (params, state, opt_state))
    scalars = {"train_loss": loss, "loss_scale": loss_scale.loss_scale,
               "grads_finite": grads_finite}
    new_state, scalars = jmp.cast_to_full((new_state, scalars))
    scalars = jax.lax.pmean(scalars, axis_name="i")
    return (new_params, new_state, new_opt_state, loss_scale), scalars

  def initial_state(rng, images):
    params, state = FORWARD.init(rng, images, True)
    return params, state, make_optimizer().init(params), get_initial_loss_scale()

  def run():
    # Per device, and here one: what jax.pmap does, as jax.vmap with the same axis name.
    init = jax.vmap(initial_state, axis_name="i")  # op by op: its ops compile once for all
    step = jax.jit(jax.vmap(train_step, axis_name="i"))
    train_state = init(jax.random.key(0)[None], IMAGES[None])
    history = []
    for i in range(steps):
      images = BAD_IMAGES if i == bad_step else IMAGES
      train_state, scalars = step(train_state, {"images": images[None], "labels": LABELS[None]})
      history.append(scalars)
    return jax.tree.map(lambda x: np.asarray(x[0]), (train_state, history))

  return _with_policies(jmp, run)


BAD_IMAGES = IMAGES.copy()
BAD_IMAGES[0, 0] = np.inf


@functools.cache
def _imagenet():
  """Every kind, run op by op (eagerly: the ops compile once for all six runs)."""
  return {kind: (_imagenet_run(jmp, kind), _imagenet_run(real_jmp, kind))
          for kind in ("NoOp", "Static", "Dynamic")}


@pytest.mark.parametrize("kind", ["NoOp", "Static", "Dynamic"])
def test_the_imagenet_loss_scale_step_gives_the_real_jmps_decisions_and_scales(kind):
  (state, history), (real_state, real_history) = _imagenet()[kind]
  keys = ("grads_finite", "loss_scale")
  assert [[h[k].tolist() for k in keys] for h in history] == \
      [[h[k].tolist() for k in keys] for h in real_history]
  finite = [bool(h["grads_finite"]) for h in history]
  assert finite[3] is False and finite.count(False) >= 1  # the inf batch is skipped
  assert history[0]["train_loss"] == real_history[0]["train_loss"]  # the same first forward
  if kind == "NoOp":  # no scale: the same program, bit for bit
    assert _same_bits(state, real_state) and _same_bits(history, real_history)
  else:
    # Where jmp's scale is weakly typed (a Python number; Dynamic's until its first adjust)
    # it unscales the float16 gradients in float16; ours is float32. The parameters agree to
    # float16's rounding of the smallest gradients.
    for ours, real in zip(jax.tree.leaves(state[:3]), jax.tree.leaves(real_state[:3]),
                          strict=True):
      np.testing.assert_allclose(ours, real, rtol=0, atol=1e-6)
  if kind == "Dynamic":
    assert [float(h["loss_scale"]) for h in history][3] == 2.**14  # backed off at the inf
    assert state[3].loss_scale.dtype == np.float32 and state[3].counter.dtype == np.int32


# ---------------------------------------------------------------- the migration guide's switch


def _switch_block():
  text = (ROOT / "docs" / "migration.md").read_text()
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
            if b.startswith("from jmp_scaler import jmp")]
  assert len(blocks) == 1
  return blocks[0]


def test_the_migration_guides_one_line_switch_runs_and_matches_jmp():
  block = _switch_block()
  ours = {}
  exec(compile(block, "docs/migration.md", "exec"), ours)  # noqa: S102 - our own docs
  first, rest = block.split("\n", 1)
  real = {}
  exec(compile("import jmp\n" + rest, "docs/migration.md", "exec"), real)  # noqa: S102
  assert first.startswith("from jmp_scaler import jmp")
  assert ours["jmp"] is jmp and real["jmp"] is real_jmp
  assert ours["history"] == real["history"]  # the same scales and the same skipped step
  assert [f for _, f in ours["history"]].count(False) == 1
  assert _same_bits(ours["params"], real["params"]) and _same_bits(
      ours["opt_state"], real["opt_state"])
  assert f"# {ours['history']}" in block  # the guide shows what it prints
