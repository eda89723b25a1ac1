"""Checkpoints: exact resume through Orbax and flax.serialization, checked restores."""

import doctest
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_scaler
from tests import _xla
from tests._subprocess import output, run_dir

STEPS, SAVE_AT = 12, 6
OVERFLOW_AT = (1, 4, 9)  # before and after the save
# growth_interval=2: growth at steps 3, 6, 8 and 11, backoff at 1, 4 and 9.
SCALES = [4.0, 2.0, 2.0, 4.0, 2.0, 2.0, 4.0, 4.0, 8.0, 4.0, 4.0, 8.0]
_RNG = np.random.default_rng(0)
# numpy: XS[i] and BAD[i] are host slices, not an eager program per index.
XS = _RNG.normal(size=(STEPS, 8, 4)).astype(np.float32)
BAD = np.asarray([i in OVERFLOW_AT for i in range(STEPS)])


def make_tx(**kw):
  kw = {"init_scale": 4.0, "growth_interval": 2, **kw}
  return optax.chain(jmp_scaler.dynamic_scale(**kw), optax.adam(1e-2))


TX = make_tx()  # one object: the jitted steps see one static tx and compile once
# Faster XLA compilation (about half the CPU time); both runs use the same.
FAST = _xla.compile_options()


def _bits(tree):
  def raw(x):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x).tobytes()

  return [raw(x) for x in jax.tree.leaves(tree)]


def _scaler(tree):
  return jmp_scaler.find_scale_state(tree)


def _with_scaler(tree, **changes):
  is_lss = lambda x: isinstance(x, jmp_scaler.LossScaleState)
  return jax.tree.map(lambda x: x._replace(**changes) if is_lss(x) else x, tree, is_leaf=is_lss)


# ---------------------------------------------------------------- TrainState


def _apply(params, x):
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


def fresh_state(tx=TX):
  rng = np.random.default_rng(1)
  params = {
      "w1": jnp.asarray(rng.normal(size=(4, 8)) / 2, jnp.float32),
      "b1": jnp.zeros(8, jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(8, 1)) / 3, jnp.float32),
  }
  return jmp_scaler.TrainState.create(apply_fn=_apply, params=params, tx=tx)


TRACES = []


@functools.partial(jax.jit, compiler_options=FAST)
def train_step(state, x, bad):
  TRACES.append(None)
  y = jnp.sin(x.sum(1, keepdims=True))
  grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2) * state.loss_scale)(
      state.params
  )
  return state.apply_gradients(grads=jax.tree.map(lambda g: jnp.where(bad, jnp.inf, g), grads))


def run(state, start, stop):
  history = []
  for i in range(start, stop):
    state = train_step(state, XS[i], BAD[i])
    history.append(_bits(state))
  return state, history


@functools.cache
def uninterrupted():
  state, history = run(fresh_state(), 0, STEPS)
  return state, history


@pytest.mark.parametrize("via", ["orbax", "bytes"])
def test_train_state_resumes_bit_identically(via, tmp_path):
  final, history = uninterrupted()
  assert [float(x) for x in jax.tree.leaves(_scaler(final.opt_state).scale)] == [SCALES[-1]]
  saved, first = run(fresh_state(), 0, SAVE_AT)
  assert first == history[:SAVE_AT]
  if via == "orbax":
    jmp_scaler.save_checkpoint(tmp_path / "ckpt", saved)
    restored = jmp_scaler.restore_checkpoint(tmp_path / "ckpt", fresh_state())
  else:
    restored = jmp_scaler.from_bytes(fresh_state(), jmp_scaler.to_bytes(saved))
  assert isinstance(restored, jmp_scaler.TrainState) and restored.tx is TX
  assert _bits(restored) == _bits(saved)
  assert float(restored.loss_scale) == SCALES[SAVE_AT - 1] and int(restored.step) == 4
  scales = []
  state = restored
  for i in range(SAVE_AT, STEPS):
    state = train_step(state, XS[i], BAD[i])
    scales.append(float(state.loss_scale))
    assert _bits(state) == history[i], f"step {i} differs"
  assert scales == SCALES[SAVE_AT:]
  assert len(TRACES) == 1  # restoring does not retrace the step


