"""The examples' and the migration guide's output teaches what it claims (issue 10).

Each example runs once, as a subprocess at a small size (``tests/_subprocess.py``:
in the background from the session's start; ``-m "not slow"`` starts none), and the
tests read what it printed: the skipped steps named and told apart, integer counters printed as
integers, the advice of the diagnostics consistent with the session around it,
and the plots titled with what they show. The text checks at the top need no
subprocess: every train step uses ``jmp_scaler.value_and_grad``, and the
migration guide's corrections state what the peers really do.
"""

import pathlib
import re
import struct

import jax.numpy as jnp
import optax
import pytest

import jmp_scaler
from tests._subprocess import GRADSCALER_BLOCK, output, run_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
MIGRATION = (ROOT / "docs" / "migration.md").read_text()
# A hand-scaled gradient: `grad(lambda p: loss(p) * scale)` or `... * get_scale(...)`.
HAND_SCALED = re.compile(r"(jax\.grad|jax\.value_and_grad)\(lambda [^:]*:[^\n]*\*\s*(jmp_scaler\.)?"
                         r"(get_scale|scale\b|state\.loss_scale)")


def _after_blocks() -> list[str]:
  return [b for b in re.findall(r"```python\n(.*?)```", MIGRATION, flags=re.S)
          if b.startswith("import ")]


# ---------------------------------------------------------------------------
# Item 1: one scaled value_and_grad everywhere (text checks, no subprocess).


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_trains_with_value_and_grad(path):
  text = path.read_text()
  assert "jmp_scaler.value_and_grad(" in text
  assert not HAND_SCALED.search(text), HAND_SCALED.search(text).group(0)
  assert not re.search(r"\bloss\s*/\s*scale\b", text)  # the loss is not divided back by hand


def test_migration_after_blocks_use_value_and_grad():
  blocks = _after_blocks()
  assert len(blocks) == 4
  differentiating = [b for b in blocks if "grad" in b]
  assert len(differentiating) == 3  # GradScaler, jmp and flax; apply_if_finite has no step
  for block in differentiating:
    assert "jmp_scaler.value_and_grad(" in block
    assert not HAND_SCALED.search(block) and "get_scale" not in block


def test_the_pattern_catches_a_hand_scaled_gradient():
  # The control for the two tests above: the old code matched.
  old = "  grads = jax.grad(lambda p: loss_fn(p) * jmp_scaler.get_scale(opt_state))(params)\n"
  assert HAND_SCALED.search(old)
  assert HAND_SCALED.search("loss, g = jax.value_and_grad(lambda p: f(p, x) * scale)(params)")


# ---------------------------------------------------------------------------
# Item 9: the migration guide's corrections, checked against behaviour where we can.


def test_migration_states_what_gradscaler_state_dict_saves():
  checkpoint = MIGRATION.split("- **Checkpoint.** `state_dict`")[1].split("\n- ")[0]
  for key in ("`scale`", "`growth_factor`", "`backoff_factor`", "`growth_interval`",
              "`_growth_tracker`"):
    assert key in checkpoint
  assert "two factors" in checkpoint and "three factors" not in MIGRATION


def test_migration_mentions_the_lr_scheduler_warning_on_a_skipped_first_step():
  assert "Detected call of `lr_scheduler.step()` before `optimizer.step()`" in MIGRATION
  assert "pytorch#44511" in MIGRATION


def test_apply_if_finite_passes_integer_leaves_as_the_guide_says():
  # isfinite of an integer is true: apply_if_finite, in effect, checks floating leaves only.
  tx = optax.apply_if_finite(optax.identity(), max_consecutive_errors=1)
  params = {"w": jnp.ones(2), "n": jnp.zeros([], jnp.int32)}
  _, state = tx.update({"w": jnp.ones(2), "n": jnp.asarray(2**31 - 1, jnp.int32)},
                       tx.init(params), params)
  assert bool(state.last_finite) and int(state.total_notfinite) == 0
  _, state = tx.update({"w": jnp.array([1.0, jnp.inf]), "n": jnp.zeros([], jnp.int32)},
                       state, params)
  assert not bool(state.last_finite)  # the control: a floating inf is caught
  assert "`isfinite` of an integer is" in MIGRATION


def test_ours_checks_after_unscaling_as_the_guide_says():
  # A finite scaled gradient that overflows float32 once divided by a scale below 1.
  scaled = {"w": jnp.asarray([3e38, 1.0], jnp.float32)}
  assert bool(jnp.all(jnp.isfinite(scaled["w"])))  # a check before unscaling passes it
  tx = jmp_scaler.skip_nonfinite(optax.chain(jmp_scaler.fixed_scale(2.0**-20), optax.sgd(1.0)))
  params = {"w": jnp.ones(2)}
  updates, state = tx.update(scaled, tx.init(params), params)
  assert bool(jmp_scaler.scale_metrics(state)["skipped"])
  assert optax.apply_updates(params, updates)["w"].tolist() == [1.0, 1.0]
  # The control: the same gradient at scale 1 is applied.
  tx1 = jmp_scaler.skip_nonfinite(optax.chain(jmp_scaler.no_scale(), optax.sgd(1e-38)))
  _, state1 = tx1.update(scaled, tx1.init(params), params)
  assert not bool(jmp_scaler.scale_metrics(state1)["skipped"])
  assert "after\n  unscaling" in MIGRATION or "after unscaling" in MIGRATION


