"""The scaler heads the chain that receives the scaled gradients, or init refuses it; a
TrainState or NNXOptimizer without a scaler warns; the scaler says what it is; and the doc
lines that described the missing-scaler cases say what the code does."""

import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state

import jmp_scaler
from jmp_scaler import dynamic_scale, fixed_scale, no_scale

ROOT = Path(__file__).resolve().parents[1]
PARAMS = {"w": jnp.ones(3)}
AT_HEAD = "The scaler must head the chain"


def _clip():
  return optax.clip_by_global_norm(0.1)


# The seed's clip-before-unscale trap and its relatives: each builds, none fails, all train
# on wrong updates. Each is refused by tx.init, naming the position (or the wrapper) and the fix.
MISPLACED = {
  "clip then scaler (the issue's chain)": (
    lambda: optax.chain(_clip(), dynamic_scale(), optax.sgd(1.0)), "position 1"),
  "NaN filter first": (
    lambda: optax.chain(optax.zero_nans(), dynamic_scale(), optax.sgd(1.0)), "position 1"),
  "after two": (
    lambda: optax.chain(_clip(), optax.scale(1.0), no_scale(), optax.sgd(1.0)), "position 2"),
  "nested: head of an inner chain that is second": (
    lambda: optax.chain(_clip(), optax.chain(dynamic_scale(), optax.sgd(1.0))), "position 1"),
  "named_chain": (
    lambda: optax.named_chain(("clip", _clip()), ("scaler", dynamic_scale())), "'clip'"),
  "inside inject_hyperparams, after a clip": (
    lambda: optax.chain(_clip(), optax.inject_hyperparams(
      lambda learning_rate: optax.chain(dynamic_scale(), optax.sgd(learning_rate)))(0.1)),
    "position 1"),
  "masked": (
    lambda: optax.masked(dynamic_scale(bare=True), {"w": True}), "optax.masked"),
  "one branch of optax.partition": (
    lambda: optax.partition({"a": optax.chain(fixed_scale(8.0), optax.sgd(1.0)),
                             "b": optax.sgd(1.0)}, {"w": "a"}), "optax.partition"),
}

WELL_PLACED = {
  "head": lambda: optax.chain(dynamic_scale(), _clip(), optax.adam(1e-3)),
  "alone": lambda: dynamic_scale(bare=True),
  "head of a nested head": lambda: optax.chain(
    optax.chain(dynamic_scale(), _clip()), optax.adamw(1e-3, mask={"w": True})),
  "named_chain head": lambda: optax.named_chain(("scaler", no_scale()), ("clip", _clip())),
  "inside MultiSteps": lambda: optax.MultiSteps(
    optax.chain(dynamic_scale(), optax.sgd(1.0)), 2).gradient_transformation(),
  "inside inject_hyperparams": lambda: optax.inject_hyperparams(
    lambda learning_rate: optax.chain(dynamic_scale(), optax.sgd(learning_rate)))(0.1),
  "skip_nonfinite": lambda: jmp_scaler.skip_nonfinite(
    optax.chain(dynamic_scale(), _clip(), optax.sgd(1.0))),
  "accumulate_gradients": lambda: jmp_scaler.accumulate_gradients(
    optax.chain(dynamic_scale(), optax.sgd(1.0)), every_k=2),
  "the scaler of a policy": lambda: optax.chain(
    jmp_scaler.get_policy("p=f32,c=f16,o=f32").loss_scaler(), optax.adam(1e-3)),
}


@pytest.mark.parametrize("name", MISPLACED)
def test_a_scaler_that_does_not_head_the_chain_is_refused_at_init(name):
  make, where = MISPLACED[name]
  with pytest.raises(ValueError, match=re.escape(where)) as info:
    make().init(PARAMS)
  fix = "head of the whole chain" if "optax.masked" in str(info.value) else AT_HEAD
  assert fix in str(info.value)


def test_the_refusal_names_what_comes_first_and_holds_under_jit_and_eval_shape():
  tx = optax.chain(optax.scale_by_adam(), dynamic_scale(), optax.sgd(1.0))
  for init in (tx.init, jax.jit(tx.init), lambda p: jax.eval_shape(tx.init, p)):
    with pytest.raises(ValueError, match="position 1 .* after scale_by_adam, which act on the "
                                         "scaled gradients"):
      init(PARAMS)


@pytest.mark.parametrize("name", WELL_PLACED)
def test_a_scaler_at_the_head_is_accepted(name):
  state = WELL_PLACED[name]().init(PARAMS)
  assert jmp_scaler.find_scale_state(state) is not None


