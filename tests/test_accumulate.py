"""Gradient accumulation under a loss scaler: exact against a large batch built by hand."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_scaler
from tests._subprocess import output

K = 4
SCALE = 2.0**10
LR = 1e-2


def _params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(2,)) * 0.1, jnp.float32)}


def _batches(n, seed=1):
  """``n`` micro-batches of 4 examples each."""
  rng = np.random.default_rng(seed)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return [(f32(4, 3), f32(4, 2)) for _ in range(n)]


def _loss(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


@functools.partial(jax.jit, static_argnames="bad")
def _scaled_grads(params, batch, scale, bad=False):
  g = jax.grad(lambda p: _loss(p, batch) * scale)(params)
  if bad:
    g["w"] = g["w"].at[1, 0].set(jnp.nan)
  return g


def _record():
  """A probe: passes updates through and keeps the last ones it saw as its state."""
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda updates, state, params=None: (updates, updates),
  )


@functools.cache
def _tx(mode="drop_micro_batch", scaler=None, k=K):
  """Accumulation around scaler -> probe -> Adam; ``inner_state[1]`` is the mean handed on."""
  scaler = jmp_scaler.dynamic_scale(SCALE) if scaler is None else scaler
  return jmp_scaler.accumulate_gradients(
      optax.chain(scaler, _record(), optax.adam(LR)), k, on_nonfinite=mode
  )


@functools.cache
def _jitted(tx):
  return jax.jit(tx.update)


def _run(tx, params, state, batches, bad=(), jit=True):
  """Feeds one micro-batch per call; returns params, state and the scale seen by each call."""
  update = _jitted(tx) if jit else tx.update
  scales = []
  for i, batch in enumerate(batches):
    found = jmp_scaler.find_scale_state(state)  # no scaler: the gradients are not scaled
    scale = jnp.float32(1.0) if found is None else found.scale
    scales.append(float(scale))
    grads = _scaled_grads(params, batch, scale, bad=i in bad)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state, scales


# XLA contracts ``a * b + c`` into one fused multiply-add inside a jitted
# function but not eagerly, so the hand-built sum jits the expression the
# library jits. Adam's moments may still round differently by one ulp
# depending on how XLA fuses them, so the gradient handed to Adam is compared
# bit for bit (that is what accumulation computes) and the step within 1e-6.
_acc = jax.jit(lambda t, g, inv: jax.tree.map(lambda a, b: a + b * inv, t, g))
_adam_update = jax.jit(optax.adam(LR).update)


def _hand_mean(params, batches, scale, keep):
  """The large-batch gradient, by hand: sum of the unscaled kept micro-gradients / count."""
  inv = jnp.float32(1.0) / jnp.float32(scale)
  kept = [_scaled_grads(params, b, scale) for b, k in zip(batches, keep, strict=True) if k]
  total = jax.tree.map(jnp.zeros_like, params)
  for g in kept:
    total = _acc(total, g, inv)
  return jax.tree.map(lambda t: t / jnp.float32(len(kept)), total)


def _hand_step(params, adam_state, mean):
  updates, adam_state = _adam_update(mean, adam_state, params)
  return optax.apply_updates(params, updates), adam_state


def _assert_close(a, b):
  chex.assert_trees_all_close(a, b, rtol=1e-6, atol=0)


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_exact_against_a_large_batch_step_built_by_hand():
  params = _params()
  tx = _tx()
  state = tx.init(params)
  ref, adam_state = params, optax.adam(LR).init(params)
  for w in range(2):
    window = _batches(K, seed=w)
    start = params
    params, state, scales = _run(tx, params, state, window)
    assert scales == [SCALE] * K
    # By hand: the sum of the unscaled micro-gradients over the count, bit for bit ...
    mean = _hand_mean(start, window, SCALE, [True] * K)
    _assert_equal(state.inner_state[1], mean)
    # ... which is the large-batch gradient (the mean of equal-sized micro-batch means).
    big = (jnp.concatenate([b[0] for b in window]), jnp.concatenate([b[1] for b in window]))
    chex.assert_trees_all_close(mean, jax.jit(jax.grad(_loss))(start, big), rtol=1e-5,
                                atol=1e-7)
    ref, adam_state = _hand_step(ref, adam_state, _hand_mean(ref, window, SCALE, [True] * K))
  _assert_close(params, ref)
  _assert_close(state.inner_state[2], adam_state)
  assert int(state.inner_state[2][0].count) == 2
  assert int(state.mini_step) == 0 and int(state.dropped) == 0
  assert int(jmp_scaler.find_scale_state(state).steps) == 2  # the scaler counts windows


def test_a_nonfinite_micro_batch_is_dropped_and_the_scale_backs_off():
  params = _params()
  tx = _tx()
  batches = _batches(K)
  got, state, scales = _run(tx, params, tx.init(params), batches, bad={2})
  mean = _hand_mean(params, batches, SCALE, [True, True, False, True])
  _assert_equal(state.inner_state[1], mean)  # the average over the 3 finite micro-batches
  ref, adam_state = _hand_step(params, optax.adam(LR).init(params), mean)
  _assert_close(got, ref)
  _assert_close(state.inner_state[2], adam_state)
  assert scales == [SCALE] * K  # fixed within the window, even after the NaN
  m = jmp_scaler.scale_metrics(state)
  assert float(m["scale"]) == SCALE / 2  # ... and backed off when the window closed
  assert not bool(m["skipped"]) and int(m["total_skips"]) == 0
  assert int(m["growth_tracker"]) == 0 and int(m["steps"]) == 1
  assert int(state.dropped) == 1


@pytest.mark.parametrize("mode", ["cond", "select"])
def test_a_window_of_one_call_is_skip_nonfinite(mode):
  # every_k=1 keeps no running sum (it stays zero, neither written nor cleared on each
  # call) and takes the same steps as skip_nonfinite, skips and backoffs included.
  params = _params()
  scaler = lambda: jmp_scaler.dynamic_scale(SCALE, growth_interval=2, skip_mode=mode)  # noqa: E731
  acc = jmp_scaler.accumulate_gradients(optax.chain(scaler(), optax.adam(LR)), 1)
  ref = jmp_scaler.skip_nonfinite(optax.chain(scaler(), optax.adam(LR)))
  batches, bad = _batches(6), {1, 4}
  got, state, scales = _run(acc, params, acc.init(params), batches, bad=bad)
  want, ref_state, ref_scales = _run(ref, params, ref.init(params), batches, bad=bad)
  assert scales == ref_scales and len(set(scales)) > 1  # it grew and backed off
  # Within an ulp: XLA fuses (and contracts into FMAs) the two programs differently.
  _assert_close(got, want)
  _assert_close(state.inner_state, ref_state)
  assert all(not np.any(x) for x in jax.tree.leaves(state.grad_sum))
  assert int(state.dropped) == len(bad)


def test_skip_window_mode_skips_the_whole_update_exactly():
  params = _params()
  tx = _tx("skip_window")
  state = tx.init(params)
  init = state
  got, state, scales = _run(tx, params, state, _batches(K), bad={2})
  _assert_equal(got, params)
  _assert_equal(state.inner_state[1:], init.inner_state[1:])  # Adam's count too
  assert scales == [SCALE] * K
  m = jmp_scaler.scale_metrics(state)
  assert float(m["scale"]) == SCALE / 2 and bool(m["skipped"]) and int(m["total_skips"]) == 1
  # The next window starts clean and is applied.
  batches = _batches(K, seed=2)
  _, state, _ = _run(tx, got, state, batches)
  _assert_equal(state.inner_state[1], _hand_mean(got, batches, SCALE / 2, [True] * K))
  assert int(state.inner_state[2][0].count) == 1


def test_a_window_with_no_finite_micro_batch_is_skipped_in_drop_mode():
  params = _params()
  tx = _tx()
  init = tx.init(params)
  got, state, _ = _run(tx, params, init, _batches(K), bad=set(range(K)))
  _assert_equal(got, params)
  _assert_equal(state.inner_state[1:], init.inner_state[1:])
  m = jmp_scaler.scale_metrics(state)
  assert float(m["scale"]) == SCALE / 2 and int(m["total_skips"]) == 1
  assert int(state.dropped) == K


def test_scale_history_counts_windows_and_is_fixed_inside_them():
  params = _params()
  scaler = jmp_scaler.dynamic_scale(SCALE, growth_interval=2)
  tx = _tx(scaler=scaler, k=3)
  # Windows: finite, finite (-> grow), one NaN (-> back off), finite.
  _, state, scales = _run(tx, params, tx.init(params), _batches(12), bad={7})
  s = SCALE
  assert scales == [s] * 6 + [2 * s] * 3 + [s] * 3
  assert float(jmp_scaler.get_scale(state)) == s


def test_one_trace_no_host_sync_and_bit_identical_params_mid_window():
  params = _params()
  tx = _tx()
  state = tx.init(params)
  update = jax.jit(chex.assert_max_traces(tx.update, n=1))
  batches = _batches(2 * K)
  grads = [_scaled_grads(params, b, SCALE, bad=i == 1) for i, b in enumerate(batches)]
  outputs = []
  with jax.transfer_guard("disallow"):
    for g in grads:
      updates, state = update(g, state, params)
      outputs.append(updates)
  for i, updates in enumerate(outputs):
    if (i + 1) % K:  # mid-window: -0.0 everywhere, parameters bit-identical
      assert all(np.all(np.signbit(u)) and not np.any(u) for u in jax.tree.leaves(updates))
      _assert_equal(optax.apply_updates(params, updates), params)
    else:
      assert any(np.any(u) for u in jax.tree.leaves(updates))
  init = tx.init(params)
  assert jax.tree.map(lambda a: (a.dtype, a.shape), state) == jax.tree.map(
      lambda a: (a.dtype, a.shape), init
  )


def test_select_mode_gives_the_same_windows_as_cond_mode():
  params = _params()
  batches = _batches(2 * K)
  runs = []
  for mode in ("cond", "select"):
    tx = _tx(scaler=jmp_scaler.dynamic_scale(SCALE, skip_mode=mode))
    runs.append(_run(tx, params, tx.init(params), batches, bad={1, 4, 5, 6, 7}))
  (p1, s1, scales1), (p2, s2, scales2) = runs
  assert scales1 == scales2 == [SCALE] * K + [SCALE / 2] * K
  _assert_equal(s1.inner_state[1], s2.inner_state[1])  # the same mean handed on
  _assert_equal(jmp_scaler.scale_metrics(s1), jmp_scaler.scale_metrics(s2))
  assert int(s2.inner_state[2][0].count) == 1 and int(s2.dropped) == 5  # window 2 skipped
  _assert_close(p1, p2)


@pytest.mark.parametrize("k, cond", [(1, False), (K, True)])
def test_auto_skip_mode_runs_the_chain_under_cond_when_it_runs_once_a_window(k, cond):
  # every_k > 1: the optimizer runs on one call in k, so the conditional skips the
  # other k - 1 (select would run Adam on every micro-batch); every_k == 1 is a plain skip.
  params = _params()
  tx = _tx(k=k)
  step = jax.jit(lambda g, s: tx.update(g, s, params))
  compiled = step.lower(params, tx.init(params)).compile().as_text()  # what XLA:CPU runs
  assert ("conditional(" in compiled) is cond


def test_without_a_scaler_the_mean_is_over_finite_micro_batches():
  params = _params()
  tx = jmp_scaler.accumulate_gradients(optax.sgd(1.0), K)
  batches = _batches(K)
  got, state, scales = _run(tx, params, tx.init(params), batches, bad={0})
  mean = _hand_mean(params, batches, 1.0, [False, True, True, True])
  _assert_equal(got, jax.tree.map(lambda p, g: p - g, params, mean))
  assert scales == [1.0] * K and int(state.dropped) == 1


def test_under_train_state_a_bad_micro_batch_waits_and_sums_stay_exact():
  """TrainState drops the micro-batch itself and backs off at once; the window waits."""
  params = _params()
  state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=_tx())
  batches = _batches(K + 1)
  step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  scales = []
  for i, batch in enumerate(batches):
    scales.append(float(state.loss_scale))
    state = step(state, _scaled_grads(state.params, batch, state.loss_scale, bad=i == 1))
  assert scales == [SCALE, SCALE] + [SCALE / 2] * (K - 1)
  kept = [b for i, b in enumerate(batches) if i != 1]
  inv = [1 / SCALE] + [2 / SCALE] * (K - 1)
  total = jax.tree.map(jnp.zeros_like, params)
  for b, v, s in zip(kept, inv, scales[:1] + scales[2:], strict=True):
    total = _acc(total, _scaled_grads(params, b, s), jnp.float32(v))
  mean = jax.tree.map(lambda t: t / jnp.float32(K), total)
  _assert_equal(state.opt_state.inner_state[1], mean)
  assert int(state.opt_state.inner_state[2][0].count) == 1


def test_under_flax_train_state_it_behaves_as_in_an_optax_loop():
  from flax.training import train_state

  params = _params()
  batches = _batches(K)
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=_tx())
  step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  for i, batch in enumerate(batches):
    state = step(state, _scaled_grads(state.params, batch, SCALE, bad=i == 2))
  mean = _hand_mean(params, batches, SCALE, [True, True, False, True])
  _assert_equal(state.opt_state.inner_state[1], mean)
  assert float(jmp_scaler.get_scale(state.opt_state)) == SCALE / 2
  assert int(state.opt_state.dropped) == 1


def test_multisteps_under_train_state_mixes_two_scales():
  """The documented reason to replace optax.MultiSteps: it sums *scaled* gradients."""
  params = _params()
  inner = optax.chain(jmp_scaler.dynamic_scale(SCALE), optax.sgd(1.0))
  state = jmp_scaler.TrainState.create(
      apply_fn=None, params=params, tx=optax.MultiSteps(inner, K).gradient_transformation()
  )
  step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  batch = _batches(1)[0]
  for i in range(K + 1):  # the same micro-batch each time; the second one overflows
    state = step(state, _scaled_grads(params, batch, state.loss_scale, bad=i == 1))
  true = jax.jit(jax.grad(_loss))(params, batch)  # one program, not eager autodiff
  applied = jax.tree.map(lambda a, b: a - b, params, state.params)
  # One micro-batch at 2**10 and three at 2**9, divided by 2**9: (2 + 3) / 4 = 1.25x.
  chex.assert_trees_all_close(applied, jax.tree.map(lambda g: 1.25 * g, true), rtol=1e-5)


def test_multisteps_with_skip_not_finite_never_backs_off_accumulate_does():
  """MultiSteps' skip_not_finite hides the overflow from the scaler: training stalls."""
  params = {"w": jnp.ones(3, jnp.float16)}
  true = jnp.asarray([1.0, 2.0, 3.0], jnp.float32)
  grad = lambda s: {"w": (true * s).astype(jnp.float16)}  # overflows when s > 2**14

  def run(tx):
    state, p = jax.jit(tx.init)(params), params  # one program, not MultiSteps' eager init
    # The scaled float16 gradient is made in the same program as the update.
    update = jax.jit(lambda s, p: tx.update(grad(jmp_scaler.get_scale(s)), s, p))
    for _ in range(4 * K):
      updates, state = update(state, p)
      p = optax.apply_updates(p, updates)
    return p, state

  inner = optax.chain(jmp_scaler.dynamic_scale(2.0**16), optax.sgd(2.0**-4))
  multi = optax.MultiSteps(inner, K, should_skip_update_fn=optax.skip_not_finite)
  p, state = run(multi.gradient_transformation())
  assert float(jmp_scaler.get_scale(state)) == 2.0**16  # stuck
  _assert_equal(p, params)
  p, state = run(jmp_scaler.accumulate_gradients(inner, K))
  assert float(jmp_scaler.get_scale(state)) == 2.0**14  # two skipped windows, then two applied
  expected = (1.0 - 2 * 2.0**-4 * np.asarray(true)).astype(np.float16)
  np.testing.assert_array_equal(p["w"], expected)