def test_jmp_readme_dynamic_loss_scale_fails_on_its_first_adjust():
  """The guide says so; run it where jmp is installed (it is not a dependency)."""
  jmp = pytest.importorskip("jmp")
  loss_scale = jmp.DynamicLossScale(jmp.half_dtype()(2**15))  # jmp 0.0.4's README line
  with pytest.raises(TypeError, match="lax.select requires arguments to have the same dtypes"):
    loss_scale.adjust(jnp.asarray(True))  # finite gradients
  assert "whether the gradients are finite or not" in MIGRATION


# ---------------------------------------------------------------------------
# Subprocess runs (slow): tests/_subprocess.py's, shared with tests/test_examples.py.


def png_title(path: pathlib.Path) -> str:
  """The "Title" text chunk of a PNG (matplotlib's ``savefig(metadata=...)``)."""
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  i = 8
  while i < len(data):
    size, kind = struct.unpack(">I4s", data[i:i + 8])
    if kind == b"tEXt":
      key, value = data[i + 8:i + 8 + size].split(b"\0", 1)
      if key == b"Title":
        return value.decode("latin-1")
    i += 12 + size
  raise AssertionError(f"{path.name} has no Title")


# Item 8: the first steps, explained where they are printed, counters as integers.


@pytest.mark.slow
@pytest.mark.runs("docs")
def test_gradscaler_block_explains_calibration_and_prints_integers():
  # What the guide's first complete block printed, in the run of every complete block.
  text = output("docs").split(f"== block {GRADSCALER_BLOCK} of docs/migration.md\n")[1]
  text = text.split("== block ")[0]
  lines = re.findall(r"^step (\d+): loss ([\d.]+), skipped (True|False), "
                     r"skips so far (\S+), scale (\S+?)(  <- calibrating.*)?$", text, re.M)
  assert [int(s) for s, *_ in lines] == [1, 2, 3]
  for _, _, skipped, skips, scale, note in lines:
    assert re.fullmatch(r"\d+", skips), skips  # an integer, not 1.0
    assert float(scale) == int(scale)  # printed with :g, no trailing .0
    assert (skipped == "True") == bool(note)  # every calibration skip is explained
  assert [(s, k, sc) for _, _, s, k, sc, _ in lines] == [
      ("True", "1", "32768"), ("True", "2", "16384"), ("False", "2", "16384")]
  # The guide shows the output it prints.
  for shown, (step, loss, skipped, skips, scale, _) in zip(
      re.findall(r"^# (step \d+: .*?)(?:  <- calibrating: \.\.\.)?$", MIGRATION, re.M),
      lines, strict=True):
    assert shown == f"step {step}: loss {loss}, skipped {skipped}, skips so far {skips}, " \
                    f"scale {scale}"
  assert "**The first steps are skipped, on purpose.**" in MIGRATION


# Item 10: each example's output, read cold.


@pytest.mark.slow
@pytest.mark.runs("checkpoint_resume")
def test_checkpoint_resume_names_its_skipped_steps():
  text = output("checkpoint_resume")
  rows = {int(m[1]): (float(m[3]), int(m[4]), m[5]) for m in re.finditer(  # scale, applied, note
      r"^\s*(\d+)\s+([\d.]+)\s+(\d+)\s+(\d+)(.*)$", text, re.M)}
  assert sorted(rows) == list(range(40))
  injected = sorted(s for s, (*_, note) in rows.items() if "skipped: injected inf" in note)
  natural = sorted(s for s, (*_, note) in rows.items() if "(not injected)" in note)
  assert injected == [10, 30]
  assert natural, "the scale grows every 3 steps: float16 should overflow by itself"
  for step in range(40):  # TrainState.step advances exactly on the steps not marked skipped
    applied_before = rows[step - 1][1] if step else 0
    assert rows[step][1] == applied_before + (step not in injected + natural)
  for step in natural:  # the note names the scale the step ran at
    scale, _, note = rows[step]
    assert f"overflowed at scale {scale:g}" in note
  assert f"skipped steps: injected {injected}, float16 overflows {natural}" in text
  # The save after 20 steps and the restored TrainState.step (19): explained.
  assert "saved after 20 steps (steps 0-19, skipped: step 10)" in text
  assert (f"restored: scale {rows[20][0]:g}, TrainState.step {rows[19][1]} "
          "(applied updates: 20 steps seen minus 1 skipped)") in text
  assert "<- saved after this step" in [line for line in text.splitlines()
                                        if line.lstrip().startswith("19 ")][0]
  assert "resumed run bit-identical to the uninterrupted one: True" in text


