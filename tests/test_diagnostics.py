"""Non-finite and underflow reports: exact counts, paths, jit, the train-step metric."""

import doctest

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_scaler
from jmp_scaler.diagnostics import _monitor, _nonfinite

INF, NAN = float("inf"), float("nan")


def _grads():
  return {
      "params": {
          "Dense_0": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)},
          "Dense_1": {"kernel": jnp.array([[1.0, INF], [NAN, -INF]]), "bias": jnp.array([NAN])},
      },
      "step": jnp.int32(7),  # not floating: ignored
      "none": None,
  }


def test_nonfinite_report_names_each_culprit_leaf_with_counts():
  report = jmp_scaler.nonfinite_report(_grads())
  assert report.paths == (
      "params/Dense_0/bias", "params/Dense_0/kernel", "params/Dense_1/bias",
      "params/Dense_1/kernel",
  )
  assert report.sizes == (4, 12, 1, 4)
  assert report.culprits() == [
      ("params/Dense_1/bias", 1, 0, 1),
      ("params/Dense_1/kernel", 1, 2, 4),
  ]
  assert int(report.count()) == 4
  text = report.format()
  assert text.startswith("2 of 4 floating leaves hold inf/NaN (4 elements); first in tree "
                         "order: params/Dense_1/bias")
  assert "params/Dense_0" not in text
  assert report.to_dict("g") == {
      "g/elements": 4, "g/leaves": 2, "g/params/Dense_1/bias": 1, "g/params/Dense_1/kernel": 3,
  }


def test_nonfinite_report_of_a_finite_tree_and_of_an_empty_one():
  finite = jmp_scaler.nonfinite_report({"a": jnp.ones(3, jnp.bfloat16), "b": jnp.float16(2)})
  assert finite.culprits() == [] and int(finite.count()) == 0
  assert str(finite) == "all 2 floating leaves are finite"
  empty = jmp_scaler.nonfinite_report({"i": jnp.arange(3)})
  assert empty.paths == () and empty.nan.shape == (0,) and int(empty.count()) == 0


def test_nonfinite_report_is_jittable_traces_once_and_never_syncs():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def fn(tree):
    return jmp_scaler.nonfinite_report(tree)

  good = jax.device_put({"w": jnp.ones(5), "b": jnp.ones(2, jnp.float16)})
  bad = jax.device_put({"w": jnp.array([1, INF, NAN, 1, 1.0]), "b": jnp.ones(2, jnp.float16)})
  fn(good)  # compile outside the guard
  with jax.transfer_guard("disallow"):
    out_good, out_bad = fn(good), fn(bad)
  assert out_good.culprits() == []
  assert out_bad.culprits() == [("w", 1, 1, 5)]
  assert out_bad.nan.dtype == jnp.int32 and out_bad.inf.dtype == jnp.int32


def test_nonfinite_report_when_false_costs_a_branch_and_reports_nothing():
  fn = jax.jit(lambda tree, when: jmp_scaler.nonfinite_report(tree, when=when))
  bad = {"w": jnp.array([INF, NAN])}
  assert fn(bad, False).culprits() == []
  assert fn(bad, True).culprits() == [("w", 1, 1, 2)]
  hlo = fn.lower(bad, True).as_text()
  assert "conditional" in hlo or "case" in hlo  # the counting sits in a lax.cond branch


def _train_step(tx):
  """A jitted step returning scale_metrics merged with an opt-in report."""

  @jax.jit
  def step(state, x, poison):
    def loss(p):
      h = jnp.tanh(x @ p["Dense_0"]["kernel"])
      out = h @ (p["Dense_1"]["kernel"] * poison)  # poison = inf injects an overflow
      return jnp.sum(out**2) * jmp_scaler.get_scale(state.opt_state)

    grads = jax.grad(loss)(state.params)
    new = state.apply_gradients(grads=grads)
    skipped = new.scale_metrics()["skipped"]
    return new, {**new.scale_metrics(), "nonfinite": jmp_scaler.nonfinite_report(
        grads, when=skipped)}

  return step


