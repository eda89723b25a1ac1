"""16-bit parameters without float32 master weights: rounding, Kahan, 16-bit Adam.

The 8-device scenarios run once, in a subprocess that tests/_subprocess.py starts with the
session (``tests/lp_worker.py`` sets ``XLA_FLAGS`` before importing jax), alongside the
in-process tests; the last tests assert on what it reports.
"""

import functools
import json

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_scaler
from jmp_scaler.lowbit._adam16 import adam, adamw, low_precision_optimizer, scale_by_adam
from jmp_scaler.lowbit._stochastic import (
  applied_update,
  kahan_summation,
  random_bits,
  step_key,
  stochastic_cast,
  stochastic_round,
)
from tests._subprocess import output

BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def worker():
  """What the 8-device worker (tests/lp_worker.py, a run of tests/_subprocess.py) reported."""
  return json.loads(output("lp_worker"))


def _bits(x):
  return np.asarray(x).view(np.uint16 if np.asarray(x).dtype.itemsize == 2 else np.uint32)


def _neighbours(x32: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
  """Largest value <= x and smallest >= x in ``dtype`` (finite, nonzero x), via numpy."""
  near = x32.astype(dtype)
  n32 = near.astype(np.float32)
  step = np.where(n32 < x32, 1, -1) * np.sign(n32).astype(np.int64)  # move magnitude
  udt = np.uint16
  other = (near.view(udt).astype(np.int64) + step).astype(udt).view(dtype)
  other = np.where(n32 == x32, near, other)
  lo = np.minimum(n32, other.astype(np.float32))
  hi = np.maximum(n32, other.astype(np.float32))
  return lo, hi


@functools.partial(jax.jit, static_argnums=(0, 2))
def _round(seed, x, dtype):
  """stochastic_cast of ``x`` with the bits of step 0 of ``seed``, in one program per shape
  and dtype (run eagerly, the hash and the cast are some 30 small compiles)."""
  bits = random_bits(step_key(seed, 0, jnp.int32(0)), 0, x.shape)
  return stochastic_cast(x, dtype, bits)


def _draws(x, dtype, n):
  """``n`` stochastic roundings of each value of ``x`` (different elements' bits)."""
  xs = np.repeat(np.asarray(x, np.float32)[:, None], n, axis=1)
  return np.asarray(_round(3, xs, dtype)).astype(np.float64)


# ---------------------------------------------------------------- rounding


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rounding_is_unbiased(dtype):
  """mean of n draws == x within 5 standard errors, sd = ulp * sqrt(f (1 - f) / n)."""
  rng = np.random.default_rng(0)
  x = (rng.uniform(1, 2, 48) * 2.0 ** rng.integers(-8, 8, 48) * rng.choice([-1, 1], 48))
  x = x.astype(np.float32)
  n = 4096
  draws = _draws(x, dtype, n)
  lo, hi = _neighbours(x, np.dtype(dtype).type if dtype == jnp.float16 else BF16)
  f = (x.astype(np.float64) - lo) / (hi - lo)
  sd = (hi - lo) * np.sqrt(f * (1 - f) / n)
  err = np.abs(draws.mean(axis=1) - x)
  assert np.all(err <= 5 * sd + 1e-12), np.max(err / np.maximum(sd, 1e-30))
  # both neighbours are drawn (where missing one has a chance below (0.99)^4096 ~ 1e-18)
  both = (draws == lo[:, None]).any(1) & (draws == hi[:, None]).any(1)
  assert np.all(both[np.minimum(f, 1 - f) > 0.01])


def test_rounding_is_unbiased_over_steps():
  """One element, 4096 steps: the step count changes the bits (no element bias)."""
  x = np.float32(1.0 + 2.0**-9)  # a quarter of the way to the next bfloat16
  counts = np.arange(4096, dtype=np.int32)
  draw = jax.jit(jax.vmap(lambda c: stochastic_cast(
      jnp.full((1,), x), jnp.bfloat16, random_bits(step_key(0, 0, c), 0, (1,)))))
  got = np.asarray(draw(counts)).astype(np.float64).ravel()
  sd = 2.0**-7 * np.sqrt(0.25 * 0.75 / 4096)
  assert abs(got.mean() - float(x)) <= 5 * sd
  assert set(got.tolist()) == {1.0, 1.0 + 2.0**-7}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rounding_never_leaves_the_two_neighbours(dtype):
  rng = np.random.default_rng(1)
  top = 14 if dtype == jnp.float16 else 100
  low = -13 if dtype == jnp.float16 else -100
  x = (rng.uniform(1, 2, 20000) * 2.0 ** rng.integers(low, top, 20000))
  x = (x * rng.choice([-1, 1], x.shape)).astype(np.float32)
  got = np.asarray(_round(5, x, dtype)).astype(np.float32)
  lo, hi = _neighbours(x, np.float16 if dtype == jnp.float16 else BF16)
  assert np.all((got == lo) | (got == hi))


_cast = jax.jit(stochastic_cast, static_argnums=1)  # one program, not some 30 eager ops


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_representable_values_are_exact(dtype):
  """Every finite value of ``dtype``, zeros and infinities: returned bit for bit."""
  every = np.arange(2**16, dtype=np.uint16).view(BF16 if dtype == jnp.bfloat16 else np.float16)
  keep = ~np.isnan(every.astype(np.float32))
  every = every[keep]
  # the two NaNs ride in the same call (one program): each element is cast on its own
  x = np.concatenate([every.astype(np.float32), np.float32([np.nan, -np.nan])])
  bits = np.full(x.shape, 2**32 - 1, np.uint32)  # the bits most likely to round up
  got = np.asarray(_cast(x, dtype, bits))
  np.testing.assert_array_equal(_bits(got[:-2]), every.view(np.uint16))
  assert np.all(np.isnan(got[-2:].astype(np.float32)))


def test_float32_target_is_a_plain_cast():
  x = jnp.asarray([1.0 + 2.0**-20], jnp.float32)
  got = stochastic_cast(x, jnp.float32, jnp.zeros(1, jnp.uint32))
  assert got.dtype == jnp.float32 and float(got[0]) == float(x[0])


def test_apply_updates_gives_the_rounded_value_bit_for_bit():
  """p + (new_p - p) in float32, cast back, is new_p: tiny p, zeros, sign flips, big jumps."""
  rng = np.random.default_rng(2)
  n = 60000
  p = (rng.normal(size=n) * 2.0 ** rng.integers(-60, 60, n)).astype(BF16)
  p[:500] = 0
  p[500:1000] = -0.0
  p32 = p.astype(np.float32)
  kinds = [
      -p32 * (1 + rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-40, 1, n)),  # cancellation
      rng.normal(size=n) * np.abs(p32) * 2.0 ** rng.uniform(-40, 40, n),  # relative jumps
      rng.normal(size=n) * 2.0 ** rng.uniform(-70, 70, n),  # anything
      -2 * p32,  # sign flip
      np.zeros(n),
  ]

  @jax.jit
  def apply(p, x):  # one program for the five kinds (eagerly, some 30 small compiles)
    new_p = _round(9, x, jnp.bfloat16)
    new_p = jnp.where(new_p == 0, jnp.zeros_like(new_p), new_p)  # as applied_update does
    d = applied_update(p, new_p)
    return new_p, d, optax.apply_updates(p, d)

  for u in kinds:
    u = u.astype(np.float32)
    x = p32 + u
    new_p, d, got = apply(p, x)
    assert d.dtype == jnp.float32
    assert got.dtype == jnp.bfloat16
    same = np.asarray(new_p) != p  # unchanged values keep their bits, -0.0 included
    want = np.where(same, _bits(new_p), p.view(np.uint16))
    np.testing.assert_array_equal(_bits(got), want)


