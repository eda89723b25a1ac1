"""The scaling rule: scripted histories, PyTorch equivalence, bounds, dtypes."""

import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_scaler
from tests._reference import F32, reference_history
from tests._report import parse, scenario
from tests._subprocess import output

_PAD = 96  # every scripted run is padded to this many steps: one compilation.


@jax.jit
def _run(state, overflows):
  """Feeds the scaler one gradient per step: inf where ``overflows``."""
  tx = jmp_scaler.dynamic_scale()  # the rule reads its configuration from the state

  def step(state, overflow):
    g = {"w": jnp.where(overflow, jnp.inf, 1.0) * jnp.ones(3)}
    _, state = tx.update(g, state)
    return state, (state.scale, state.growth_tracker, state.skipped)

  return jax.lax.scan(step, state, overflows)


def history(tx, overflows):
  """Scale and growth tracker after each step of ``overflows`` (a list of bools)."""
  state = tx.init({"w": np.zeros(3, np.float32)})
  padded = np.zeros(_PAD, bool)
  padded[: len(overflows)] = overflows
  # Read back as numpy: slicing the device arrays would compile a program per length.
  _, (scales, trackers, skipped) = jax.device_get(_run(state, padded))
  n = len(overflows)
  np.testing.assert_array_equal(np.asarray(skipped[:n]), np.asarray(overflows, bool))
  return [(float(s), int(t)) for s, t in zip(scales[:n], trackers[:n], strict=True)]


def scales(tx, overflows):
  return [s for s, _ in history(tx, overflows)]


def test_backoff_history():
  assert scales(jmp_scaler.dynamic_scale(), [True] * 4) == [2.0**15, 2.0**14, 2.0**13, 2.0**12]


def test_growth_on_the_interval_th_finite_step_like_pytorch():
  # PyTorch grows on the 3rd consecutive finite step; flax one step later.
  tx = jmp_scaler.dynamic_scale(growth_interval=3)
  assert history(tx, [False] * 7) == [
      (2.0**16, 1), (2.0**16, 2), (2.0**17, 0), (2.0**17, 1), (2.0**17, 2), (2.0**18, 0),
      (2.0**18, 1),
  ]  # fmt: skip


def test_overflow_resets_the_growth_counter():
  tx = jmp_scaler.dynamic_scale(growth_interval=2)
  assert history(tx, [False, True, False, False, True]) == [
      (2.0**16, 1), (2.0**15, 0), (2.0**15, 1), (2.0**16, 0), (2.0**15, 0),
  ]  # fmt: skip


def test_growth_refused_at_max_scale():
  tx = jmp_scaler.dynamic_scale(growth_interval=1, max_scale=2.0**17 + 1)
  assert scales(tx, [False] * 3) == [2.0**17, 2.0**17 + 1, 2.0**17 + 1]
  tx = jmp_scaler.dynamic_scale(growth_interval=1, max_scale=2.0**17)
  assert scales(tx, [False, False, True, False]) == [2.0**17, 2.0**17, 2.0**16, 2.0**17]


def test_growth_to_inf_is_refused_with_default_bounds():
  big = float(F32.max) / 1.5
  tx = jmp_scaler.dynamic_scale(init_scale=big, growth_interval=1)
  assert scales(tx, [False] * 2) == [float(np.float32(big))] * 2


def test_min_scale_bound():
  tx = jmp_scaler.dynamic_scale(min_scale=2.0**14)
  assert scales(tx, [True] * 4 + [False]) == [2.0**15, 2.0**14, 2.0**14, 2.0**14, 2.0**14]


def test_default_lower_bound_goes_below_one():
  s = scales(jmp_scaler.dynamic_scale(), [True] * 20)
  assert s[-1] == 2.0**-4 and all(x > 0 for x in s)


def test_hysteresis_tolerates_overflows_and_refills_on_growth():
  tx = jmp_scaler.dynamic_scale(growth_interval=2, hysteresis=2)
  pattern = [True, True, True, False, False, True, False, True]
  assert scales(tx, pattern) == [
      2.0**16,  # first overflow tolerated
      2.0**15,  # second backs off
      2.0**14,  # tolerance stays used up until a growth
      2.0**14,
      2.0**15,  # growth refills the tolerance
      2.0**15,  # tolerated again
      2.0**15,
      2.0**14,
  ]
  assert scales(tx, pattern) == [s for s, _ in reference_history(pattern, growth_interval=2,
                                                                  hysteresis=2)]


