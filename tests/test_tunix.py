"""Float16 GRPO in google-tunix with ``jmp_scaler.tunix`` (issue 46): tunix's own trainer,
rollout and checkpoints on a tiny random Qwen3 of tunix's zoo (2 layers, d=64, vocab 48).

The tests at the top need no tunix (the helpers' checks, the optimizer and the repaired
``MultiSteps`` in pure Optax, and that ``import jmp_scaler`` never imports tunix); the others
are skipped, saying so, where google-tunix is not installed (``pip install -e '.[tunix]'``).
The GRPO runs are made once per module (float16 with checkpoints, bfloat16, the float16 run
resumed) and read by several tests; about a minute on a 2-core CPU.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_scaler
from jmp_scaler import tunix as jmp_tunix
from jmp_scaler.tunix import _accumulation, _optimizer, _train_step
from tests import _tunix as T
from tests._tunix import CharTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
F16, BF16 = "p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32"
STEP = {_optimizer.TRAIN_STEP_KEY: True}  # what the installed step hands the optimizer


def _host(tree):
  """Copies of the array leaves (a CPU array's numpy view would follow a donated buffer)."""
  return [np.array(x, copy=True) for x in jax.tree.leaves(tree)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)


def _adam(opt_state):
  """Adam's count, moments: what a skipped step must leave bit-identical."""
  return _host([optax.tree.get(opt_state, k) for k in ("count", "mu", "nu")])


# ---------------------------------------------------------------- no tunix needed


def test_importing_jmp_scaler_and_its_tunix_wing_does_not_import_tunix():
  child = textwrap.dedent("""
    import sys, optax
    import jmp_scaler
    from jmp_scaler import tunix as jmp_tunix
    jmp_tunix.optimizer("p=f32,c=f16,o=f32", optax.adamw(1e-3))
    print(sorted(m for m in sys.modules if m == "tunix" or m.startswith("tunix.")))
  """)
  out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       check=True).stdout  # fmt: skip
  assert out.strip() == "[]", out


def test_every_public_name_has_a_docstring_and_an_api_entry():
  api = (ROOT / "docs" / "api" / "tunix.md").read_text()
  guide = (ROOT / "docs" / "tunix.md").read_text()
  assert sorted(jmp_tunix.__all__) == list(jmp_tunix.__all__)
  for name in jmp_tunix.__all__:
    doc = getattr(jmp_tunix, name).__doc__
    assert doc and "Args:" in doc and "Raises:" in doc, name
    assert f".. autofunction:: jmp_scaler.tunix.{name}\n" in api, name
    assert f"jmp_tunix.{name}" in guide, name


@pytest.mark.parametrize("policy,scale", [(F16, 65536.0), (BF16, 1.0)])
def test_optimizer_puts_the_policy_s_scaler_ahead_and_skips_exactly(policy, scale):
  tx = jmp_tunix.optimizer(policy, optax.adamw(0.1))
  params = {"w": jnp.arange(1.0, 4.0)}
  state = tx.init(params)
  assert float(jmp_scaler.get_scale(state)) == scale

  @jax.jit
  def step(params, state, g):
    scaled = jax.tree.map(lambda x: x * jmp_scaler.get_scale(state), g)
    updates, state = tx.update(scaled, state, params, **STEP)
    return optax.apply_updates(params, updates), state

  params, state = step(params, state, {"w": jnp.ones(3)})
  before, adam = _host(params), _adam(state)
  params, state = step(params, state, {"w": jnp.array([1.0, jnp.inf, 1.0])})
  _assert_same(_host(params), before)
  _assert_same(_adam(state), adam)
  metrics = jmp_scaler.to_scalars(jmp_scaler.scale_metrics(state))
  assert (metrics["total_skips"], metrics["steps"]) == (1, 2)
  assert metrics["scale"] == (scale / 2 if scale > 1 else 1.0)
  with pytest.raises(ValueError, match="install_train_step"):  # tunix's own (unscaled) step
    tx.update(params, state, params)


