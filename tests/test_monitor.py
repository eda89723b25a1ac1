"""ScaleMonitor on scripted metric streams, and to_scalars for metric writers."""

import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_scaler
from jmp_scaler import ScaleMonitor, ScaleWarning


def stream(events, *, init=2.0**16, interval=100, lo=jmp_scaler.DEFAULT_MIN_SCALE,
           hi=jmp_scaler.DEFAULT_MAX_SCALE):
  """A scripted ``scale_metrics`` stream: ``events`` is a string, one char per
  step: ``.`` finite, ``x`` overflow. Scale moves by PyTorch's rule."""
  scale, tracker, skips, consecutive, out = init, 0, 0, 0, []
  for i, e in enumerate(events, start=1):
    if e == "x":
      scale, tracker, skips, consecutive = max(scale / 2, lo), 0, skips + 1, consecutive + 1
    else:
      tracker, consecutive = tracker + 1, 0
      if tracker == interval:  # a growth whose result is not finite in float32 is refused
        scale = min(scale * 2, hi) if scale * 2 <= float(np.finfo(np.float32).max) else scale
        tracker = 0
    out.append({"scale": np.float32(scale), "skipped": np.bool_(e == "x"),
                "consecutive_skips": np.int32(consecutive), "total_skips": np.int32(skips),
                "steps": np.int32(i), "growth_tracker": np.int32(tracker)})
  return out


def feed(monitor, metrics, every=1):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for m in metrics[every - 1 :: every]:
      monitor.update(m)
  assert all(issubclass(w.category, ScaleWarning) for w in caught)
  return [str(w.message) for w in caught]


def test_healthy_sawtooth_run_is_quiet_and_summarised():
  # Grow every 100 finite steps, overflow right after each growth: PyTorch's steady state.
  events = ("." * 100 + "x") * 10
  monitor = ScaleMonitor(window=200)
  assert feed(monitor, stream(events)) == []
  assert monitor.summary() == {
      "steps": 1010, "skips": 10, "skip_rate": 10 / 1010, "calibration_skips": 0,
      "final_scale": 2.0**16, "lowest_scale": 2.0**16, "highest_scale": 2.0**17,
      "warnings": (),
  }
  assert monitor.format_summary() == (
      "1010 steps, 10 skipped (0.99%); scale final 65536, lowest 65536, highest 131072; "
      "no warnings")
  h = monitor.history
  assert h["steps"].tolist() == list(range(1, 1011))
  assert h["skipped"].sum() == 10 and h["skipped"][100] and h["scale"][99] == 2.0**17


def test_initial_calibration_is_not_a_collapse():
  # 12 halvings from 2^16 to find 2^4, then a healthy run: no warning.
  monitor = ScaleMonitor(window=50, collapse_factor=16)
  assert feed(monitor, stream("x" * 12 + "." * 300)) == []
  s = monitor.summary()
  assert s["calibration_skips"] == 12 and s["skips"] == 12 and s["final_scale"] == 2.0**7
  assert "12 calibrating" in monitor.format_summary()


def test_collapse_warns_once_naming_the_fall():
  monitor = ScaleMonitor(window=100, collapse_factor=256, max_skip_rate=0.5)
  events = "." * 150 + "x" * 8 + "." * 10 + "x" * 5 + "." * 20
  messages = feed(monitor, stream(events))
  assert len(messages) == 1
  assert messages[0].startswith("loss scale collapsed from 131072 to 512 (256x) within 8 steps "
                                "(step 150 to 158)")
  # The op and line first (find_nonfinite finds a forward cast too), then the leaves.
  assert messages[0].index("find_nonfinite(") < messages[0].index("nonfinite_report(grads)")
  assert [k for k, _, _ in monitor.warnings_seen] == ["collapse"]
  assert monitor.warnings_seen[0][1] == 158


def test_a_slow_decline_spread_over_more_than_the_window_is_no_collapse():
  events = ("." * 60 + "x") * 10  # -2x every 61 steps, never 256x within 100 steps
  assert feed(ScaleMonitor(window=100, max_skip_rate=0.5), stream(events, interval=10**6)) == []