def test_report_as_an_opt_in_metric_of_the_scaler_names_the_layer():
  params = {"Dense_0": {"kernel": jnp.full((3, 4), 0.1)}, "Dense_1": {"kernel": jnp.ones((4, 2))}}
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(1e-3))
  state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)
  step = _train_step(tx)
  x = jnp.ones((2, 3))
  state, healthy = step(state, x, 1.0)
  scalars = jmp_scaler.to_scalars(healthy, prefix="train/")
  assert scalars["train/skipped"] == 0 and scalars["train/nonfinite/leaves"] == 0
  state, bad = step(state, x, INF)
  assert bool(bad["skipped"])
  culprits = [c.path for c in bad["nonfinite"].culprits()]
  assert "Dense_1/kernel" in culprits  # the poisoned layer is named
  scalars = jmp_scaler.to_scalars(bad)
  assert scalars["skipped"] == 1 and scalars["nonfinite/Dense_1/kernel"] == 8
  assert scalars["scale"] == 2.0**15


def _reference_classes(x, scale, dtype):
  """numpy's IEEE rounding: zero / subnormal / overflow counts of finite nonzero x."""
  x = np.asarray(x, np.float32)
  live = np.isfinite(x) & (x != 0)
  with np.errstate(over="ignore"):
    r = np.abs((x * np.float32(scale)).astype(dtype))
  tiny = float(jnp.finfo(dtype).tiny)
  return [int(np.sum(live & (r == 0))), int(np.sum(live & (r != 0) & (r < tiny))),
          int(np.sum(live & np.isinf(r))), int(np.sum(live))]


def test_underflow_report_classifies_float16_exactly():
  x = jnp.array([1e-9, 2.98e-8, 3e-8, 1e-6, 6e-5, 1e-4, 1.0, 7e4, 0.0, NAN, -INF], jnp.float32)
  report = jmp_scaler.underflow_report({"g": x}, scale=1.0)
  got = [int(a[0]) for a in (report.zero, report.subnormal, report.overflow, report.nonzero)]
  assert got == [2, 3, 1, 8]  # 1e-9 and 2.98e-8 flush; 3e-8, 1e-6, 6e-5 are subnormal
  assert got == _reference_classes(x, 1.0, np.float16)
  scaled = jmp_scaler.underflow_report({"g": x}, scale=2.0**10)
  got = [int(a[0]) for a in (scaled.zero, scaled.subnormal, scaled.overflow)]
  assert got == [0, 3, 1]  # 1e-9, 2.98e-8, 3e-8 are subnormal at 2^10; 7e4 overflows
  assert float(report.max_abs[0]) == pytest.approx(7e4)


_jit_underflow = jax.jit(jmp_scaler.underflow_report, static_argnums=2)


@settings(max_examples=40, deadline=None)
@given(
    exps=st.lists(st.floats(-30.0, 10.0), min_size=1, max_size=32),
    scale=st.floats(2.0**-4, 2.0**30),
    bf16=st.booleans(),
)
def test_underflow_report_matches_numpy_rounding(exps, scale, bf16):
  dtype = jnp.bfloat16 if bf16 else jnp.float16
  x = np.zeros(32, np.float32)  # one shape: one compilation per dtype; zeros are ignored
  x[: len(exps)] = 10.0 ** np.asarray(exps)
  x[::2] *= -1
  report = _jit_underflow({"g": jnp.asarray(x)}, jnp.float32(scale), dtype)
  got = [int(a[0]) for a in (report.zero, report.subnormal, report.overflow, report.nonzero)]
  assert got == _reference_classes(x, scale, dtype)
  assert int(report.hist.sum()) == len(exps)