def test_wrong_uses_raise_naming_the_argument():
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match=r"jmp_tunix.optimizer: policy='p=f32,c=f17'"):
    jmp_tunix.optimizer("p=f32,c=f17", sgd)
  with pytest.raises(ValueError, match="jmp_tunix.optimizer: tx must be an optax"):
    jmp_tunix.optimizer(F16, "adamw")
  with pytest.raises(ValueError, match="tx already holds a loss scaler"):
    jmp_tunix.optimizer(F16, optax.chain(jmp_scaler.dynamic_scale(), sgd))
  with pytest.raises(ValueError, match="jmp_tunix.optimizer: growth_interval"):
    jmp_tunix.optimizer(BF16, sgd, growth_interval=0)  # validated under every policy
  with pytest.raises(ValueError, match=r"jmp_tunix.rollout_engine: policy='fp16'"):
    jmp_tunix.rollout_engine("fp16")
  with pytest.raises(ValueError, match="cache_dtype=bfloat16 must be float32 or the policy's "
                                       "compute dtype, float16"):
    jmp_tunix.rollout_engine(F16, cache_dtype="bfloat16")
  with pytest.raises(ValueError, match="cache_dtype='bytes' is not a dtype"):
    jmp_tunix.rollout_engine(F16, cache_dtype="bytes")
  with pytest.raises(ValueError, match=r"jmp_tunix.policy_loss: policy=None"):
    jmp_tunix.policy_loss(None)
  with pytest.raises(ValueError, match="base must be a loss name"):
    jmp_tunix.policy_loss(F16, base="")


def _windows(tx, windows):
  """Runs ``tx`` (a MultiSteps over jmp_tunix.optimizer) over micro-batch gradients, scaled
  by the scale of the moment; the parameters and the state after each window."""
  params = {"w": jnp.arange(1.0, 4.0)}
  state = tx.init(params)
  scaled = lambda g, s: jax.tree.map(lambda x: x * jmp_scaler.get_scale(s), g)  # noqa: E731
  step = jax.jit(lambda p, s, g: tx.update(scaled(g, s), s, p, **STEP))
  after = []
  for window in windows:
    for g in window:
      updates, state = step(params, state, {"w": jnp.asarray(g, jnp.float32)})
      params = optax.apply_updates(params, updates)
    after.append((_host(params), _adam(state), jmp_scaler.to_scalars(
        jmp_scaler.scale_metrics(state))))
  return after, state


def test_repaired_multisteps_skips_an_overflowing_window_exactly_and_recovers():
  ok, bad = [1.0, -2.0, 0.5], [1.0, np.inf, 0.5]
  windows = [[ok, ok], [ok, bad], [ok, ok]]
  inner = lambda: jmp_tunix.optimizer(F16, optax.adam(0.1))  # noqa: E731
  repaired = _accumulation.repair_multisteps(optax.MultiSteps(inner(), 2))
  params = {"w": jnp.zeros(3)}  # the state layout tunix's checkpoints hold is MultiSteps's
  assert jax.tree.structure(repaired.init(params)) == jax.tree.structure(
      optax.MultiSteps(inner(), 2).init(params))
  after, state = _windows(repaired, windows)
  (p1, adam1, m1), (p2, adam2, m2), (p3, adam3, m3) = after
  _assert_same(p2, p1)  # the window with the overflow: no parameter moved, Adam untouched
  _assert_same(adam2, adam1)
  assert (m1["total_skips"], m2["total_skips"], m3["total_skips"]) == (0, 1, 1)
  assert m2["scale"] == m1["scale"] / 2 == m3["scale"]
  assert not np.array_equal(p3[0], p2[0]) and np.isfinite(p3[0]).all()  # the next one applies
  assert all(np.all(np.asarray(a) == 0) for a in jax.tree.leaves(state.acc_grads))
  # The control: optax's MultiSteps keeps 0 * inf = NaN in its accumulator, so every later
  # window is skipped too.
  after, _ = _windows(optax.MultiSteps(inner(), 2), windows)
  assert [m["total_skips"] for _, _, m in after] == [0, 1, 2]