@pytest.mark.parametrize("wrapper", ["TrainState", "NNXOptimizer"])
def test_the_wrappers_refuse_a_misplaced_scaler_at_creation(wrapper):
  tx = optax.chain(_clip(), dynamic_scale(), optax.sgd(1.0))
  with pytest.raises(ValueError, match="position 1"):
    if wrapper == "TrainState":
      jmp_scaler.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    else:
      jmp_scaler.NNXOptimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)


def test_the_issues_chain_would_have_clipped_the_scaled_gradients():
  """Why it is refused: built by hand (the scaler's own pieces), the clip-first order moves
  the parameters 65536 times less than the scaler-first order clips to."""
  grads = {"w": jnp.array([3.0, 4.0, 0.0]) * 2.0**16}  # gradients of the loss * 2^16
  right = optax.chain(dynamic_scale(), _clip(), optax.sgd(1.0))
  state = right.init(PARAMS)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # used bare on purpose here
    updates, _ = right.update(grads, state, PARAMS)
  np.testing.assert_allclose(float(jnp.linalg.norm(updates["w"])), 0.1, rtol=1e-6)
  clipped, _ = _clip().update(grads, _clip().init(PARAMS))
  wrong = jmp_scaler.unscale(clipped, jnp.float32(2.0**16))
  np.testing.assert_allclose(float(jnp.linalg.norm(wrong["w"])), 0.1 / 2.0**16, rtol=1e-6)


# --- no scaler at all: the wrappers warn at creation -------------------------------------


def _created(wrapper, tx, dtype=jnp.float32):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if wrapper == "TrainState":
      params = {"w": jnp.ones(3, dtype)}
      made = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)
    else:
      made = jmp_scaler.NNXOptimizer(
        nnx.Linear(2, 2, param_dtype=dtype, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)
  return made, [w for w in caught if "holds no loss scaler" in str(w.message)]


@pytest.mark.parametrize("wrapper", ["TrainState", "NNXOptimizer"])
def test_a_wrapper_without_a_scaler_warns_once_at_creation_from_the_users_line(wrapper):
  _, found = _created(wrapper, optax.adam(1e-3))
  assert len(found) == 1
  assert "jmp_scaler.no_scale()" in str(found[0].message)
  assert Path(found[0].filename).resolve() == Path(__file__).resolve()  # this file's line


@pytest.mark.parametrize("wrapper", ["TrainState", "NNXOptimizer"])
def test_half_precision_parameters_without_a_scaler_are_named(wrapper):
  _, found = _created(wrapper, optax.sgd(1e-3), jnp.float16)
  assert len(found) == 1 and "parameters are float16" in str(found[0].message)


@pytest.mark.parametrize("wrapper", ["TrainState", "NNXOptimizer"])
@pytest.mark.parametrize("scaler", [no_scale, dynamic_scale])
def test_a_wrapper_with_a_scaler_does_not_warn(wrapper, scaler):
  _, found = _created(wrapper, optax.chain(scaler(), optax.adam(1e-3)), jnp.float16)
  assert found == []


def test_the_warning_is_about_a_real_loss_the_nan_reaches_the_parameters():
  """What the warning prevents: the issue's TrainState without a scaler applies a NaN."""
  state, found = _created("TrainState", optax.adam(0.1))
  assert found
  state = state.apply_gradients(grads={"w": jnp.array([jnp.nan, 1.0, 1.0])})
  assert np.isnan(np.asarray(state.params["w"][0]))
  guarded, found = _created("TrainState", optax.chain(no_scale(), optax.adam(0.1)))
  assert not found
  guarded = guarded.apply_gradients(grads={"w": jnp.array([jnp.nan, 1.0, 1.0])})
  np.testing.assert_array_equal(guarded.params["w"], np.ones(3))


def test_flax_own_train_state_is_left_alone():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    flax_train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.adam(1e-3))


# --- the scaler's repr ---------------------------------------------------------------------


def test_the_scaler_prints_its_kind_and_configuration():
  assert repr(dynamic_scale()) == "dynamic_scale(init_scale=65536.0, growth_interval=2000)"
  assert repr(dynamic_scale(1024, growth_interval=10, hysteresis=2, skip_mode="select",
                            bare=True)) == (
    "dynamic_scale(init_scale=1024.0, growth_interval=10, hysteresis=2, skip_mode='select', "
    "bare=True)")
  assert repr(fixed_scale(8)) == "fixed_scale(scale=8.0)"
  assert repr(no_scale()) == "no_scale()" and repr(no_scale(axis_name="i")) == (
    "no_scale(axis_name='i')")
  assert str(jmp_scaler.get_policy("p=f32,c=f16,o=f32").loss_scaler()) == repr(dynamic_scale())
  assert str(jmp_scaler.get_policy("p=f32,c=bf16,o=f32").loss_scaler()) == "no_scale()"
  tx = dynamic_scale(512.0, growth_interval=7)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  assert isinstance(tx, jmp_scaler.LossScaler)
  state = tx.init(PARAMS)  # the repr says what init builds
  assert float(state.scale) == 512.0 and int(state.config.growth_interval) == 7