def test_sitting_at_min_scale_warns_once():
  monitor = ScaleMonitor(window=1000, min_scale=1.0, collapse_factor=2.0**40)
  messages = feed(monitor, stream("." * 5 + "x" * 20 + "." * 5 + "x" * 3, lo=1.0))
  assert len(messages) == 1
  assert messages[0].startswith("loss scale at min_scale=1 at step 21:")
  assert monitor.summary()["lowest_scale"] == 1.0


def test_skip_rate_above_the_threshold_warns_and_below_does_not():
  noisy = ("." * 9 + "x") * 40  # 10% of the steps overflow
  messages = feed(ScaleMonitor(window=100, max_skip_rate=0.05, collapse_factor=2.0**30),
                  stream(noisy, interval=5))
  assert len(messages) == 1 and messages[0].startswith("10.0% of the updates from step 1 to 101")
  quiet = ("." * 99 + "x") * 4  # 1%
  assert feed(ScaleMonitor(window=100, max_skip_rate=0.05), stream(quiet)) == []


def test_sparse_logging_sees_the_same_skip_rate():
  noisy = ("." * 9 + "x") * 40
  messages = feed(ScaleMonitor(window=100, collapse_factor=2.0**30), stream(noisy, interval=5),
                  every=25)
  assert len(messages) == 1 and "of the updates from step 25 to 125" in messages[0]


def test_pinned_at_max_scale_warns_after_a_window():
  monitor = ScaleMonitor(window=50, max_scale=2.0**18)
  messages = feed(monitor, stream("." * 400, interval=10, hi=2.0**18))
  assert len(messages) == 1
  assert messages[0].startswith("loss scale pinned at its maximum 262144 since step 20 (50 steps)")
  # Without a user maximum, the scale is pinned once it can no longer double in float32.
  monitor = ScaleMonitor(window=20)
  messages = feed(monitor, stream("." * 200, init=2.0**120, interval=1))
  assert len(messages) == 1 and "pinned at its maximum 1.70141e+38" in messages[0]


def test_a_fixed_scale_never_warns_about_its_bounds():
  monitor = ScaleMonitor(window=10, min_scale=8.0, max_scale=8.0)
  assert feed(monitor, stream("." * 100, init=8.0, interval=10**6)) == []


def test_stacked_metrics_equal_step_by_step_feeding():
  metrics = stream("x" * 3 + ("." * 20 + "x" * 9) * 4, interval=10)
  one = ScaleMonitor(window=40)
  feed(one, metrics)
  stacked = ScaleMonitor(window=40)
  batch = jax.tree.map(lambda *v: np.stack(v), *metrics)
  with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    issued = stacked.update(batch)
  assert issued == [m for _, _, m in one.warnings_seen]
  assert stacked.summary() == one.summary()
  np.testing.assert_array_equal(stacked.history["scale"], one.history["scale"])


def test_no_update_ever_applied_warns_after_a_window():
  monitor = ScaleMonitor(window=30, collapse_factor=2.0**10)
  messages = feed(monitor, stream("x" * 60))
  kinds = [k for k, _, _ in monitor.warnings_seen]
  assert kinds == ["collapse", "skip_rate"] and len(messages) == 2
  assert messages[1].startswith("100.0% of the updates from step 0 to 30")
  assert monitor.summary()["calibration_skips"] == 0


@jax.jit
def _run(opt_state, overflows):
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(0.1))

  def step(opt_state, overflow):
    _, opt_state = tx.update({"w": jnp.where(overflow, jnp.inf, 1.0) * jnp.ones(2)}, opt_state)
    return opt_state, jmp_scaler.scale_metrics(opt_state)

  return jax.lax.scan(step, opt_state, overflows)