# ---------------------------------------------------------------- the micro-test


def _accumulate(tx, steps=1000, n=256, inc=1e-3):
  """Adds ``inc`` to 1.0 ``steps`` times through ``tx`` (n parameters at once)."""
  params = jnp.ones(n, jnp.bfloat16)

  def body(carry, _):
    p, s = carry
    u, s = tx.update(jnp.full(n, inc, jnp.float32), s, p)
    return (optax.apply_updates(p, u), s), None

  (p, s), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
  return p.astype(jnp.float32), s


def test_micro_test_round_to_nearest_stalls_and_the_fixes_do_not():
  rtn, _ = jax.jit(lambda: _accumulate(optax.identity()))()
  sr, sr_state = jax.jit(lambda: _accumulate(stochastic_round(seed=1)))()
  kahan, k_state = jax.jit(lambda: _accumulate(kahan_summation()))()
  rtn, sr, kahan = (np.asarray(a, np.float64) for a in (rtn, sr, kahan))
  assert np.all(rtn == 1.0)
  # per step the variance is f (1 - f) ulp^2 <= ulp^2 / 4 with ulp <= 2^-7 (in [1, 2)): sd of
  # one final value <= 2^-8 sqrt(1000) ~ 0.12; of the mean of 256, ~0.0077
  assert abs(sr.mean() - 2.0) < 5 * 2.0**-8 * np.sqrt(1000 / 256)
  assert sr.std() > 0.01  # different elements drew different bits
  assert int(sr_state.count) == 1000
  effective = kahan + np.asarray(k_state.compensation.astype(jnp.float32), np.float64)
  assert np.all(np.abs(effective - 2.0) < 2.0**-7)