def test_fixed_and_no_scale_never_move_but_skip():
  assert scales(jmp_scaler.fixed_scale(128.0), [True, False, True, False]) == [128.0] * 4
  assert scales(jmp_scaler.no_scale(), [True, False, False]) == [1.0] * 3


def test_modes_share_state_structure_and_dtypes():
  params = {"w": jnp.zeros(3)}
  shapes = [
      jax.tree.map(lambda x: (x.shape, x.dtype), tx.init(params))
      for tx in (jmp_scaler.dynamic_scale(), jmp_scaler.fixed_scale(8.0), jmp_scaler.no_scale())
  ]
  assert shapes[0] == shapes[1] == shapes[2]
  structs = [jax.tree.structure(tx.init(params)) for tx in (jmp_scaler.dynamic_scale(),
                                                             jmp_scaler.no_scale())]
  assert structs[0] == structs[1]


@settings(max_examples=60, deadline=None)
@given(
    overflows=st.lists(st.booleans(), max_size=_PAD),
    interval=st.integers(1, 6),
    init_exp=st.integers(-10, 30),
    growth=st.sampled_from([2.0, 1.5, 3.0, 1.25, 4.0]),
    backoff=st.sampled_from([0.5, 0.25, 0.75, 0.125]),
)
def test_matches_pytorch_rule_for_any_overflow_pattern(
    overflows, interval, init_exp, growth, backoff
):
  tx = jmp_scaler.dynamic_scale(2.0**init_exp, growth, backoff, interval)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    expected = reference_history(overflows, 2.0**init_exp, growth, backoff, interval)
  assert history(tx, overflows) == expected


@settings(max_examples=30, deadline=None)
@given(
    overflows=st.lists(st.booleans(), max_size=_PAD),
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    lo_exp=st.integers(5, 16),
    hi_exp=st.integers(16, 20),
)
def test_matches_reference_with_bounds_and_hysteresis(overflows, interval, hysteresis, lo_exp,
                                                      hi_exp):
  tx = jmp_scaler.dynamic_scale(
      growth_interval=interval, min_scale=2.0**lo_exp, max_scale=2.0**hi_exp,
      hysteresis=hysteresis,
  )
  expected = reference_history(
      overflows, growth_interval=interval, min_scale=2.0**lo_exp, max_scale=2.0**hi_exp,
      hysteresis=hysteresis,
  )
  assert history(tx, overflows) == expected


def test_ten_thousand_overflows_leave_a_usable_scale_and_training_recovers():
  tx = optax.chain(jmp_scaler.dynamic_scale(growth_interval=2), optax.adam(1e-2))
  params = {"w": jnp.ones(4)}
  state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)

  @jax.jit
  def run(state, overflows):
    def step(state, overflow):
      g = jnp.where(overflow, jnp.nan, 1.0) * jmp_scaler.get_scale(state.opt_state)
      return state.apply_gradients(grads={"w": g * jnp.ones(4)}), None

    return jax.lax.scan(step, state, overflows)[0]

  state = run(state, jnp.ones(10_000, bool))
  m = jmp_scaler.scale_metrics(state.opt_state)
  assert float(m["scale"]) == np.float32(F32.tiny)
  assert int(m["consecutive_skips"]) == int(m["total_skips"]) == 10_000
  assert np.isfinite(1.0 / np.float32(m["scale"]))
  np.testing.assert_array_equal(state.params["w"], params["w"])
  state = run(state, jnp.zeros(40, bool))
  m = jmp_scaler.scale_metrics(state.opt_state)
  assert float(m["scale"]) == np.float32(F32.tiny) * 2.0**20
  assert int(state.step) == 40 and int(m["consecutive_skips"]) == 0
  assert np.all(state.params["w"] < params["w"]) and np.all(np.isfinite(state.params["w"]))


def test_counters_saturate():
  tx = jmp_scaler.dynamic_scale()
  state = tx.init({"w": jnp.zeros(1)})
  top = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
  state = state._replace(consecutive_skips=top, total_skips=top, steps=top)
  _, state = jax.jit(tx.update)({"w": jnp.array([jnp.inf])}, state)
  assert int(state.consecutive_skips) == int(state.total_skips) == int(state.steps) == int(top)


# --- Gradients: unscaling, dtypes, non-floating leaves --------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_unscales_each_floating_dtype_and_keeps_it(dtype):
  tx = jmp_scaler.fixed_scale(1024.0)
  state = tx.init(None)
  g = jnp.array([1024.0, -2048.0, 3.0], dtype)
  out, state = jax.jit(tx.update)({"g": g}, state)
  assert out["g"].dtype == dtype and not bool(state.skipped)
  expected = (np.asarray(g, np.float32) / 1024.0).astype(dtype)
  np.testing.assert_array_equal(np.asarray(out["g"]), expected)


