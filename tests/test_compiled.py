"""What the compilers users run make of this library's programs, without their hardware:
XLA:TPU (libtpu) and XLA:GPU (jax's CUDA plugin) compile here for a TPU v5e and an H100 or B200
(``benchmarks/bench_compiled.py``, deviceless). The full sweep is the benchmark's; this holds
the claims that a later change could give back silently:

* autocast's temp memory at most hand annotation's (H100; within 15% on TPU v5e) and below
  float32's, on a small GPT (the CPU and the jaxpr cannot say it); on TPU v5e its bytes
  accessed near hand's, and a ResNet's temp memory and bytes at hand's (the recomputation of
  the composites open to XLA:TPU's fusion);
* a ``dynamic_scale`` step compiled for a TPU from this CPU host has the TPU's skip (a
  conditional), decided by the platform lowered for;
* the ``"fp8"`` rule's three GEMMs on float8 operands for an H100, and MXFP8's and NVFP4's on
  cuDNN's block-scaled GEMM for a B200, with no dequantised matmul.

Needs the ``compile`` extra (``pip install -e '.[compile]'``: libtpu and the CUDA plugin
without CUDA's libraries); skipped without it. The compiles run in a subprocess without the
suite's fast-compile XLA flags (tests/conftest.py), which would change the programs.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE = (importlib.util.find_spec("libtpu") is not None
        and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)  # fmt: skip
pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(not HAVE, reason="needs the compile extra: pip install -e '.[compile]'"),
]
# One layer at seq 512: the attention scores dominate as in the benchmark's models, and each
# compile takes seconds (the benchmark's 4-layer model takes minutes on XLA:TPU here).
SIZES = "layers=1,seq=512"


def _bench(tmp: pathlib.Path, *args: str) -> list[dict]:
  out = tmp / "rows.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "benchmarks/bench_compiled.py", *args, "--json",
                         str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=3600)  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
  rows = _bench(tmp_path_factory.mktemp("steps"), "--set", SIZES, "--targets", "v5e,h100",
                "--models", "gpt", "--variants", "float32,hand,autocast,autocast+scale")
  return {(r["target"], r["variant"]): r for r in rows}


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
  rows = _bench(tmp_path_factory.mktemp("resnet"), "--targets", "v5e", "--models", "resnet",
                "--variants", "hand,autocast")
  return {r["variant"]: r for r in rows}


@pytest.fixture(scope="module")
def lowbit(tmp_path_factory):
  rows = _bench(tmp_path_factory.mktemp("lowbit"), "--lowbit", "--targets", "h100,b200")
  return {(r["target"], r["rule"]): r for r in rows}


#: autocast's temp memory at most this times hand annotation's: 1 on the H100 (0.99 at this
#: size); on TPU v5e 1.15 (1.12 at this size, 218 against 194 MiB, where one layer leaves the
#: head's float32 logits the largest buffer of both programs; 0.96 when autocast added the
#: head's bias in float32. The benchmark's 4-layer GPT: 1.05, 1188 against 1127 MiB, and 1.18
#: with the bias in float32; 2.53 before issue 45's fixes: BENCHMARKS.md).
AT_MOST_HAND = {"v5e": 1.15, "h100": 1.0}


@pytest.mark.parametrize("target", ["v5e", "h100"])
def test_autocast_needs_hand_annotations_memory_and_less_than_float32(steps, target):
  temp = {v: steps[(target, v)]["temp"] for v in ("float32", "hand", "autocast")}
  assert temp["autocast"] <= AT_MOST_HAND[target] * temp["hand"], temp
  assert temp["autocast"] < temp["float32"] and temp["hand"] < temp["float32"], temp
  # Every matmul of both half-precision programs is a bfloat16 one.
  for variant in ("hand", "autocast"):
    dots = steps[(target, variant)]["dots"]
    assert all(",".join(["bf16"] * 2) in k for k in dots), (variant, dots)


def test_on_tpu_autocast_reads_and_writes_about_what_hand_annotation_does(steps, resnet):
  """XLA:TPU's bytes accessed: the composites' recomputation is open to its fusion on TPU
  (behind jax.checkpoint's CSE barrier it stored float32 intermediates of the attention
  scores' size) and the head's bias is added in the matmul's dtype. The GPT at this size: 1.04
  x hand (1.25 with the bias in float32, 1.54 with the barrier too; the benchmark's 4-layer
  GPT 1.06, 1.13, 1.44); the ResNet at hand's in bytes (0.98; 1.58 with the barrier) and temp
  memory (1.012; 1.38)."""
  acc = {v: steps[("v5e", v)]["bytes_accessed"] for v in ("float32", "hand", "autocast")}
  assert acc["autocast"] <= 1.1 * acc["hand"] and acc["autocast"] < acc["float32"], acc
  assert resnet["autocast"]["bytes_accessed"] <= resnet["hand"]["bytes_accessed"], resnet
  assert resnet["autocast"]["temp"] <= 1.02 * resnet["hand"]["temp"], resnet


def test_a_dynamic_scale_step_compiled_for_a_tpu_has_the_tpus_skip(steps):
  assert steps[("v5e", "autocast+scale")]["ops"].get("conditional", 0) == 1
  assert steps[("v5e", "autocast")]["ops"].get("conditional", 0) == 0
  # On a GPU the skip is a select: no conditional (docs/scaler.md, the exact skip).
  assert steps[("h100", "autocast+scale")]["ops"].get("conditional", 0) == 0


def test_fp8_gemms_take_float8_operands_on_an_h100(lowbit):
  dots = lowbit[("h100", "fp8")]["dots"]
  assert sum(dots.values()) == 3, dots  # fprop, dgrad, wgrad
  f8 = ("e4m3", "e5m2")
  assert all(all(op in f8 for op in k.split()[1].split("->")[0].split(",")) for k in dots), dots


@pytest.mark.parametrize("rule", ["mxfp8", "nvfp4"])
def test_block_scaled_gemms_reach_cudnn_on_a_b200(lowbit, rule):
  r = lowbit[("b200", rule)]
  assert r["block_scaled"] == 3, r  # fprop, dgrad, wgrad on cuDNN's block-scaled GEMM
  # No dequantised GEMM of the layer: NVFP4's one float32 dot is the random Hadamard
  # transform of the wgrad operands (by 16x16 blocks), before they are quantised.
  assert sum(r["dots"].values()) == (1 if rule == "nvfp4" else 0), r["dots"]