# ---------------------------------------------------------------- Adam in 16 bits


def _quadratic_run(tx, dtype, steps=30):
  target = jnp.linspace(-1, 1, 64)
  params = jnp.zeros(64, dtype)

  def body(carry, _):
    p, s = carry
    g = jax.grad(lambda q: jnp.sum((q.astype(jnp.float32) - target) ** 2))(p)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  return jax.lax.scan(body, (params, tx.init(params)), None, length=steps)[0]


def test_adam_with_float32_state_matches_optax():
  ours, s = jax.jit(lambda: _quadratic_run(adam(1e-2, state_dtype=jnp.float32), jnp.float32))()
  theirs, _ = jax.jit(lambda: _quadratic_run(optax.adam(1e-2), jnp.float32))()
  np.testing.assert_array_equal(ours, theirs)  # bit for bit (tests/test_ecosystem.py: more)
  assert s[0].mu.dtype == jnp.float32 and int(s[0].count) == 30


@functools.cache
def _optax_adamw_run():
  """optax's float32 AdamW on the quadratic: the same run for both parametrizations."""
  return np.asarray(jax.jit(lambda: _quadratic_run(optax.adamw(1e-2), jnp.float32))()[0])


@pytest.mark.parametrize("stochastic", [True, False])
def test_adamw_in_bfloat16_tracks_float32(stochastic):
  tx = optax.chain(adamw(1e-2, state_dtype=jnp.bfloat16, stochastic_moments=stochastic),
                   stochastic_round(0))
  ours, s = jax.jit(lambda: _quadratic_run(tx, jnp.bfloat16))()
  theirs = _optax_adamw_run()
  assert ours.dtype == jnp.bfloat16
  assert s[0][0].mu.dtype == jnp.bfloat16 and s[0][0].nu.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(ours, np.float32), theirs, atol=0.02)


def test_stochastic_moments_follow_a_slow_decay_of_nu():
  """b2=0.999: nu * 0.999 rounds back to nu to nearest; stochastically it decays."""
  tx = {s: scale_by_adam(b2=0.999, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16,
                         stochastic_moments=s) for s in (True, False)}  # fmt: skip
  g = jnp.ones(512, jnp.bfloat16)

  def run(tx):
    s = tx.init(g)
    _, s = tx.update(g, s)
    body = lambda s, _: (tx.update(jnp.zeros_like(g), s)[1], None)
    return jax.lax.scan(body, s, None, length=200)[0].nu

  rtn = np.asarray(jax.jit(lambda: run(tx[False]))().astype(jnp.float32))
  sr = np.asarray(jax.jit(lambda: run(tx[True]))().astype(jnp.float32))
  want = 1e-3 * 0.999**200
  assert np.all(rtn == np.float32(BF16(1e-3)))  # frozen
  assert abs(sr.mean() - want) < 0.01 * want


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: stochastic_round(seed=-1), "seed"),
        (lambda: stochastic_round(seed=2**32), "seed"),
        (lambda: stochastic_round(seed=1.5), "seed"),
        (lambda: scale_by_adam(nu_dtype=jnp.float16), "nu_dtype"),
        (lambda: adamw(1e-3, state_dtype=jnp.int8), "mu_dtype"),
        (lambda: scale_by_adam(b2=1.0), "b2"),
        (lambda: scale_by_adam(eps=-1.0), "eps"),
        (lambda: low_precision_optimizer(jmp_scaler.get_policy("bf16"), 1e-3, rounding="up"),
         "rounding"),
        (lambda: low_precision_optimizer(jmp_scaler.get_policy("bf16"), 1e-3, weight_decay=-1),
         "weight_decay"),
    ],
)
def test_bad_arguments_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("tx", [stochastic_round(), kahan_summation()])
def test_params_are_required(tx):
  p = {"w": jnp.ones(2, jnp.bfloat16)}
  with pytest.raises(ValueError, match="params"):
    tx.update(p, tx.init(p))