@pytest.mark.slow
@pytest.mark.runs("accumulation")
def test_accumulation_tells_the_injected_nan_from_the_calibration_overflow():
  text = output("accumulation")
  rows = [(int(m[1]), float(m[2]), int(m[3]), int(m[4]), m[5]) for m in re.finditer(
      r"^update\s+(\d+)\s+loss [\d.]+\s+scale\s+(\S+)\s+dropped (\d+)\s+skipped (\d)(.*)$",
      text, re.M)]
  assert [r[0] for r in rows] == [0, 1, 2, 3]
  for i, (_, scale, dropped, skipped, why) in enumerate(rows):
    assert skipped == 0  # drop_micro_batch mode: the other micro-batches are applied
    assert why.count("micro-batch ") == dropped  # each dropped micro-batch is named
    if i + 1 < len(rows):  # a window with a dropped micro-batch backs off
      assert rows[i + 1][1] == (scale / 2 if dropped else scale)
  assert "micro-batch 1: the injected NaN" in rows[1][4]  # --bad-step 1, micro-batch 1
  total = sum(r[2] for r in rows)
  natural = total - 1
  m = re.search(r"^dropped micro-batches: (\d+) = (\d+) injected NaN \+ (\d+) float16 "
                r"overflow\(s\) at update\(s\) \[(.*)\]$", text, re.M)
  assert m and (int(m[1]), int(m[2]), int(m[3])) == (total, 1, natural)
  assert [int(u) for u in m[4].split(",") if u] == [r[0] for r in rows
                                                   if "not injected" in r[4]]
  if "not injected" in rows[0][4]:  # the first window ran at 2^16: calibration, explained
    assert rows[0][1] == 2.0**16 and "calibrates by halving" in text
  assert re.search(r"^skipped updates: 0 \(--mode drop_micro_batch: an update is skipped "
                   r"only when all", text, re.M)


@pytest.mark.slow
@pytest.mark.runs("digits")
def test_digits_plots_show_accuracy_and_the_growth_interval():
  output("digits")
  plots = run_dir("digits") / "plots"
  loss_title = png_title(plots / "digits_loss.png")
  assert "training loss" in loss_title and "test accuracy" in loss_title
  scale_title = png_title(plots / "digits_scale_fp16.png")
  assert "growth_interval=7" in scale_title  # the run's, not PyTorch's 2000
  assert sorted(p.name for p in plots.iterdir()) == ["digits_loss.png", "digits_scale_fp16.png"]


@pytest.mark.slow
@pytest.mark.runs("debugging")
def test_debugging_reads_the_input_advice_consistently_with_the_control():
  text = output("debugging")
  control = text.split("== 2.")[1].split("== 3.")[0]
  assert "no loss scale can fix this" in control
  step4 = text.split("== 4.")[1].split("== 5.")[0]
  advice = re.search(r"Scale too high: at most (\S+) keeps every element finite", step4)
  assert advice, step4
  assert "never the inputs" in step4
  assert f"price must be multiplied by at most {advice[1]} to fit in float16" in step4
  assert "No loss scale does that" in step4


@pytest.mark.slow
@pytest.mark.runs("debugging")
def test_debugging_finds_the_raw_feature_cast_in_one_call():
  step3 = " ".join(output("debugging").split("== 3.")[1].split("== 4.")[0].split())  # unwrapped
  assert "the first inf/NaN is made in the forward pass by" in step3
  assert re.search(r"convert_element_type at \S*examples/debugging\.py:\d+ \(loss_fn\)", step3)
  assert "float32 finite" in step3 and "a float16 range problem" in step3
  assert "rescale it before the cast (standardise the data" in step3
  assert "column 7 of the batch, 'price'" in step3


@pytest.mark.slow
@pytest.mark.runs("underflow")
def test_underflow_names_a_scale_for_the_whole_loss():
  text = output("underflow")
  aux, whole = text.split("underflow_report of the whole loss's gradients")
  aux_best = re.search(r"Scale too low: (\S+), the largest without overflow", aux)[1]
  assert f"That advice sees only the aux term: {float(aux_best):.3g}" in aux
  table = whole.split("\n\n")[0]
  for leaf in ("params/aux/kernel", "params/head/kernel", "params/trunk/kernel",
               "perturbations/recon"):
    assert leaf in table
  best = re.search(r"Scale too low: (\S+), the largest without overflow", table)[1]
  assert float(best) < float(aux_best)  # the main term's gradients are the larger
  assert (f"The largest scale that keeps every gradient of the loss finite is "
          f"{float(best):.3g},\nnot {float(aux_best):.3g}") in whole