# ---------------------------------------------------------------- tunix


@pytest.fixture(scope="module")
def tunix():
  pytest.importorskip("tunix", reason="google-tunix is not installed: pip install -e '.[tunix]'")
  from tunix.generate import sampler
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl import algo_core, rl_cluster
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout
  from tunix.sft import peft_trainer

  return types.SimpleNamespace(sampler=sampler, qwen3=qwen3, algo_core=algo_core,
                               rl_cluster=rl_cluster, grpo_learner=grpo_learner,
                               base_rollout=base_rollout, peft_trainer=peft_trainer)


PROMPTS = [f"{a}+{b}=" for a in range(8) for b in range(4)]
BATCH, GEN = 4, 8  # prompts per step (two completions each), tokens per completion


def _qwen3(tunix, dtype=jnp.float32):
  return T.qwen3(tunix.qwen3, dtype)


def _reward(prompts, completions, **kwargs):
  return [float(c[:1].isdigit()) for c in completions]


def _grpo(tunix, policy, steps, checkpoints=None):
  """GRPO with the four helpers for ``steps`` steps (``steps`` counts a resumed run's too)."""
  rl = tunix.rl_cluster
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  config = rl.ClusterConfig(
      role_to_mesh={r: mesh for r in (rl.Role.ACTOR, rl.Role.REFERENCE, rl.Role.ROLLOUT)},
      rollout_engine=jmp_tunix.rollout_engine(policy),
      training_config=rl.RLTrainingConfig(
          actor_optimizer=jmp_tunix.optimizer(policy, optax.adamw(1e-3), growth_interval=1),
          eval_every_n_steps=100, max_steps=steps, checkpoint_root_directory=checkpoints),
      rollout_config=tunix.base_rollout.RolloutConfig(
          max_tokens_to_generate=GEN, max_prompt_length=8, kv_cache_size=32, temperature=1.0,
          top_p=1.0, top_k=None, return_logprobs=True))
  cluster = rl.RLCluster(actor=_qwen3(tunix), tokenizer=CharTokenizer(), cluster_config=config)
  trainer = jmp_tunix.install_train_step(cluster.actor_trainer)
  learner = tunix.grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[_reward],
      algo_config=tunix.grpo_learner.GRPOConfig(
          num_generations=2, num_iterations=1, beta=0.0, epsilon=0.2,
          policy_loss_fn=jmp_tunix.policy_loss(policy)))
  run = types.SimpleNamespace(cluster=cluster, trainer=trainer, learner=learner, examples=[],
                              restored=trainer.train_steps,
                              start=jmp_scaler.to_scalars(jmp_scaler.scale_metrics(
                                  trainer.optimizer)), params=_host(nnx.state(trainer.model)))
  prepare = trainer._prepare_inputs

  def record(example):  # the micro-batches tunix hands the step, and the weights before it
    run.examples.append(example)
    return prepare(example)

  trainer._prepare_inputs = record
  # A NumPy array of prompts (tunix repeats each per generation with np.repeat; a list would not).
  learner.train([{"prompts": np.array(PROMPTS[i * BATCH:(i + 1) * BATCH])} for i in range(steps)])
  history = lambda n: list(trainer.metrics_logger.get_metric_history("actor", n, "train"))  # noqa: E731
  run.loss, run.grad_norm = history("loss"), history("grad_norm")
  run.metrics = jmp_scaler.to_scalars(jmp_scaler.scale_metrics(trainer.optimizer))
  run.final = _host(nnx.state(trainer.model))
  return run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tunix_checkpoints"))


@pytest.fixture(scope="module")
def f16(tunix, checkpoints):
  return _grpo(tunix, F16, 2, checkpoints)


@pytest.fixture(scope="module")
def bf16(tunix):
  return _grpo(tunix, BF16, 2)