def test_half_precision_unscaling_runs_in_float32():
  # 1/65536 is subnormal in float16: unscaling in float16 would lose bits.
  tx = jmp_scaler.dynamic_scale()
  g = jnp.array([3.0 * 2**16 / 7], jnp.float16)
  out, _ = tx.update({"g": g}, tx.init(None))
  assert out["g"] == jnp.float16(np.float32(g[0]) / 2**16)


def test_unscaling_overflow_in_half_precision_is_a_skip():
  # With a scale below 1 the unscaled float16 gradient can overflow: 40000 / 0.5 > 65504.
  tx = jmp_scaler.fixed_scale(0.5)
  out, state = tx.update({"g": jnp.array([40000.0], jnp.float16)}, tx.init(None))
  assert bool(state.skipped) and np.all(np.isfinite(np.asarray(out["g"], np.float32)))
  _, state = tx.update({"g": jnp.array([30000.0], jnp.float16)}, tx.init(None))
  assert not bool(state.skipped)


@functools.cache
def _scaler_update():
  """One dynamic scaler and its jitted update, shared: a dtype compiles once."""
  tx = jmp_scaler.dynamic_scale()
  return tx, jax.jit(tx.update)


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_any_non_finite_element_in_any_leaf_is_detected(bad, dtype):
  tx, update = _scaler_update()
  b = np.ones((2, 3), dtype)
  b[1, 2] = bad
  grads = {"a": jnp.asarray(np.ones(5, np.float32)), "b": jnp.asarray(b)}
  out, state = update(grads, tx.init(None))
  assert bool(state.skipped) and float(state.scale) == 2.0**15
  # A bare chain head hands zeros, never inf/NaN, to what follows it.
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))


@settings(max_examples=25, deadline=None)
@given(
    size=st.sampled_from([1, 7, 4095, 4096, 4097, 65_536, 300_001]),
    where=st.floats(0.0, 1.0, exclude_max=True),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    dtype=st.sampled_from([np.float32, np.float16, jnp.bfloat16]),
)
def test_one_bad_element_anywhere_in_a_large_leaf_is_caught(size, where, bad, dtype):
  # A max-reduction on XLA:CPU drops NaN from 4096 elements up: the check must not.
  g = np.ones(size, np.float32)
  g[int(where * size)] = bad
  state = jmp_scaler.dynamic_scale().init(None)
  # Built in numpy (ml_dtypes casts bfloat16): no eager program compiles per shape.
  assert not bool(_CHECK({"g": jnp.asarray(g.astype(dtype))}, state))
  assert bool(_CHECK({"g": jnp.asarray(np.ones(size, dtype))}, state))


# One jitted check: a shape compiles once, not once per eager op and example.
_CHECK = jax.jit(lambda g, s: jmp_scaler.all_finite(g, s))


def test_the_compiled_check_is_not_folded_away():
  # Behaviour, not HLO text: compiled with this process's XLA flags, whatever the device
  # count, the reduction must still see inf and NaN (a fast-math fold would not).
  state = jmp_scaler.dynamic_scale().init(None)
  compiled = jax.jit(lambda g, s: jmp_scaler.all_finite(g, s)).lower(
      {"g": jnp.ones(8)}, state).compile()
  assert bool(compiled({"g": jnp.ones(8)}, state))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    assert not bool(compiled({"g": jnp.ones(8).at[5].set(bad)}, state)), bad