def test_real_scaler_metrics_and_bounds_from_the_state():
  tx = optax.chain(jmp_scaler.dynamic_scale(min_scale=2.0**10, max_scale=2.0**20,
                                            growth_interval=5), optax.sgd(0.1))
  opt_state = tx.init({"w": jnp.zeros(2)})
  monitor = ScaleMonitor.for_state(opt_state, window=20)
  assert (monitor.min_scale, monitor.max_scale, monitor.growth_factor) == (2.0**10, 2.0**20, 2.0)
  overflows = np.array([False] * 10 + [True] * 8 + [False] * 5)
  _, metrics = _run(opt_state, overflows)  # stacked device arrays, one transfer
  with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    monitor.update(metrics)
  assert [k for k, _, _ in monitor.warnings_seen] == ["min_scale", "collapse", "skip_rate"]
  assert monitor.summary()["skips"] == 8 and monitor.summary()["lowest_scale"] == 2.0**10
  with pytest.raises(ValueError, match="holds no loss-scaler state"):
    ScaleMonitor.for_state(optax.sgd(0.1).init({"w": jnp.zeros(2)}))


def test_to_scalars_gives_python_numbers_for_writers():
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(0.1))
  metrics = {**jmp_scaler.scale_metrics(tx.init({"w": jnp.zeros(2)})), "loss": jnp.float32(0.5),
             "extra": flax.core.FrozenDict({"lr": np.float64(0.1), "n": 3})}
  scalars = jmp_scaler.to_scalars(metrics, prefix="train/")
  assert scalars == {"train/scale": 65536.0, "train/skipped": 0, "train/consecutive_skips": 0,
                     "train/total_skips": 0, "train/steps": 0, "train/growth_tracker": 0,
                     "train/loss": 0.5, "train/extra/lr": 0.1, "train/extra/n": 3}
  assert all(type(v) in (int, float) for v in scalars.values())
  assert type(scalars["train/skipped"]) is int and type(scalars["train/scale"]) is float
  with pytest.raises(ValueError, match="metric 'v' must be a scalar"):
    jmp_scaler.to_scalars({"v": jnp.ones(3)})


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 0}, r"window must be an integer in \[1, 2\*\*31 - 1\], got 0"),
    ({"window": 2.5}, "window must be an integer"),
    ({"collapse_factor": 1.0}, "collapse_factor must be finite and > 1, got 1.0"),
    ({"max_skip_rate": 1.0}, r"max_skip_rate must lie in \[0, 1\), got 1.0"),
    ({"min_scale": 4.0, "max_scale": 2.0}, "need 0 < min_scale <= max_scale"),
    ({"growth_factor": 0.5}, "growth_factor must be finite and >= 1, got 0.5"),
])
def test_monitor_validates_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ScaleMonitor(**kwargs)


def test_update_requires_a_scale():
  with pytest.raises(ValueError, match="metrics must hold 'scale'"):
    ScaleMonitor().update({"loss": 1.0})


def test_a_resumed_monitor_summarises_like_the_uninterrupted_run():
  import json

  # Calibration skips, a collapse to warn about, then recovery; resumed in the middle.
  events = "xxx" + "." * 20 + "x" * 12 + "." * 80
  metrics = stream(events, interval=20)
  whole = ScaleMonitor(window=30)
  feed(whole, metrics)
  first = ScaleMonitor(window=30)
  feed(first, metrics[:60])
  saved = json.loads(json.dumps(first.state_dict()))  # as a user stores it
  resumed = ScaleMonitor(window=30).load_state_dict(saved)
  feed(resumed, metrics[60:])
  assert resumed.summary() == whole.summary()
  assert resumed.format_summary() == whole.format_summary()
  assert resumed.history["scale"].tolist() == whole.history["scale"].tolist()
  # Without the saved state the resumed run forgets what it saw before the checkpoint.
  fresh = ScaleMonitor(window=30)
  feed(fresh, metrics[60:])
  assert fresh.summary()["lowest_scale"] != whole.summary()["lowest_scale"]
  with pytest.raises(ValueError, match="missing"):
    ScaleMonitor().load_state_dict({"steps": []})


def test_the_min_scale_warning_says_how_to_recover():
  metrics = stream("x" * 5, init=4.0, lo=1.0)
  messages = feed(ScaleMonitor(window=10, min_scale=1.0), metrics)
  assert any("min_scale" in m and "recover" in m for m in messages)