def test_config_mismatch_raises_unless_told_which_to_use(tmp_path):
  saved, _ = run(fresh_state(), 0, SAVE_AT)  # scale 2, hysteresis tracker 1
  data = jmp_scaler.to_bytes(saved)
  other = fresh_state(make_tx(growth_interval=5, hysteresis=3, max_scale=1.0, init_scale=1.0))
  with pytest.raises(ValueError) as err:
    jmp_scaler.from_bytes(other, data)
  message = str(err.value)
  for text in ("growth_interval: saved 2, target 5", "hysteresis: saved 1, target 3",
               "max_scale", "on_config_mismatch='saved'", "'target'"):  # fmt: skip
    assert text in message
  assert "growth_factor" not in message
  kept = jmp_scaler.from_bytes(other, data, on_config_mismatch="saved")
  assert _bits(kept) == _bits(saved)
  applied = _scaler(jmp_scaler.from_bytes(other, data, on_config_mismatch="target").opt_state)
  assert int(applied.config.growth_interval) == 5 and int(applied.config.hysteresis) == 3
  assert float(applied.scale) == 1.0  # clipped into the target's bounds
  assert applied.scale.dtype == jnp.float32 and applied.config.hysteresis.dtype == jnp.int32
  assert int(applied.growth_tracker) == int(_scaler(saved.opt_state).growth_tracker)
  jmp_scaler.save_checkpoint(tmp_path / "c", saved)
  with pytest.raises(ValueError, match="configured differently"):
    jmp_scaler.restore_checkpoint(tmp_path / "c", other)
  with pytest.raises(ValueError, match="on_config_mismatch must be one of"):
    jmp_scaler.restore_checkpoint(tmp_path / "c", other, on_config_mismatch="ignore")


@pytest.mark.parametrize("scale", [0.0, -2.0, np.inf, np.nan])
def test_corrupted_scale_is_refused(scale, tmp_path):
  state = fresh_state()
  corrupted = _with_scaler(state, scale=jnp.asarray(scale, jnp.float32))
  for mode in ("raise", "saved", "target"):
    with pytest.raises(ValueError, match="positive and finite; the checkpoint is corrupted"):
      jmp_scaler.from_bytes(state, jmp_scaler.to_bytes(corrupted), on_config_mismatch=mode)
  if np.isnan(scale):
    jmp_scaler.save_checkpoint(tmp_path / "c", corrupted)
    with pytest.raises(ValueError, match="corrupted"):
      jmp_scaler.restore_checkpoint(tmp_path / "c", state)


def test_other_corruptions_and_structure_are_refused():
  state = fresh_state()
  out_of_bounds = _with_scaler(state, scale=jnp.asarray(2.0**20, jnp.float32))
  capped = fresh_state(make_tx(max_scale=2.0**10))
  with pytest.raises(ValueError, match="outside its configured bounds"):
    jmp_scaler.check_restored(_with_scaler(capped, scale=out_of_bounds.opt_state[0].scale), capped)
  negative = _with_scaler(state, total_skips=jnp.asarray(-1, jnp.int32))
  with pytest.raises(ValueError, match="total_skips .* negative"):
    jmp_scaler.check_restored(negative, state)
  config = state.opt_state[0].config
  broken = _with_scaler(state, config=config.replace(growth_factor=jnp.float32(np.nan)))
  with pytest.raises(ValueError, match="configuration at .* is invalid"):
    jmp_scaler.check_restored(broken, state, on_config_mismatch="saved")
  with pytest.raises(ValueError, match="growth_factor: saved nan, target 2.0"):
    jmp_scaler.check_restored(broken, state)
  with pytest.raises(ValueError, match="holds 1 loss-scaler states but target holds 0"):
    jmp_scaler.check_restored(state, {"no": "scaler"})
  assert jmp_scaler.check_restored(state.opt_state, state.opt_state) == state.opt_state


def test_docstring_examples():
  module = jmp_scaler.checkpoint._restore_check
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- NNX


class Net(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(jax.nn.relu(self.ln(self.l1(x)))))


def _make():
  key = lambda i: jax.random.key(i, impl="unsafe_rbg")  # fast to compile
  model = Net(nnx.Rngs(key(0), dropout=key(1)))
  return model, jmp_scaler.NNXOptimizer(model, TX, wrt=nnx.Param)


GRAPHDEF = nnx.graphdef(nnx.eval_shape(_make))
_init = jax.jit(lambda: nnx.state(_make()), compiler_options=FAST)


def _build():
  """A fresh (model, optimizer), initialised by one jitted program."""
  return nnx.merge(GRAPHDEF, _init())


@functools.partial(jax.jit, compiler_options=FAST)
def _pure_step(state, x, bad):
  model, opt = nnx.merge(GRAPHDEF, state)
  y = jnp.sin(x.sum(1, keepdims=True))
  scale = opt.loss_scale
  grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2) * scale)(model)
  opt.update(model, jax.tree.map(lambda g: jnp.where(bad, jnp.inf, g), grads))
  return nnx.state((model, opt))


