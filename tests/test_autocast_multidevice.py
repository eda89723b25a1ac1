"""autocast in data-parallel steps on 8 virtual CPU devices: shard_map with grad, and pmap.

The scenarios run once, in a subprocess (``tests/md_autocast_worker.py`` sets
``XLA_FLAGS`` before importing jax); the tests assert on the JSON it prints.
"""


import pytest

from tests._report import parse, scenario
from tests._subprocess import output

# A subprocess with 8 devices (tests/_subprocess.py starts it with the session).
pytestmark = [pytest.mark.slow, pytest.mark.runs("md_autocast_worker")]


@pytest.fixture(scope="module")
def report():
  return parse(output("md_autocast_worker"))


def test_grad_of_autocast_with_custom_rules_inside_shard_map_with_check_vma(report):
  r = scenario(report, "grad")
  assert r["custom_calls"] == ["custom_jvp_call", "custom_vjp_call"]  # relu, gelu, own ones
  assert r["float16_dots"] >= 4  # forward and backward matmuls in float16, per shard
  assert r["dtypes"] == ["float32"] and r["finite"]
  # The same gradients as the whole batch on one device (float32 sums in another order) ...
  assert r["inside_vs_one_device"] < 2e-3
  assert r["around_vs_one_device"] < 5e-3  # autocast around the shard_map step: either order
  # ... and as the same step without autocast, to float16's precision.
  assert r["inside_vs_float32"] < 1e-2


def test_resnet_step_with_batchnorm_over_the_data_axis_under_shard_map_and_pmap(report):
  r = scenario(report, "resnet")
  assert r["steps"] == [2, 2]  # both steps applied under both
  assert r["dtypes"] == ["float32"]  # master weights and batch statistics
  assert r["pmap_batch_stats_synced"] and r["stats_moved"]
  # shard_map and pmap compute the same step, to float16's rounding: the first convolution's
  # bias is added in float16 (as torch's conv does), which XLA fuses into the two programs
  # differently (one float16 rounding apart, 2^-11; BatchNorm's bias, near 0 after two steps,
  # shows it as 2e-3 of its largest value) ...
  assert r["shard_map_vs_pmap"] < 1e-2 and r["stats_shard_map_vs_pmap"] < 1e-3
  assert r["shard_map_losses"][0] == r["pmap_losses"][0]
  for a, b in zip(r["shard_map_losses"], r["pmap_losses"], strict=True):
    assert abs(a - b) < 1e-4
  # ... and the float32 step's losses, to float16's precision.
  for a, b in zip(r["shard_map_losses"], r["float32_losses"], strict=True):
    assert abs(a - b) < 1e-3