def test_multisteps_without_skip_fn_is_poisoned_for_good_skip_window_is_not():
  """optax.MultiSteps resets its accumulator as ``0 * acc``: one NaN stays for ever."""
  params = _params()
  batches = _batches(3 * K)
  chain = lambda: optax.chain(jmp_scaler.dynamic_scale(SCALE), optax.sgd(0.1))
  multi = optax.MultiSteps(jmp_scaler.skip_nonfinite(chain()), K).gradient_transformation()
  p1, s1, scales1 = _run(multi, params, multi.init(params), batches, bad={1})
  assert scales1 == [SCALE] * K + [SCALE / 2] * K + [SCALE / 4] * K
  assert int(jmp_scaler.scale_metrics(s1)["total_skips"]) == 3
  _assert_equal(p1, params)
  ours = jmp_scaler.accumulate_gradients(chain(), K, on_nonfinite="skip_window")
  p2, s2, scales2 = _run(ours, params, ours.init(params), batches, bad={1})
  assert scales2 == [SCALE] * K + [SCALE / 2] * 2 * K
  assert int(jmp_scaler.scale_metrics(s2)["total_skips"]) == 1
  assert not np.array_equal(p2["w"], params["w"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_k": 0}, "every_k must be an integer.*got 0"),
        ({"every_k": 2.0}, "every_k must be an integer.*got 2.0"),
        ({"every_k": True}, "every_k must be an integer.*got True"),
        ({"every_k": 2, "on_nonfinite": "zero"}, "on_nonfinite must be one of .*'zero'"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jmp_scaler.accumulate_gradients(optax.sgd(0.1), **kwargs)


@pytest.mark.slow
@pytest.mark.runs("accumulation")
def test_example_runs():
  out = output("accumulation")  # --bad-step 1: one NaN micro-batch in update 1
  # The leading count of each summary line (the example explains it after the number).
  count = lambda label: int(re.search(rf"^{label}: (\d+)\b", out, re.M).group(1))
  assert count("dropped micro-batches") >= 1, out  # the injected NaN micro-batch
  assert count("skipped updates") == 0, out  # ... dropped alone, the update applied
