"""fp8_dot_general on 8 virtual CPU devices: every shard uses the whole tensor's scale.

The scenarios run once, in a subprocess (``tests/md_fp8_worker.py`` sets
``XLA_FLAGS`` before importing jax); the tests assert on what it reports.
Each compares an fp8 MLP's loss and gradients with the one-device result, the
``autocast_*`` ones with the MLP's dots made fp8 by ``autocast``'s rule.
"""


import pytest

from tests._report import parse, scenario
from tests._subprocess import output

# Every test waits for the subprocess (tests/_subprocess.py starts it with the session).
pytestmark = [pytest.mark.slow, pytest.mark.runs("md_fp8_worker")]

# Differences left by summing the float32 partial products in another order (rows of the
# batch on other devices), relative to the largest value of each output.
REL_TOL = 1e-6


@pytest.fixture(scope="module")
def report():
  return parse(output("md_fp8_worker"))


@pytest.mark.parametrize(
    "name", ["jit_auto", "jit_explicit", "shard_map", "shard_map_no_check_vma", "shard_map_2d",
             # the same MLP in plain code, its dots made fp8 by autocast's rule:
             "autocast_one_device", "autocast_jit_auto", "autocast_in_shard_map",
             "shard_map_in_autocast"])
def test_eight_devices_give_the_one_device_loss_and_gradients(report, name):
  diffs = scenario(report, name)["diffs"]  # loss, dw1, dw2, dx
  rel = [d / m for d, m in zip(diffs, report["ref_max"], strict=True)]
  assert max(rel) <= REL_TOL, dict(zip(["loss", "dw1", "dw2", "dx"], rel, strict=True))


def test_a_scale_from_each_shards_own_amax_would_differ(report):
  # The control: the blocks of small rows, scaled by their own amax instead of the batch's,
  # change by far more than the tolerance above (so the tests above can fail).
  rel = scenario(report, "per_shard_control")["block_rel_diffs"]
  assert rel[3] == 0.0  # device 3's block holds the batch's amax: the same scale
  assert min(rel[:3] + rel[4:]) > 1000 * REL_TOL, rel


def test_out_sharding_is_honoured_under_explicit_sharding(report):
  assert scenario(report, "jit_explicit")["out_spec"] == "P(None, 'd')"


def test_a_partial_sum_is_refused_rather_than_scaled_by_its_partial_amax(report):
  msg = scenario(report, "unreduced")["refused"]
  assert msg and "unreduced along ['d']" in msg, msg


def test_nvfp4s_tensor_scale_is_the_whole_tensors_inside_shard_map(report):
  r = scenario(report, "nvfp4_shard_map")
  assert r["scales"] == [r["whole"]] * 8  # every device: the batch's amax (device 3's block)
  assert r["sharded_vs_one"] == 0.0  # so the batch-sharded forward is the one-device one
  assert r["local_vs_one"] > 0.0  # the control: each block's own amax would change it
