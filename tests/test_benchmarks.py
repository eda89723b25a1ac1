"""The benchmark scripts run (tiny sizes, in a subprocess) and print every variant."""

import importlib.util
import re

import pytest

from tests._subprocess import output

pytestmark = pytest.mark.slow  # every test waits for a subprocess


def _rows(table):
  """variant name -> list of its columns, from one printed table."""
  lines = table.splitlines()
  start = next(i for i, ln in enumerate(lines) if ln.startswith("---")) + 1
  rows = {}
  for ln in lines[start:]:
    if not ln.strip() or ln.startswith("peak "):
      break
    rows[ln.split()[0]] = ln.split()
  return rows


@pytest.fixture(scope="module")
def cpu_tables():
  out = output("bench_cpu")
  tables = re.split(r"\n## ", out)[1:]
  return {t.split(":")[0]: t for t in tables}


@pytest.mark.runs("bench_cpu")
def test_bench_cpu_quick_prints_every_variant_for_both_models(cpu_tables):
  assert sorted(cpu_tables) == ["mlp", "transformer"]
  expected = ["none", "trainstate", "optax", "flax", "apply_if_finite"]
  if importlib.util.find_spec("jmp") is not None:
    expected.append("jmp")
  for table in cpu_tables.values():
    rows = _rows(table)
    assert list(rows) == expected
    for name in expected:
      ms, ratio = float(rows[name][1]), float(rows[name][3])
      assert ms > 0 and ratio > 0
    assert float(rows["none"][3]) == 1.0


@pytest.mark.runs("bench_cpu")
def test_bench_cpu_quick_profile_lists_kernels_of_every_variant(cpu_tables):
  for table in cpu_tables.values():
    section = table.split("\nkernel time, ms per step")[1].strip().splitlines()[1:]
    profiled = {ln.split()[0]: ln for ln in section if ln.strip()}
    assert list(profiled) == list(_rows(table))
    for line in profiled.values():
      total, first_kernel = line.split()[1], line.split()[2]
      assert float(total) >= 0 and first_kernel[0].isalpha(), line


@pytest.mark.runs("bench_cpu")
def test_bench_cpu_quick_jmp_scaler_traces_once_and_skips(cpu_tables):
  for table in cpu_tables.values():
    header = table.split("\n---")[0].splitlines()[-1].split()
    traces = header.index("traces") - 2  # "median ms" and "temp MiB" are two words
    for name in ("trainstate", "optax"):
      row = _rows(table)[name]
      assert row[traces] == "1", row
      line = " ".join(row)
      assert "yes" in row  # every timed step was finite
      assert re.search(r"kept, scale 1024->512$", line), line
    assert _rows(table)["none"][-1] == "APPLIED"  # the overflow step is real


@pytest.mark.runs("bench_gpu")
def test_bench_gpu_quick_runs_on_cpu():
  out = output("bench_gpu")
  rows = _rows(out)
  names = ["fp32", "bf16", "fp16", "fp16+cond", "fp16+select", "fp16+optax", "fp8"]
  assert list(rows) == names
  for name in names:
    assert float(rows[name][1]) > 0, rows[name]
    assert rows[name][-1] == "yes", rows[name]
  assert float(rows["bf16"][3]) == 1.0
  # 2 blocks x 4 projections x (forward, dgrad, wgrad) lowered as fp8 dots; none compiled as
  # an fp8 GEMM on XLA:CPU (the GPU run compares the two counts).
  assert re.search(r"fp8 report: 24 fp8 sites lowered .* = 0 of 24; fp8 throughput", out), out



@pytest.mark.runs("bench_find")
def test_bench_find_quick_times_every_case_and_finds_each_origin():
  out = output("bench_find")
  steps = re.findall(r"^(char-GPT|CNN) .*\bstep\s+([\d.]+)\s+1\.00\s", out, re.M)
  assert [m for m, _ in steps] == ["char-GPT", "CNN"], out
  cases = re.findall(r"^\s+(clean|forward|backward)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
  assert [c for c, _, _ in cases] == ["clean", "forward", "backward"] * 2, out
  assert all(float(s) > 0 and float(r) > 0 for _, s, r in cases)
  found = out.split("\nfound:\n")[1]
  assert "char-GPT, clean: nothing non-finite" in found
  assert "CNN, clean: nothing non-finite" in found
  # A float16 overflow in a matmul or a convolution of the benchmarks' own models, at the
  # model's line, that float32 would not have made; the backward one at scale 2**30.
  at = r" at benchmarks/\w+\.py:\d+ \([\w.<>]+\), finite in float32: True$"
  assert re.search(r"^  char-GPT, forward: forward dot_general" + at, found, re.M), found
  assert re.search(r"^  CNN, forward: forward conv_general_dilated" + at, found, re.M), found
  for model in ("char-GPT", "CNN"):
    assert re.search(rf"^  {model}, backward: backward \w+" + at, found, re.M), found


@pytest.mark.runs("bench_skip_cuts")
def test_bench_skip_cuts_quick_compiles_each_form_and_the_cuts_shorten_the_module():
  out = output("bench_skip_cuts")
  rows = {m.group(1): (float(m.group(2)), int(m.group(3))) for m in re.finditer(
      r"^(none|aif|ts_(?:cond|select) (?:before|\+group))\s+([\d.]+)\s.*\s(\d+)$", out, re.M)}
  assert list(rows) == ["none", "aif", "ts_cond before", "ts_select before", "ts_cond +group",
                        "ts_select +group"], out
  assert rows["none"][0] == 1.0 and all(ratio > 0 for ratio, _ in rows.values())
  # The cuts since 26e7f7e take instructions out of the skip in both modes (8 leaves).
  assert rows["ts_select +group"][1] < rows["ts_select before"][1], rows
  assert rows["ts_cond +group"][1] < rows["ts_cond before"][1], rows


@pytest.mark.runs("bench_memory")
def test_bench_memory_quick_autocast_saves_no_more_than_hand_annotation_on_any_model():
  """The quick run's table: every model (transformers unrolled, scanned and rematerialised,
  NNX Gemma, ResNet), autocast's saved bytes at most hand annotation's and below float32's."""
  text = output("bench_memory")
  rows = {}
  for line in text.splitlines():
    cells = line.split()
    if len(cells) == 8 and cells[1] == "float16":
      rows[cells[0]] = [float(c) for c in cells[2:]]
  assert sorted(rows) == sorted(["gpt", "gpt_scan", "gpt_remat", "llama", "llama_scan",
                                 "lm1b", "gemma", "resnet"])
  for name, (f32, hand, module, ours, vs_hand, vs_f32) in rows.items():
    assert ours <= hand + 1e-9 and vs_hand <= 1.0, (name, rows[name])
    assert ours < f32 and vs_f32 < 0.75 and hand < f32 and module > 0, (name, rows[name])
  # the transformers' MLPs and norms: well under hand annotation, not only equal to it
  assert rows["gpt"][4] < 0.8 and rows["gemma"][4] < 0.8 and rows["resnet"][4] < 0.8
