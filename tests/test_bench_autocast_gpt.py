"""bench_autocast.py --model gpt --quick trains the char-GPT under autocast in float16, and with
its matmuls in fp8 (autocast's "fp8" rule)."""

import pytest

from tests._subprocess import output

# A subprocess that compiles two training programs.
pytestmark = [pytest.mark.slow, pytest.mark.runs("bench_autocast_gpt")]


@pytest.fixture(scope="module")
def rows():
  lines = output("bench_autocast_gpt").splitlines()
  head = next(i for i, ln in enumerate(lines) if ln.startswith("setup"))
  table = {}
  for ln in lines[head + 1:head + 4]:
    label, rest = ln.split("  ", 1)
    cols = rest.split()  # loss +- sd acc +- sd skips scale diff seconds
    table[label.split()[0]] = {"loss": float(cols[0]), "sd": float(cols[2]),
                               "acc": float(cols[3]), "skips": cols[6]}
  return table


def test_table_has_every_setup(rows):
  assert set(rows) == {"float32", "autocast", "fp8"}
  for row in rows.values():
    assert row["skips"].count("/") == 2  # one count per seed


def test_float16_autocast_trains_like_float32(rows):
  f32, f16 = rows["float32"], rows["autocast"]
  assert 0.0 < f16["loss"] < 4.0  # finite, and below the initial ~4.5 (ln of the vocabulary)
  assert f32["loss"] < 4.0
  # Within 5%, or 3 seed sds: a broken autocast (no gradient, wrong dtype flow) misses by far.
  assert abs(f16["loss"] - f32["loss"]) < max(0.05 * f32["loss"], 3 * f32["sd"])
  assert f16["acc"] > 0.8 * f32["acc"]


def test_fp8_matmuls_train_like_the_autocast_they_run_in(rows):
  # 60 steps (--quick: 1 layer, d=16, seq 16): fp8 2.914 +- 0.022, float16 2.908 +- 0.021
  # (paired differences 0.003-0.009).
  auto, fp8, f32 = rows["autocast"], rows["fp8"], rows["float32"]
  assert 0.0 < fp8["loss"] < 4.0
  assert abs(fp8["loss"] - auto["loss"]) < max(0.05 * f32["loss"], 3 * f32["sd"])
  assert fp8["acc"] > 0.8 * f32["acc"]