# ---------------------------------------------------------------- integrations


def _params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.bfloat16),
          "b": jnp.zeros(4, jnp.bfloat16)}


def _loss(p, x):
  return jnp.mean(jnp.tanh(x @ p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32)) ** 2)


def _batch(i, bad=False):
  x = jax.random.normal(jax.random.key(i), (16, 8))
  return x.at[0, 0].set(jnp.nan) if bad else x


@functools.cache
def _tx(rounding):
  """One optimizer per rounding: TrainState's tx is static under jit, a new one recompiles."""
  return low_precision_optimizer(jmp_scaler.get_policy("p=bf16,c=bf16,o=f32"), 1e-2,
                                 rounding=rounding, weight_decay=0.01)


@jax.jit
def _train_step(state, x):
  grads = jax.grad(_loss)(state.params, x)
  return state.apply_gradients(grads=grads)


def _leaves_bits(tree):
  return [np.asarray(a).tobytes() for a in jax.tree.leaves(tree)]


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_train_state_skip_is_exact_and_resume_is_bit_identical(rounding):
  state = jmp_scaler.TrainState.create(apply_fn=None, params=_params(), tx=_tx(rounding))
  for i in range(3):
    state = _train_step(state, _batch(i))
  before = (state.params, state.opt_state[1:], state.step)
  state = _train_step(state, _batch(99, bad=True))  # NaN gradients: skipped
  assert _leaves_bits((state.params, state.opt_state[1:], state.step)) == _leaves_bits(before)
  assert int(jmp_scaler.scale_metrics(state.opt_state)["total_skips"]) == 1
  kinds = [type(s).__name__ for s in state.opt_state]
  assert ("StochasticRoundState" if rounding == "stochastic" else "KahanState") in kinds
  # resume: save mid-run, restore into a fresh state, continue: bit-identical
  saved = jmp_scaler.to_bytes(state)
  straight = state
  for i in range(3, 6):
    straight = _train_step(straight, _batch(i))
  fresh = jmp_scaler.TrainState.create(apply_fn=None, params=_params(), tx=_tx(rounding))
  resumed = jmp_scaler.from_bytes(fresh, saved)
  for i in range(3, 6):
    resumed = _train_step(resumed, _batch(i))
  assert _leaves_bits((resumed.params, resumed.opt_state)) == _leaves_bits(
      (straight.params, straight.opt_state))
  assert straight.params["w"].dtype == jnp.bfloat16
  assert not np.array_equal(np.asarray(straight.params["w"]), np.asarray(_params()["w"]))


def test_seed_changes_the_run_and_a_rerun_is_identical():
  @jax.jit
  def run(seed_bits, xs):  # the batches come in as arguments: no PRNG in the program
    p = _params()
    outs = []
    for seed in (1, 1, 2):  # static seeds: a rerun, and another seed
      tx = optax.chain(optax.sgd(3e-3), stochastic_round(seed))
      q, s = p, tx.init(p)
      for i in range(3):
        u, s = tx.update(jax.grad(_loss)(q, xs[i] + seed_bits), s, q)
        q = optax.apply_updates(q, u)
      outs.append(q)
    return outs

  a, b, c = run(jnp.float32(0), [_batch(i) for i in range(3)])
  assert _leaves_bits(a) == _leaves_bits(b)
  assert _leaves_bits(a) != _leaves_bits(c)


def test_flax_train_state_and_no_retrace():
  state = flax_train_state.TrainState.create(apply_fn=None, params=_params(), tx=_tx("stochastic"))
  state = state.replace(step=jnp.asarray(0, jnp.int32))  # flax's Python 0 is a host transfer

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x):
    return state.apply_gradients(grads=jax.grad(_loss)(state.params, x))

  xs = [_batch(i) for i in range(3)]
  with jax.transfer_guard("disallow"):
    for x in xs:
      state = step(state, x)
  assert state.params["w"].dtype == jnp.bfloat16