def test_grpo_float16_trains_with_no_skip_and_the_scale_in_tunix_s_optimizer_state(f16):
  assert f16.trainer.train_steps == 2 and len(f16.examples) == 2
  # growth_interval=1: the scale doubles after each finite step, none skipped.
  assert f16.start["scale"] == 65536.0
  assert {k: f16.metrics[k] for k in ("scale", "steps", "total_skips")} == {
      "scale": 262144.0, "steps": 2, "total_skips": 0}
  # The scaler's state is tunix's optimizer state, what its checkpoints save.
  saved = nnx.state(f16.trainer.optimizer, nnx.optimizer.OptState)
  assert float(jmp_scaler.find_scale_state(saved).scale) == 262144.0
  # tunix logged the loss and the grad_norm unscaled (scaled by 2**16 they would be ~1e5).
  assert np.isfinite(f16.loss).all() and np.abs(f16.loss).max() < 1.0
  assert np.isfinite(f16.grad_norm).all() and 0 < max(f16.grad_norm) < 1e3
  assert not np.array_equal(f16.final[0], f16.params[0]) or any(
      not np.array_equal(a, b) for a, b in zip(f16.final, f16.params, strict=True))


def test_the_logged_grad_norm_is_the_norm_of_the_true_gradients(tunix, f16):
  # The first step's gradients again, in float32, unscaled, with tunix's own GRPO loss on the
  # weights the step started from: the float16 step's grad_norm is their norm.
  model = _qwen3(tunix)
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), f16.params))
  learner, example = f16.learner, f16.examples[0]

  @nnx.jit
  def true_grads(model, example):
    loss = lambda m: tunix.algo_core.grpo_loss_fn(m, example, learner.algo_config, 0, 2)[0]  # noqa: E731
    return nnx.grad(loss)(model)

  true_norm = float(np.sqrt(sum(np.sum(np.square(g)) for g in _host(true_grads(model, example)))))
  assert f16.grad_norm[0] == pytest.approx(true_norm, rel=5e-3), (f16.grad_norm[0], true_norm)


def test_an_overflow_skips_the_grpo_step_exactly(f16):
  trainer, (example, _) = f16.trainer, f16.examples
  step, _ = trainer.jit_train_and_eval_step()  # tunix's jitted step: the installed one
  params, adam = _host(nnx.state(trainer.model)), _adam(nnx.as_pure(trainer.optimizer.opt_state))
  before = jmp_scaler.to_scalars(jmp_scaler.scale_metrics(trainer.optimizer))
  huge = example.replace(advantages=example.advantages * 1e9)  # -> inf in the float16 backward
  loss, aux, grad_norm = step(huge)
  after = jmp_scaler.to_scalars(jmp_scaler.scale_metrics(trainer.optimizer))
  assert after["total_skips"] == before["total_skips"] + 1 and after["skipped"]
  assert after["scale"] == before["scale"] / 2 and float(aux["loss_scale"]) == after["scale"]
  assert not np.isfinite(float(grad_norm)) and np.isfinite(float(loss))
  _assert_same(_host(nnx.state(trainer.model)), params)
  _assert_same(_adam(nnx.as_pure(trainer.optimizer.opt_state)), adam)
  loss, aux, grad_norm = step(example)  # the same micro-batch as it was: applied
  assert jmp_scaler.to_scalars(jmp_scaler.scale_metrics(trainer.optimizer))["total_skips"] == \
      after["total_skips"] and np.isfinite(float(grad_norm))  # fmt: skip
  assert any(not np.array_equal(a, b) for a, b in zip(_host(nnx.state(trainer.model)), params,
                                                      strict=True))  # fmt: skip


def test_bfloat16_runs_through_the_same_helpers_without_a_scale(bf16):
  assert bf16.trainer.train_steps == 2
  assert bf16.metrics["scale"] == 1.0 and bf16.metrics["total_skips"] == 0  # no_scale()
  assert np.isfinite(bf16.loss).all() and 0 < max(bf16.grad_norm) < 1e3
  assert bf16.learner.algo_config.policy_loss_fn == "grpo@p=f32,c=bf16,o=f32"