def nnx_step(model, opt, x, bad):
  nnx.update((model, opt), _pure_step(nnx.state((model, opt)), x, bad))


def nnx_run(model, opt, start, stop):
  history = []
  for i in range(start, stop):
    nnx_step(model, opt, XS[i], BAD[i])
    history.append(_bits(nnx.state((model, opt))))
  return history


@functools.cache
def nnx_uninterrupted():
  return nnx_run(*_build(), 0, STEPS)


@pytest.mark.parametrize("via", ["orbax", "bytes"])
def test_nnx_model_and_optimizer_resume_bit_identically(via, tmp_path):
  history = nnx_uninterrupted()
  model, opt = _build()
  assert nnx_run(model, opt, 0, SAVE_AT) == history[:SAVE_AT]
  target = _build()
  if via == "orbax":
    jmp_scaler.save_checkpoint(tmp_path / "ckpt", (model, opt))
    out = jmp_scaler.restore_checkpoint(tmp_path / "ckpt", target)
  else:
    out = jmp_scaler.from_bytes(target, jmp_scaler.to_bytes((model, opt)))
  assert out is target  # updated in place
  assert float(target[1].loss_scale) == SCALES[SAVE_AT - 1] and int(target[1].step[...]) == 4
  assert nnx_run(*target, SAVE_AT, STEPS) == history[SAVE_AT:]


def test_nnx_restore_checks_before_touching_the_target():
  model, opt = _build()
  opt.opt_state[0].scale[...] = jnp.asarray(np.nan, jnp.float32)
  data = jmp_scaler.to_bytes((model, opt))
  target = _build()
  before = _bits(nnx.state(target))
  with pytest.raises(ValueError, match="corrupted"):
    jmp_scaler.from_bytes(target, data)
  assert _bits(nnx.state(target)) == before
  opt.opt_state[0].scale[...] = jnp.asarray(2.0, jnp.float32)
  opt.opt_state[0].config.hysteresis[...] = jnp.asarray(4, jnp.int32)
  data = jmp_scaler.to_bytes((model, opt))
  with pytest.raises(ValueError, match="hysteresis: saved 4, target 1"):
    jmp_scaler.from_bytes(target, data)
  jmp_scaler.from_bytes(target, data, on_config_mismatch="target")
  assert int(target[1].opt_state[0].config.hysteresis[...]) == 1
  assert float(target[1].loss_scale) == 2.0


# ---------------------------------------------------------------- example

@pytest.mark.slow
@pytest.mark.runs("checkpoint_resume")
def test_checkpoint_resume_example_runs():
  # tests/_subprocess.py's run (--steps 40, shared with tests/test_example_outputs.py).
  stdout = output("checkpoint_resume")
  assert "bit-identical to the uninterrupted one: True" in stdout
  assert "ValueError: the loss scaler restored" in stdout
  assert "on_config_mismatch='target': growth_interval 4" in stdout
  assert os.path.isdir(run_dir("checkpoint_resume") / "ckpt" / "step_20")  # saved at 40 // 2


# ---------------------------------------------------------------- refusals


def _nnx_pair():
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  return model, jmp_scaler.NNXOptimizer(model, make_tx(), wrt=nnx.Param)


@pytest.mark.parametrize("case, fragment", [
    ("empty map", "missing /"),
    ("(model,) into (model, optimizer)", "missing /1/"),
    ("a (4, 2) kernel into Linear(5, 2)", "kernel: saved ((4, 2), 'float32'), target ((5, 2)"),
    ("garbage", "not a jmp_scaler.to_bytes checkpoint"),
])
def test_from_bytes_refuses_what_does_not_match_an_nnx_target(case, fragment):
  model, opt = _nnx_pair()
  if case == "empty map":
    data, target = jmp_scaler.to_bytes({}), _nnx_pair()
  elif case == "(model,) into (model, optimizer)":
    data, target = jmp_scaler.to_bytes((model,)), _nnx_pair()
  elif case == "garbage":
    data, target = b"\x05", _nnx_pair()
  else:
    data = jmp_scaler.to_bytes((model, opt))
    bigger = nnx.Linear(5, 2, rngs=nnx.Rngs(0))
    target = (bigger, jmp_scaler.NNXOptimizer(bigger, make_tx(), wrt=nnx.Param))
  before = _bits(nnx.state(target))
  with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
    jmp_scaler.from_bytes(target, data)
  assert _bits(nnx.state(target)) == before  # nothing written


