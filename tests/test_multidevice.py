"""One decision everywhere: 8 virtual CPU devices, one shard overflows, all skip.

The scenarios run once, in a subprocess (``tests/md_worker.py`` sets
``XLA_FLAGS`` before importing jax; ``tests/_subprocess.py`` starts it with the
session); the tests assert on what it reports.
The checks that need no second device run here, on a one-device mesh.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_scaler
from tests._report import parse, scenario
from tests._subprocess import output

SCALE = 2.0**10
EXPECTED_SCALES = [SCALE, SCALE, SCALE / 2, SCALE / 2]  # step 2 overflows on one device
N = 8


@pytest.fixture(scope="module")
def report():
  return parse(output("md_worker"))


# --------------------------------------------------------------------------
# In process, on a one-device mesh (shard_map tracks varying axes all the same);
# first, so that they run while the subprocesses work.


def _one_device_shard_map(fn, grads, opt_state, grad_spec):
  mesh = jax.make_mesh((1,), ("d",))
  grads = jax.device_put(grads, NamedSharding(mesh, grad_spec))
  # Under jit: one program (eagerly, shard_map compiles one per op); it traces all the same.
  sm = jax.shard_map(fn, mesh=mesh, in_specs=(grad_spec, P()), out_specs=P())
  return jax.jit(sm)(grads, opt_state)


def _init(tx):
  """``tx.init`` of two float32 zeros as one program (eagerly, one compile per leaf)."""
  return jax.jit(tx.init)(np.zeros(2, np.float32))


@pytest.mark.parametrize(
    "axis_name, grad_spec, error",
    [
        (None, P("d"), r"along mesh axes \['d'\].*axis_name=None.*axis_name='d'"),
        ("d", P("d"), None),
        (None, P(), None),  # gradients already averaged: the same everywhere
    ],
)
def test_check_axis_name(axis_name, grad_spec, error):
  tx = optax.chain(jmp_scaler.dynamic_scale(axis_name=axis_name), optax.sgd(0.1))
  opt_state = _init(tx)

  def fn(g, s):
    jmp_scaler.check_axis_name(g, s)
    return jnp.zeros([])

  if error is None:
    assert float(_one_device_shard_map(fn, np.ones(2, np.float32), opt_state, grad_spec)) == 0.0
  else:
    with pytest.raises(ValueError, match=error):
      _one_device_shard_map(fn, np.ones(2, np.float32), opt_state, grad_spec)


def test_check_axis_name_outside_shard_map_and_without_scaler_checks_nothing():
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(0.1))  # axis_name=None
  opt_state = _init(tx)

  def fn(g, s):
    jmp_scaler.check_axis_name(g, s)
    return jnp.zeros([])

  # The control: per-device gradients inside shard_map are refused with this scaler ...
  with pytest.raises(ValueError, match="axis_name=None"):
    _one_device_shard_map(fn, np.ones(2, np.float32), opt_state, P("d"))
  # ... the same arguments outside shard_map carry no mesh axes: nothing to refuse.
  assert jmp_scaler.check_axis_name(np.ones(2, np.float32), opt_state) is None
  # Without a scaler there is no decision to keep in step, even on per-device gradients.
  plain = _init(optax.sgd(0.1))
  assert float(_one_device_shard_map(fn, np.ones(2, np.float32), plain, P("d"))) == 0.0


def test_scale_in_sync_in_process():
  tx = optax.chain(jmp_scaler.dynamic_scale(axis_name="d"), optax.sgd(0.1))
  opt_state = _init(tx)
  fn = lambda g, s: jmp_scaler.scale_in_sync(s, "d")
  assert bool(_one_device_shard_map(fn, np.ones(2, np.float32), opt_state, P("d")))
  pmapped = jax.pmap(lambda s: jmp_scaler.scale_in_sync(s, "d"), axis_name="d")
  stacked = jax.tree.map(lambda a: np.asarray(a)[None], opt_state)  # numpy: no compile
  assert np.asarray(pmapped(stacked)).tolist() == [True]
  no_scaler = jax.pmap(lambda s: jmp_scaler.scale_in_sync(s, "d"), axis_name="d")
  assert np.asarray(no_scaler({"x": np.zeros((1,), np.float32)})).tolist() == [True]


# --------------------------------------------------------------------------
# What the 8-device subprocess reports.


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp", "fsdp"])
@pytest.mark.runs("md_worker")
def test_jit_named_sharding_one_shard_overflows_all_skip(report, name):
  r = scenario(report, name)
  assert r["scales"] == r["ref_scales"] == EXPECTED_SCALES
  assert r["step"] == 3  # three applied updates out of four
  assert r["skip_exact_every_shard"]  # every shard of the params bit-identical on the skip
  assert r["scale_replicated"] and r["scale_copies_identical"]
  if name == "dp":  # every device holds a copy of each parameter: all bit-identical
    assert r["params_replicated"] == [True] * 3 and r["params_copies_identical"] == [True] * 3
  else:  # each device holds its own block: there are no copies to compare
    assert r["params_replicated"] == [False] * 3 and r["params_copies_identical"] == []
  # The same global batch on one device: equal up to float32 reduction order.
  assert r["rel_diff"] < 1e-6


@pytest.mark.slow
@pytest.mark.runs("md_worker")
def test_fsdp_keeps_params_and_moments_sharded(report):
  assert scenario(report, "fsdp")["mu_spec"] == "P('d',)"
  assert scenario(report, "dp")["mu_spec"] == "P()"


@pytest.mark.slow
@pytest.mark.runs("md_worker")
def test_jit_adds_no_collective_but_the_one_the_decision_needs(report):
  dp, fsdp = scenario(report, "dp"), scenario(report, "fsdp")
  # Data parallel: the gradients are already replicated, the decision is local.
  assert dp["collectives"] == dp["baseline_collectives"]
  assert dp["scalar_all_reduces"] == 0
  # FSDP: exactly one more all-reduce, of per-leaf scalars (the finiteness flags).
  extra = dict(fsdp["collectives"])
  extra["all-reduce"] -= 1
  assert extra == fsdp["baseline_collectives"]
  assert fsdp["scalar_all_reduces"] == 1 and fsdp["baseline_scalar_all_reduces"] == 0


@pytest.mark.slow
@pytest.mark.runs("md_worker")
def test_shard_map_with_axis_name_every_device_skips(report):
  r = scenario(report, "shard_map")
  assert r["per_device_scales"] == [[s] * N for s in EXPECTED_SCALES]
  assert r["ref_scales"] == EXPECTED_SCALES
  assert r["step"] == 3 and r["rel_diff"] < 1e-6
  assert r["in_sync"] == [True] * 4


@pytest.mark.slow
@pytest.mark.runs("md_worker")
def test_shard_map_without_axis_name_devices_drift_and_the_checks_say_so(report):
  r = scenario(report, "shard_map")
  drift = r["no_axis_unchecked_scales"]
  assert drift[-1] == [SCALE if d != 3 else SCALE / 2 for d in range(N)]  # silently apart
  assert r["no_axis_in_sync"] == [True, True, False, False]  # scale_in_sync sees it
  assert r["no_axis_check_error"].startswith("ValueError: the gradients differ between "
                                             "devices along mesh axes ['d']")
  assert "axis_name='d'" in r["no_axis_check_error"]
  # In select mode (auto on CPU here) the drift is not silent either: shard_map refuses.
  assert "could not infer replication" in r["no_axis_select_error"], r["no_axis_select_error"]


@pytest.mark.slow
@pytest.mark.runs("md_worker")
def test_accumulation_under_shard_map_drops_one_devices_micro_batch_everywhere(report):
  r = scenario(report, "accumulate")
  # Window 0 (micro-batches 0, 1): device 3's micro-batch 1 overflows; every device
  # drops it, applies micro-batch 0 alone and backs off; window 1 is clean.
  assert r["per_device_scales"] == [[SCALE] * N] + [[SCALE / 2] * N] * 3
  assert r["ref_scale"] == SCALE / 2 and r["dropped"] == 1 and r["adam_count"] == 2
  assert r["rel_diff"] < 1e-6


@pytest.mark.slow
@pytest.mark.runs("md_worker")
def test_pmap_with_axis_name_every_device_skips(report):
  r = scenario(report, "pmap")
  assert r["per_device_scales"] == [[s] * N for s in EXPECTED_SCALES]
  assert r["devices_bitwise_equal"] and r["rel_diff"] < 1e-6
  assert all(all(row) for row in r["in_sync"])


@pytest.mark.slow
@pytest.mark.runs("data_parallel")
def test_example_runs():
  out = output("data_parallel")
  lines = out.splitlines()
  assert "skipped=True" in lines[1] and "skipped=False" in lines[2]
  assert "devices: 8  applied updates: 2  total skips: 1" in out
  assert "scale replicated: True" in out
  assert "Adam mu['w1'] sharding: P('data',)" in out