def test_underflow_report_is_jittable_with_a_traced_scale_and_when():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def fn(tree, scale, when):
    return jmp_scaler.underflow_report(tree, scale, when=when)

  tree = {"a": jnp.array([1e-9, 1e-3]), "b": jnp.array([1e-7], jnp.float16)}
  r1 = fn(tree, jnp.float32(1.0), True)
  r2 = fn(tree, jnp.float32(2.0**27), True)
  r3 = fn(tree, jnp.float32(1.0), False)
  assert [int(v) for v in r1.zero] == [1, 0] and [int(v) for v in r1.subnormal] == [0, 1]
  assert [int(v) for v in r2.zero] == [0, 0] and [int(v) for v in r2.overflow] == [1, 0]
  assert int(r3.nonzero.sum()) == 0 and float(r2.scale) == 2.0**27


def test_underflow_advice_too_low_too_high_and_bfloat16():
  g = {"w": jnp.array([1e-7, 2e-6, 3e-4])}
  low = jmp_scaler.underflow_report(g, scale=1.0)
  assert low.best_scale() == 2.0**27  # 65504 / 3e-4 = 2.2e8 -> 2^27
  assert "Scale too low: 1.34218e+08, the largest without overflow" in low.advice()
  high = jmp_scaler.underflow_report(g, scale=2.0**30)
  assert "Scale too high: at most 1.34218e+08" in high.advice()
  fits = jmp_scaler.underflow_report(g, scale=2.0**20)
  assert "The scale fits" in fits.advice() and "bfloat16" not in fits.advice()
  # Magnitudes spanning 2^60: no float16 scale keeps them all, bfloat16 does.
  wide = {"w": jnp.array([1e-14, 1e-9, 1e-3, 1e4])}
  advice = jmp_scaler.underflow_report(wide, scale=1.0).advice()
  assert "bfloat16" in advice and "would lose 0%: safer" in advice
  bf = jmp_scaler.underflow_report(wide, scale=1.0, dtype=jnp.bfloat16)
  assert "The scale fits" in bf.advice() and int(bf.zero.sum()) == 0
  assert "No finite nonzero" in jmp_scaler.underflow_report({"z": jnp.zeros(2)}).advice()


def test_underflow_estimate_agrees_with_an_exact_report_away_from_binade_edges():
  rng = np.random.default_rng(0)
  x = (1.5 * 2.0 ** rng.integers(-40, 0, size=500)).astype(np.float32)  # mid-binade values
  report = jmp_scaler.underflow_report({"x": jnp.asarray(x)}, scale=1.0)
  for log2_scale in (0, 10, 20, 30):
    exact = jmp_scaler.underflow_report({"x": jnp.asarray(x)}, scale=2.0**log2_scale)
    est = report.estimate(2.0**log2_scale)
    assert est["zero"] == pytest.approx(int(exact.zero.sum()) / 500)
    assert est["subnormal"] == pytest.approx(int(exact.subnormal.sum()) / 500)
    assert est["overflow"] == pytest.approx(int(exact.overflow.sum()) / 500)


def test_underflow_format_and_to_dict():
  report = jmp_scaler.underflow_report({"a": jnp.array([1e-9, 1.0]), "b": jnp.array([1.0])})
  text = report.format()
  assert text.splitlines()[1].split() == ["a", "50%", "0%", "0%", "1"]
  assert text.splitlines()[2].split() == ["b", "0%", "0%", "0%", "1"]
  assert report.to_dict() == {
      "underflow/zero_fraction": pytest.approx(1 / 3), "underflow/subnormal_fraction": 0.0,
      "underflow/overflow_fraction": 0.0, "underflow/best_scale": 32768.0,
      "underflow/zero/a": 0.5,
  }


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": jnp.int32}, "dtype must be a floating dtype"),
    ({"dtype": "nope"}, "dtype must be a floating dtype"),
    ({"scale": 0.0}, "scale must be positive and finite, got 0.0"),
    ({"scale": -2}, "scale must be positive and finite, got -2"),
    ({"scale": INF}, "scale must be positive and finite"),
    ({"scale": NAN}, "scale must be positive and finite"),
])
def test_underflow_report_validates_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jmp_scaler.underflow_report({"g": jnp.ones(2)}, **kwargs)


def test_docstring_examples_run():
  for module in (_nonfinite, _monitor):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, module.__name__