def _parity(cluster, prompts):
  """The sampler's log-probabilities of the tokens it draws against the full-sequence forward's
  (tunix's compute_per_token_logps, what the GRPO loss runs), under the same policy and in
  float32 (tunix's own rollout method, not under autocast)."""
  out = cluster.generate(prompts=prompts)
  tokens = np.zeros((len(prompts), GEN), np.int32)
  sampled, mask = np.zeros((len(prompts), GEN), np.float32), np.zeros((len(prompts), GEN), bool)
  for i, (t, lp) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
    t = np.asarray(t)
    n = int(np.argmax(t == 0)) if (t == 0).any() else len(t)  # a sampled pad ends it
    tokens[i, :n], sampled[i, :n], mask[i, :n] = t[:n], np.asarray(lp)[:n], True
  args = (jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(tokens))
  vanilla = type(cluster.rollout).__mro__[1]  # tunix's VanillaRollout
  same = cluster.rollout.get_per_token_logps(*args)
  float32 = vanilla.get_per_token_logps(cluster.rollout, *args)
  sampled, mask = jnp.asarray(sampled), jnp.asarray(mask)
  return (out, jmp_scaler.logprob_parity(sampled, same, mask).to_dict(""),
          jmp_scaler.logprob_parity(sampled, float32, mask).to_dict(""))


@pytest.mark.slow
def test_several_autocast_samplers_and_trainers_in_one_process_each_under_its_policy(f16, bf16):
  # Both runs' samplers and trainers are alive in this process; each samples again.
  prompts = PROMPTS[:BATCH] * 2  # the shapes GRPO compiled the samplers for
  first, f16_same, f16_float32 = _parity(f16.cluster, prompts)
  _, bf16_same, bf16_float32 = _parity(bf16.cluster, prompts)
  again, _, _ = _parity(f16.cluster, prompts)
  assert [list(t) for t in again.tokens] == [list(t) for t in first.tokens]  # seeded, the same
  # Each sampler computes under its own policy: against a float32 forward, bfloat16's 8-bit
  # mantissa is several times further off than float16's 11 bits ...
  assert f16_float32["tokens"] > 30 and f16_float32["mean_abs_dlogp"] > 1e-6
  assert bf16_float32["mean_abs_dlogp"] > 4 * f16_float32["mean_abs_dlogp"], (
      bf16_float32, f16_float32)
  # ... and against the trainer's forward under the same policy, each is within its rounding.
  assert f16_same["mean_abs_dlogp"] < 1e-3 and f16_same["outside_1%"] == 0, f16_same
  assert bf16_same["mean_abs_dlogp"] < 1e-2, bf16_same


@pytest.mark.slow
def test_a_resumed_run_restores_the_scale_from_tunix_s_checkpoint(tunix, f16, checkpoints):
  resumed = _grpo(tunix, F16, 3, checkpoints)
  assert resumed.restored == 2 and resumed.start["scale"] == f16.metrics["scale"] == 262144.0
  assert resumed.start["steps"] == 2
  _assert_same(resumed.params, f16.final)
  # ... and trains on from there: one more step, its scale doubled again.
  assert resumed.trainer.train_steps == 3 and len(resumed.examples) == 1
  assert resumed.metrics["scale"] == 524288.0 and resumed.metrics["total_skips"] == 0


# ---------------------------------------------------------------- any tunix trainer


def _sft(tunix, tx, install, k=None):
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  config = tunix.peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=3,
                                             gradient_accumulation_steps=k)
  trainer = tunix.peft_trainer.PeftTrainer(model, tx, config).with_loss_fn(
      lambda model, x, y: jnp.mean((model(x) - y) ** 2))
  return jmp_tunix.install_train_step(trainer) if install else trainer


def _batches(n, bad=()):
  rng = np.random.default_rng(0)
  out = [{"x": rng.normal(size=(8, 4)).astype(np.float32),
          "y": rng.normal(size=(8, 3)).astype(np.float32)} for _ in range(n)]
  for i in bad:
    out[i]["x"][0, 0] = 1e30  # the loss overflows float32: inf gradients
  return out