@settings(max_examples=30, deadline=None)
@given(
    n=st.sampled_from([2, 31, 32, 33, 70]),
    which=st.floats(0.0, 1.0, exclude_max=True),
    where=st.floats(0.0, 1.0, exclude_max=True),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_one_bad_element_in_any_leaf_of_a_group_of_small_leaves_is_caught(n, which, where, bad):
  # On one CPU device small leaves of one shape share a reduction, GROUP_SIZE at a
  # time; float32, float16 and complex leaves of that shape are checked together.
  dtypes = [np.float32, np.float16, np.complex64]
  leaves = [np.ones((9, 7), dtypes[i % 3]) for i in range(n)]  # numpy: no eager compiles
  state = jmp_scaler.dynamic_scale().init(None)
  assert bool(_CHECK([jnp.asarray(x) for x in leaves], state))
  k, e = int(which * n), int(where * 63)
  leaves[k][e // 7, e % 7] = bad  # complex leaves: bad + 0j, as .at[].set gives
  assert not bool(_CHECK([jnp.asarray(x) for x in leaves], state)), (k, e)


def test_unscaling_overflow_in_a_grouped_leaf_is_caught():
  # A float16 gradient divided by a scale below 1 can overflow: that counts, in a group too.
  leaves = [jnp.full((4, 4), 1.0, jnp.float16) for _ in range(40)]
  leaves[37] = leaves[37].at[1, 2].set(60000.0)
  state = jmp_scaler.dynamic_scale(init_scale=0.5).init(None)
  assert not bool(_CHECK(leaves, state))
  assert bool(_CHECK(leaves, jmp_scaler.dynamic_scale(init_scale=1.0).init(None)))


def _reductions(leaves):
  state = jmp_scaler.dynamic_scale().init(None)
  text = jax.jit(jmp_scaler.all_finite).lower(leaves, state).compile().as_text()
  return len(re.findall(r" reduce(?:-window)?\(", text))


def test_small_leaves_of_one_shape_share_their_reductions():
  from jmp_scaler.scaling._scaler import GROUP_BELOW, GROUP_SIZE

  small = lambda n: [jnp.ones((8, 8)) for _ in range(n)]  # noqa: E731
  # 33 and 64 leaves: two groups each, so the same reductions (one a leaf would add 31+).
  assert _reductions(small(33)) == _reductions(small(2 * GROUP_SIZE))
  assert _reductions(small(2 * GROUP_SIZE + 1)) > _reductions(small(2 * GROUP_SIZE))
  # Leaves above GROUP_BELOW elements keep one reduction each.
  big = lambda n: [jnp.ones(GROUP_BELOW + 1) for _ in range(n)]  # noqa: E731
  assert _reductions(big(4)) - _reductions(big(2)) >= 2


def test_fast_math_flags_are_warned_about(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
  with pytest.warns(UserWarning, match="fast math"):
    jmp_scaler.dynamic_scale()
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp_scaler.dynamic_scale()


def test_non_floating_leaves_and_none_pass_through():
  tx = jmp_scaler.dynamic_scale()
  grads = {"f": jnp.ones(2) * 2.0**16, "i": jnp.arange(3), "b": jnp.array([True]), "n": None,
           "e": jnp.zeros((0,))}  # fmt: skip
  out, state = jax.jit(tx.update)(grads, tx.init(None))
  assert out["n"] is None
  np.testing.assert_array_equal(out["i"], grads["i"])
  np.testing.assert_array_equal(out["b"], grads["b"])
  assert out["i"].dtype == jnp.int32 and out["b"].dtype == jnp.bool_
  assert out["e"].shape == (0,) and out["e"].dtype == jnp.float32
  np.testing.assert_array_equal(out["f"], np.ones(2))
  assert not bool(state.skipped)
  # A tree without floating leaves is finite.
  _, state = tx.update({"i": jnp.arange(2)}, tx.init(None))
  assert not bool(state.skipped)


@pytest.mark.slow
@pytest.mark.runs("md_worker")
def test_axis_name_makes_every_device_take_the_same_decision():
  # tests/md_worker.py's axis_name scenario: four devices under shard_map, one holding an inf.
  r = scenario(parse(output("md_worker")), "axis_name")
  assert r["shared"] == [[True] * 4, [2.0**15] * 4]
  assert r["local"] == [[False, False, True, False], [2.0**16, 2.0**16, 2.0**15, 2.0**16]]


# --- jit stability ---------------------------------------------------------------------


def test_one_trace_across_overflow_backoff_and_growth():
  tx = optax.chain(jmp_scaler.dynamic_scale(growth_interval=2), optax.adam(1e-3))
  state = jmp_scaler.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, g):
    return state.apply_gradients(grads={"w": g})

  for bad in [False, True, False, False, False, True, True, False, False]:
    state = step(state, jnp.full(3, jnp.inf if bad else 1.0))
  assert float(state.loss_scale) == 2.0**15
  chex.clear_trace_counter()


def test_no_host_transfer_inside_the_step():
  tx = optax.chain(jmp_scaler.dynamic_scale(growth_interval=1), optax.sgd(0.1))
  state = jmp_scaler.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx)
  good, bad = jnp.ones(3), jnp.full(3, jnp.nan)

  @jax.jit
  def step(state, g):
    state = state.apply_gradients(grads={"w": g * jmp_scaler.get_scale(state.opt_state)})
    return state, jmp_scaler.scale_metrics(state.opt_state)

  step(state, good)  # compile outside the guard
  with jax.transfer_guard("disallow"):
    for g in (good, bad, good, good):
      state, metrics = step(state, g)
  assert float(metrics["scale"]) == 2.0**18 and int(metrics["total_skips"]) == 1


# --- Lookup and metrics ----------------------------------------------------------------


def test_get_scale_finds_the_scaler_however_nested():
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  txs = [
      optax.chain(optax.chain(jmp_scaler.dynamic_scale(4.0), optax.sgd(1.0))),
      optax.MultiSteps(optax.chain(jmp_scaler.dynamic_scale(4.0), optax.adam(1.0)), 2),
      optax.inject_hyperparams(lambda learning_rate: optax.chain(
          jmp_scaler.dynamic_scale(4.0), optax.sgd(learning_rate)))(learning_rate=0.1),
      {"x": optax.chain(jmp_scaler.dynamic_scale(4.0), optax.sgd(1.0))},
  ]
  for tx in txs:
    state = tx if isinstance(tx, dict) else tx.init(params)
    if isinstance(tx, dict):
      state = {"x": tx["x"].init(params)}
    scale = jax.jit(jmp_scaler.get_scale)(state)
    assert scale.dtype == jnp.float32 and float(scale) == 4.0


def test_every_reader_of_the_scale_agrees_without_a_scaler_and_two_are_an_error():
  # Without a scaler every reader raises the same error (a float16 chain that lost its scaler
  # must not train on unscaled gradients in silence); find_scale_state asks, and answers None.
  plain = optax.adam(1.0).init(jnp.ones(2))
  with pytest.warns(UserWarning, match="holds no loss scaler"):  # said at creation too
    state = jmp_scaler.TrainState.create(apply_fn=None, params=jnp.ones(2), tx=optax.adam(1.0))
  readers = {
      "get_scale": lambda: jmp_scaler.get_scale(plain),
      "scale_metrics": lambda: jmp_scaler.scale_metrics(plain),
      "TrainState.loss_scale": lambda: state.loss_scale,
      "TrainState.scale_metrics": lambda: state.scale_metrics(),
      "value_and_grad": lambda: jmp_scaler.value_and_grad(jnp.sum, plain)(jnp.ones(2)),
  }
  for name, read in readers.items():
    with pytest.raises(ValueError, match="holds no loss scaler.*find_scale_state"):
      read()
      pytest.fail(f"{name} read a scale without a scaler")
  assert jmp_scaler.find_scale_state(plain) is None
  with pytest.raises(ValueError, match="position 1"):  # a chain refuses the second at init
    optax.chain(jmp_scaler.dynamic_scale(), jmp_scaler.dynamic_scale()).init(None)
  two = (jmp_scaler.dynamic_scale().init(None), jmp_scaler.dynamic_scale().init(None))
  with pytest.raises(ValueError, match="2 loss-scaler states"):
    jmp_scaler.get_scale(two)


def test_scale_metrics_keys_and_dtypes():
  tx = jmp_scaler.dynamic_scale()
  _, state = tx.update({"g": jnp.array([jnp.nan])}, tx.init(None))
  m = jmp_scaler.scale_metrics((state,))
  assert {k: str(v.dtype) for k, v in m.items()} == {
      "scale": "float32", "skipped": "bool", "consecutive_skips": "int32",
      "total_skips": "int32", "steps": "int32", "growth_tracker": "int32",
  }  # fmt: skip
  assert bool(m["skipped"]) and int(m["total_skips"]) == 1 and int(m["steps"]) == 1


# --- Bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"init_scale": float("nan")}, "init_scale"),
        ({"init_scale": 1e39}, "init_scale"),
        ({"init_scale": "big"}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_factor": float("inf")}, "growth_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
        ({"growth_interval": 2**31}, "growth_interval"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": 1e-40}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "min_scale"),
        ({"init_scale": 2.0**20, "max_scale": 2.0**18}, "init_scale"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"axis_name": 3}, "axis_name"),
        ({"axis_name": ()}, "axis_name"),
        ({"skip_mode": "where"}, "skip_mode"),
    ],
)
def test_bad_dynamic_scale_arguments_name_the_argument_and_value(kwargs, name):
  with pytest.raises(ValueError, match=name) as err:
    jmp_scaler.dynamic_scale(**kwargs)
  assert repr(kwargs[name]) in str(err.value)


@pytest.mark.parametrize("scale", [0.0, -2.0, float("nan"), float("inf"), None])
def test_bad_fixed_scale(scale):
  with pytest.raises(ValueError, match=f"scale.*{scale!r}"):
    jmp_scaler.fixed_scale(scale)