@pytest.mark.parametrize("case, fragment", [
    ("shape", "/params/b1: saved ((3,), 'float32'), target ((8,), 'float32')"),
    ("dtype", "/params/b1: saved ((8,), 'float32'), target ((8,), 'float16')"),
    ("empty", "missing /"),
    ("garbage", "not a jmp_scaler.to_bytes checkpoint"),
])
def test_from_bytes_refuses_what_does_not_match_a_pytree_target(case, fragment):
  state = fresh_state()
  target = fresh_state()
  if case == "shape":
    data = jmp_scaler.to_bytes(state.replace(params={**state.params, "b1": jnp.zeros(3)}))
  elif case == "dtype":
    data = jmp_scaler.to_bytes(state)
    target = target.replace(params={**target.params, "b1": jnp.zeros(8, jnp.float16)})
  elif case == "empty":
    data = jmp_scaler.to_bytes({})
  else:
    data = b"\x05"
  with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
    jmp_scaler.from_bytes(target, data)


def test_save_into_an_existing_checkpoint_says_what_to_do(tmp_path):
  state = fresh_state()
  jmp_scaler.save_checkpoint(tmp_path / "c", state)
  with pytest.raises(ValueError, match="already exists.*force=True.*CheckpointManager"):
    jmp_scaler.save_checkpoint(tmp_path / "c", state)
  later = state.replace(step=jnp.asarray(7, jnp.int32))
  jmp_scaler.save_checkpoint(tmp_path / "c", later, force=True)
  assert int(jmp_scaler.restore_checkpoint(tmp_path / "c", fresh_state()).step) == 7
  with pytest.raises(ValueError, match="no checkpoint at"):
    jmp_scaler.restore_checkpoint(tmp_path / "nowhere", fresh_state())


def test_restoring_into_another_optimizer_says_what_to_do(tmp_path):
  jmp_scaler.save_checkpoint(tmp_path / "c", fresh_state())
  other = fresh_state(optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(0.1)))
  with pytest.raises(ValueError, match="layout: unexpected /opt_state/1/0/count.* same optimizer"):
    jmp_scaler.restore_checkpoint(tmp_path / "c", other)


def test_keep_the_last_n_with_a_checkpoint_manager(tmp_path):
  """The documented path (docs/flax.md): Orbax's manager, then check_restored."""
  import orbax.checkpoint as ocp

  state, _ = run(fresh_state(), 0, 3)
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    for step in range(4):
      manager.save(step, args=ocp.args.StandardSave(state.replace(step=jnp.asarray(step))))
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3]
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh_state())
    restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
  restored = jmp_scaler.check_restored(restored, fresh_state())
  assert int(restored.step) == 3 and _bits(restored.opt_state) == _bits(state.opt_state)
  corrupted = _with_scaler(restored, scale=jnp.asarray(-1.0, jnp.float32))
  with pytest.raises(ValueError, match="corrupted"):
    jmp_scaler.check_restored(corrupted, fresh_state())


def _policy_state(spec):
  return fresh_state(optax.chain(jmp_scaler.get_policy(spec).loss_scaler(), optax.adam(1e-2)))


@functools.cache
def _float16_saved():
  """The float16 policy's state after one step of ones, taken by one jitted program
  (eagerly some hundred small compiles), shared by the target policies below."""
  step = lambda s: s.apply_gradients(grads=jax.tree.map(jnp.ones_like, s.params))  # noqa: E731
  return jax.jit(step, compiler_options=FAST)(_policy_state("p=f32,c=f16,o=f32"))


@pytest.mark.parametrize("spec", ["p=f32,c=bf16,o=f32", "f32"])
def test_a_float16_run_resumes_under_another_policy(spec, tmp_path):
  """Every policy's loss_scaler holds a scaler: one layout, a one-argument restore."""
  saved = _float16_saved()
  jmp_scaler.save_checkpoint(tmp_path / "c", saved)
  target = _policy_state(spec)
  with pytest.raises(ValueError, match="on_config_mismatch"):
    jmp_scaler.restore_checkpoint(tmp_path / "c", target)
  resumed = jmp_scaler.restore_checkpoint(tmp_path / "c", target, on_config_mismatch="target")
  assert float(resumed.loss_scale) == 1.0 and int(resumed.step) == 1
  assert _bits(resumed.params) == _bits(saved.params)
  assert _bits(resumed.opt_state[1]) == _bits(saved.opt_state[1])  # Adam's moments and count
  assert int(resumed.scale_metrics()["steps"]) == 1  # the call counter carries over