def test_an_installed_sft_step_takes_the_true_gradients_and_logs_them_unscaled(tunix):
  stock = _sft(tunix, optax.adamw(1e-2), install=False)
  scaled = _sft(tunix, jmp_tunix.optimizer(F16, optax.adamw(1e-2)), install=True)
  for trainer in (stock, scaled):
    trainer.train(_batches(3))
  log = lambda t, n: t.metrics_logger.get_metric_history("", n, "train")  # noqa: E731
  for name in ("loss", "grad_norm"):
    np.testing.assert_allclose(log(scaled, name), log(stock, name), rtol=1e-6)
  np.testing.assert_allclose(scaled.model.kernel[...], stock.model.kernel[...], rtol=1e-6)
  assert float(jmp_scaler.get_scale(scaled.optimizer)) == 65536.0


def test_an_overflowing_micro_batch_skips_its_window_exactly_under_tunix_accumulation(tunix):
  trainer = _sft(tunix, jmp_tunix.optimizer(F16, optax.adamw(1e-2)), install=True, k=2)
  assert isinstance(trainer.optimizer.tx, optax.GradientTransformationExtraArgs)  # repaired
  step, _ = trainer.jit_train_and_eval_step()
  snapshots = []
  for batch in _batches(6, bad=[3]):  # windows: [0, 1], [2, 3 overflows], [4, 5]
    loss, _, grad_norm = step(batch)
    opt_state = nnx.as_pure(trainer.optimizer.opt_state)
    snapshots.append((_host(nnx.state(trainer.model)), _adam(opt_state), jmp_scaler.to_scalars(
        jmp_scaler.scale_metrics(opt_state)), _host(opt_state.acc_grads)))
  (p1, adam1, m1, _), (p2, adam2, m2, acc2), (p3, _, m3, _) = snapshots[1::2]
  _assert_same(p2, p1)
  _assert_same(adam2, adam1)
  assert [m["total_skips"] for m in (m1, m2, m3)] == [0, 1, 1]
  assert m2["scale"] == m1["scale"] / 2
  assert all(np.all(a == 0) for a in acc2)  # the next window starts from zeros
  assert any(not np.array_equal(a, b) for a, b in zip(p3, p2, strict=True))


def test_install_train_step_refuses_wrong_uses(tunix):
  with pytest.raises(ValueError, match="trainer must be a tunix trainer"):
    jmp_tunix.install_train_step(object())
  with pytest.raises(ValueError, match="holds no loss scaler.*jmp_tunix.optimizer"):
    _sft(tunix, optax.adamw(1e-2), install=True)
  trainer = _sft(tunix, jmp_tunix.optimizer(F16, optax.adamw(1e-2)), install=True)
  assert isinstance(trainer.create_train_step_fn, _train_step.InstalledStep)
  with pytest.raises(ValueError, match="already runs jmp_tunix's train step"):
    jmp_tunix.install_train_step(trainer)

  class OwnStep(tunix.peft_trainer.PeftTrainer):
    def _train_step(self, model, optimizer, inputs):
      raise NotImplementedError

  own = OwnStep(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jmp_tunix.optimizer(F16, optax.sgd(0.1)),
                tunix.peft_trainer.TrainingConfig(eval_every_n_steps=1))
  with pytest.raises(ValueError, match="OwnStep replaces tunix's _train_step"):
    jmp_tunix.install_train_step(own)


def test_policy_loss_registers_once_and_refuses_what_tunix_does_not_know(tunix):
  from tunix.rl import function_registry

  name = jmp_tunix.policy_loss(F16)
  assert name == "grpo@p=f32,c=f16,o=f32" == jmp_tunix.policy_loss(jmp_scaler.get_policy(F16))
  assert function_registry.get_policy_loss_fn(name) is not None
  assert jmp_tunix.policy_loss(F16, base="ppo") == "ppo@p=f32,c=f16,o=f32"
  with pytest.raises(ValueError, match="base='nope' is not a policy loss registered.*grpo"):
    jmp_tunix.policy_loss(F16, base="nope")
  with pytest.raises(ValueError, match="is a loss this function registered"):
    jmp_tunix.policy_loss(BF16, base=name)