# --- the doc lines that described the missing-scaler cases ---------------------------------
# Each entry: a sentence the docs (or a docstring) state, and the behaviour it states. The
# sentence must be there (rewording it means revisiting this test) and the behaviour must hold.


def _nnx_without_scaler_reads_no_scale():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = jmp_scaler.NNXOptimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(1.0),
                                  wrt=nnx.Param)
  with pytest.raises(ValueError, match="holds no loss scaler"):
    opt.loss_scale  # noqa: B018


def _value_and_grad_without_scaler_raises():
  opt_state = optax.sgd(1.0).init(PARAMS)
  with pytest.raises(ValueError, match="holds no loss scaler"):
    jmp_scaler.value_and_grad(lambda p: jnp.sum(p["w"]), opt_state)(PARAMS)


def _adam_default_is_optax_bit_for_bit():
  params = {"w": jnp.linspace(-1.0, 1.0, 5)}
  grads = {"w": jnp.linspace(0.3, -2.0, 5)}
  ours, theirs = jmp_scaler.adam(1e-2), optax.adam(1e-2)
  u1, s1 = ours.update(grads, ours.init(params), params)
  u2, _ = theirs.update(grads, theirs.init(params), params)
  np.testing.assert_array_equal(u1["w"], u2["w"])
  assert {x.dtype for x in jax.tree.leaves(s1) if x.ndim} == {jnp.dtype(jnp.float32)}
  sixteen = jmp_scaler.adam(1e-2, state_dtype=jnp.bfloat16).init(params)
  assert {x.dtype for x in jax.tree.leaves(sixteen) if x.ndim} == {jnp.dtype(jnp.bfloat16)}


def _is_enabled_expression():
  def enabled(opt_state):  # the migration table's expression, verbatim
    return (s := jmp_scaler.find_scale_state(opt_state)) is not None and not (
      s.config.min_scale == s.config.max_scale == 1)
  assert not enabled(optax.chain(no_scale(), optax.sgd(1.0)).init(PARAMS))
  assert enabled(optax.chain(dynamic_scale(), optax.sgd(1.0)).init(PARAMS))
  assert enabled(optax.chain(fixed_scale(8.0), optax.sgd(1.0)).init(PARAMS))
  assert not enabled(optax.sgd(1.0).init(PARAMS))


CLAIMS = {
  "docs/flax.md: no scaler in an NNXOptimizer": (
    "docs/flax.md", "nothing decides a skip: the constructor warns, `update` is "
    "`nnx.Optimizer.update` (a NaN gradient is applied), and `loss_scale` raises a "
    "`ValueError`", _nnx_without_scaler_reads_no_scale),
  "value_and_grad's docstring": (
    jmp_scaler.value_and_grad, "Without a scaler in it the call raises a ``ValueError``",
    _value_and_grad_without_scaler_raises),
  "docs/migration.md: adam's default state_dtype": (
    "docs/migration.md", "the default `state_dtype` (float32, or wider for wider parameters) "
    "gives optax's updates bit for bit, `state_dtype=jnp.bfloat16` stores `mu` and `nu` in "
    "bfloat16", _adam_default_is_optax_bit_for_bit),
  "docs/migration.md: is_enabled": (
    "docs/migration.md", "`(s := jmp_scaler.find_scale_state(opt_state)) is not None and not "
    "s.config.min_scale == s.config.max_scale == 1`", _is_enabled_expression),
}

# The sentences these replaced: false when run, they must not come back.
RETRACTED = {
  "docs/flax.md": ["`loss_scale` reads 1"],
  "docs/migration.md": ["(the default) stores `nu` in bfloat16",
                        "| `jmp_scaler.find_scale_state(opt_state) is not None` |"],
  "jmp_scaler/scaling/_grad.py": ["Without a scaler in it the scale is 1"],
  "jmp_scaler/training/_train_state.py": ["it behaves as flax's ``TrainState``"],
  "jmp_scaler/training/_nnx_optimizer.py": ["``update`` is ``nnx.Optimizer``'s.\n"],
}


def _text(where):
  if isinstance(where, str):
    return " ".join((ROOT / where).read_text().split())
  return " ".join(where.__doc__.split())


@pytest.mark.parametrize("claim", CLAIMS)
def test_each_doc_line_about_a_missing_scaler_is_what_the_code_does(claim):
  where, sentence, behaviour = CLAIMS[claim]
  assert " ".join(sentence.split()) in _text(where)
  behaviour()


@pytest.mark.parametrize("path", RETRACTED)
def test_the_false_lines_are_gone(path):
  text = (ROOT / path).read_text()
  for line in RETRACTED[path]:
    assert line not in text