def _non_scaler_states(opt):
  """Every state of the optimizer's chain but the scaler's, as bytes."""
  states = nnx.as_pure(opt.opt_state)
  return _leaves_bits([s for s in states if type(s).__name__ != "LossScaleState"])


def test_nnx_optimizer_skip_is_exact():
  model = nnx.Linear(8, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  opt = jmp_scaler.NNXOptimizer(model, _tx("stochastic"), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x):
    loss = lambda m: jnp.mean(jnp.tanh(m(x.astype(jnp.bfloat16)).astype(jnp.float32)) ** 2)
    opt.update(model, nnx.grad(loss)(model))

  first = _leaves_bits(nnx.state(model))
  step(model, opt, _batch(0))
  moved, states = _leaves_bits(nnx.state(model)), _non_scaler_states(opt)
  assert moved != first
  assert model.kernel[...].dtype == jnp.bfloat16
  step(model, opt, _batch(1, bad=True))
  assert _leaves_bits(nnx.state(model)) == moved
  assert _non_scaler_states(opt) == states  # moments, Adam's count, the rounding's count
  pure = nnx.as_pure(opt.opt_state)
  assert [int(s.count) for s in pure if type(s).__name__ == "StochasticRoundState"] == [1]
  assert int(opt.scale_metrics()["total_skips"]) == 1


def test_jit_with_named_sharding_matches_unsharded():
  """One device here (8 in the worker): a NamedSharding does not change the bits."""
  mesh = jax.make_mesh((1,), ("d",))
  tx = _tx("stochastic")
  p = _params()
  sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("d"))), p)

  @jax.jit
  def step(p, s, x):
    u, s = tx.update(jax.grad(_loss)(p, x), s, p)
    return optax.apply_updates(p, u), s

  a, _ = step(p, tx.init(p), _batch(0))
  b, _ = step(sharded, tx.init(sharded), _batch(0))
  assert _leaves_bits(a) == _leaves_bits(b)


# ---------------------------------------------------------------- 8 devices (subprocess)


@pytest.mark.slow
@pytest.mark.runs("lp_worker")
@pytest.mark.parametrize(
    "name", ["jit_8", "jit_4", "shard_map_8", "shard_map_2", "replicated_8"]
)
def test_eight_devices_match_one(worker, name):
  assert worker["devices"] == 8
  got, ref = worker[name], worker["reference"]
  assert "error" not in got, got.get("error")
  assert got["params"] == ref["params"]
  assert got["moments"] == ref["moments"]  # mu, nu, Adam's count, the rounding's count


@pytest.mark.slow
@pytest.mark.runs("lp_worker")
def test_eight_devices_details(worker):
  assert worker["jit_8"]["sharded"] == 8
  assert worker["replicated_8"]["devices_agree"]
  # each shard draws its own block of the global bits
  assert worker["block_bits"] == {"equal_to_global": True, "distinct_blocks": 8}
  # without param_specs, shard_map's blocks draw local-index bits: a different run
  assert worker["shard_map_8_no_specs"]["params"] != worker["reference"]["params"]


@pytest.mark.parametrize("make", [lambda: adam(1e-3), lambda: adamw(1e-3), scale_by_adam],
                         ids=["adam", "adamw", "scale_by_adam"])  # fmt: skip
def test_the_optax_names_store_moments_at_least_in_float32_unless_asked(make):
  # Swapping optax.adam for jmp_scaler.adam must not lower the state's precision: 16-bit
  # moments only when a 16-bit dtype is asked for (or low_precision_optimizer, named so).
  params = {"bf16": jnp.ones(2, jnp.bfloat16), "f16": jnp.ones(2, jnp.float16),
            "f32": jnp.ones(2), "c64": jnp.ones(2, jnp.complex64)}  # fmt: skip
  state = optax.tree.get(make().init(params), "nu")
  assert {k: v.dtype.name for k, v in state.items()} == {
      "bf16": "float32", "f16": "float32", "f32": "float32", "c64": "complex64"}
  asked = adam(1e-3, state_dtype=jnp.bfloat16).init({"w": jnp.ones(2)})
  assert optax.tree.get(asked, "mu")["w"].dtype == jnp.bfloat16