def test_the_rollout_refuses_a_model_whose_kv_cache_is_not_float32(tunix):
  engine = jmp_tunix.rollout_engine(F16)
  config = tunix.base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=4,
                                            kv_cache_size=16)
  rollout = engine(rollout_actor=_qwen3(tunix), tokenizer=CharTokenizer(), mesh=None,
                   rollout_config=config)
  assert rollout.jmp_policy == jmp_scaler.get_policy(F16)
  with pytest.raises(ValueError, match=r"KV cache in the rollout model's dtype, bfloat16"):
    engine(rollout_actor=_qwen3(tunix, jnp.bfloat16), tokenizer=CharTokenizer(), mesh=None,
           rollout_config=config)


HEAD = {("dot_general", r"(^|/)einsum/BTD,DV->BTV$"): "float32"}  # tunix's untied head


def _dot_dtypes(jaxpr):
  """The input dtypes of every dot_general in ``jaxpr`` and its bodies, in order."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(str(eqn.invars[0].aval.dtype))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out += _dot_dtypes(getattr(sub, "jaxpr", sub))
  return out


def test_rules_reach_the_sampler_and_the_loss_a_float32_head_in_both(tunix):
  engine = jmp_tunix.rollout_engine(F16, rules=HEAD)
  config = tunix.base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=4,
                                            kv_cache_size=16)
  rollout = engine(rollout_actor=_qwen3(tunix), tokenizer=CharTokenizer(), mesh=None,
                   rollout_config=config)
  tokens = jnp.ones((2, 6), jnp.int32)
  logps = jax.make_jaxpr(rollout.get_per_token_logps)(tokens[:, :3], tokens[:, 3:])
  dots = _dot_dtypes(logps.jaxpr)
  assert dots.count("float32") == 1 and dots[-1] == "float32" and "float16" in dots  # the head
  name = jmp_tunix.policy_loss(F16, rules=HEAD)
  assert name.startswith("grpo@p=f32,c=f16,o=f32+rules:") and name != jmp_tunix.policy_loss(F16)
  assert jmp_tunix.policy_loss(F16, rules=dict(HEAD)) == name  # the same rules, the same loss
  with pytest.raises(ValueError, match="jmp_tunix.rollout_engine: rules names an unknown "
                                       "primitive 'tanhh'"):
    jmp_tunix.rollout_engine(F16, rules={"tanhh": "float32"})


def test_a_float16_kv_cache_samples_finite_log_probabilities_from_left_padded_prompts(tunix):
  """A model configured in float16 (float32 master weights) keeps its KV cache in float16 from
  step to step; tunix's K_MASK, -inf in float16, is saturated, so a left-padded prompt's fully
  masked rows are not NaN; the log-probabilities are the float32 cache's to float16's rounding."""
  config = tunix.base_rollout.RolloutConfig(
      max_tokens_to_generate=GEN, max_prompt_length=8, kv_cache_size=32, temperature=1.0,
      top_p=1.0, top_k=None, return_logprobs=True)
  prompts = ["1+2=", "3+4+5+6=", "7="]  # of three lengths: the shorter ones are left-padded
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  runs = {}
  for dtype in (jnp.float32, jnp.float16):
    engine = jmp_tunix.rollout_engine(F16, cache_dtype=dtype)
    rollout = engine(rollout_actor=_qwen3(tunix, dtype), tokenizer=CharTokenizer(), mesh=None,
                     rollout_config=config)
    with jax.set_mesh(mesh):
      runs[dtype] = rollout.generate(prompts, config)
    assert np.dtype(rollout._sampler.dtype) == dtype
  assert tunix.qwen3.K_MASK == -65504.0
  half, full = runs[jnp.float16], runs[jnp.float32]
  assert [list(t) for t in half.tokens] == [list(t) for t in full.tokens]
  for h, f in zip(half.logprobs, full.logprobs, strict=True):
    assert np.isfinite(np.asarray(h)).all()
    np.testing.assert_allclose(np.asarray(h), np.asarray(f), atol=5e-3)
