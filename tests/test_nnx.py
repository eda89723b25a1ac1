"""jmp_scaler.NNXOptimizer: the exact skip for Flax NNX, inside nnx.jit."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_scaler
from tests import _xla


class Net(nnx.Module):
  """Linear + LayerNorm + BatchNorm + dropout."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(jax.nn.relu(self.bn(self.ln(self.l1(x))))))


def _bytes(tree):
  """Flat path -> raw bytes of every array (PRNG keys as their key data)."""

  def raw(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x).tobytes()

  return {p: raw(v) for p, v in nnx.to_flat_state(nnx.as_pure(nnx.state(tree)))}


def _data():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 4)), jnp.float32)
  return x, jnp.sin(x.sum(1, keepdims=True))


def key(seed):
  """A PRNG key whose ops compile fast (threefry's take seconds on a busy CPU)."""
  return jax.random.key(seed, impl="unsafe_rbg")


FAST = _xla.compile_options()
GRAPHDEF = nnx.graphdef(nnx.eval_shape(lambda: Net(nnx.Rngs(0, dropout=1))))
_init = jax.jit(
    lambda: nnx.state(Net(nnx.Rngs(key(0), dropout=key(1)))), compiler_options=FAST
)


def build():
  """A fresh model, initialised by one (fast-compiling) jitted program."""
  return nnx.merge(GRAPHDEF, _init())


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


# Shared across tests: the transformation is static in the optimizer's graph
# definition, so sharing it (and the jitted steps) saves compilations.
TX = optax.chain(jmp_scaler.dynamic_scale(8.0, growth_interval=2), optax.adam(1e-2))
TX_SELECT = optax.chain(
    jmp_scaler.dynamic_scale(8.0, growth_interval=2, skip_mode="select"), optax.adam(1e-2)
)
TRACES = []


@nnx.jit(static_argnames=("restore",))
def train_step(model, opt, x, y, bad, restore=False):
  """One step on the scaled loss; ``bad`` turns the gradients into inf."""
  TRACES.append(restore)
  stats = nnx.as_pure(nnx.state(model, nnx.BatchStat)) if restore else None
  scale = opt.loss_scale
  loss, grads = nnx.value_and_grad(lambda m: _loss(m, x, y) * scale)(model)
  grads = jax.tree.map(lambda g: jnp.where(bad, jnp.inf, g), grads)
  opt.update(model, grads, restore_on_skip=stats)
  return loss / scale


def test_overflow_steps_skip_exactly_inside_nnx_jit_with_one_trace():
  model = build()
  opt = jmp_scaler.NNXOptimizer(model, TX, wrt=nnx.Param)
  x, y = _data()
  script = [False, False, True, False, False, True, True, False]
  flags = [jnp.asarray(bad) for bad in script]
  traces = len(TRACES)
  scales, steps, losses = [], [], []
  for bad, flag in zip(script, flags, strict=True):
    before = _bytes((model, opt))
    with jax.transfer_guard("disallow"):  # no host sync inside the step
      losses.append(train_step(model, opt, x, y, flag, restore=True))
    after = _bytes((model, opt))
    changed = {p[1:] for p in before if before[p] != after[p]}
    scaler_paths = {p for p in changed if p[:2] == ("opt_state", 0)}
    if bad:
      # Only the scaler moved (and dropout's RNG counter, used by the forward);
      # the batch statistics were restored.
      assert changed - scaler_paths == {("drop", "rngs", "count")}
    else:
      applied = {("l1", "kernel"), ("opt_state", 1, 0, "mu", "l1", "kernel"), ("bn", "mean")}
      assert applied <= changed
    scales.append(float(opt.loss_scale))
    steps.append(int(opt.step[...]))
  assert len(TRACES) - traces <= 1  # one trace for the whole script (0 if cached)
  assert scales == [8.0, 16.0, 8.0, 8.0, 16.0, 8.0, 4.0, 4.0]
  assert steps == [1, 2, 2, 3, 4, 4, 4, 5]
  assert int(opt.opt_state[1][0].count[...]) == 5  # Adam counted applied steps only
  metrics = opt.scale_metrics()
  assert int(metrics["total_skips"]) == 3 and int(metrics["steps"]) == 8
  assert bool(metrics["skipped"]) is False
  assert all(np.isfinite(float(v)) for v in losses)


@pytest.mark.parametrize(
    "restore, tx", [(True, TX), (False, TX_SELECT)], ids=["restored-cond", "kept-select"]
)
def test_batch_stats_of_a_skipped_step_are_kept_unless_restored(restore, tx):
  x, y = _data()
  model = build()
  opt = jmp_scaler.NNXOptimizer(model, tx, wrt=nnx.Param)
  before = _bytes((model, opt))
  stats = np.asarray(model.bn.mean[...])
  train_step(model, opt, x, y, jnp.asarray(True), restore=restore)
  after = _bytes((model, opt))
  changed = {p[1:] for p in before if before[p] != after[p]}
  others = {p for p in changed if p[:2] != ("opt_state", 0)}
  # The forward pass updated the running statistics; restore_on_skip undoes it.
  # Parameters and Adam's state are bit-identical in both skip modes.
  moved = {("bn", "mean"), ("bn", "var")}
  assert others == {("drop", "rngs", "count")} | (set() if restore else moved)
  assert float(opt.loss_scale) == 4.0 and int(opt.step[...]) == 0
  if restore:
    np.testing.assert_array_equal(model.bn.mean[...], stats)
    # On an applied step the new statistics are kept.
    train_step(model, opt, x, y, jnp.asarray(False), restore=True)
    assert not np.array_equal(model.bn.mean[...], stats)
    assert int(opt.step[...]) == 1


def test_restore_on_skip_rejects_live_variables_and_unknown_paths():
  model = build()
  opt = jmp_scaler.NNXOptimizer(model, TX, wrt=nnx.Param)
  grads = nnx.state(model, nnx.Param)
  with pytest.raises(ValueError, match="nnx.as_pure"):
    opt.update(model, grads, restore_on_skip=nnx.state(model, nnx.BatchStat))
  stranger = {"nothere": {"mean": jnp.zeros(8)}}
  with pytest.raises(ValueError, match="not in the model"):
    opt.update(model, grads, restore_on_skip=stranger)
  assert int(opt.step[...]) == 0


def test_without_scaler_it_is_nnx_optimizer():
  models = [build(), build()]
  with pytest.warns(UserWarning, match="holds no loss scaler"):
    ours = jmp_scaler.NNXOptimizer(models[0], optax.sgd(0.5), wrt=nnx.Param)
  opts = [ours, nnx.Optimizer(models[1], optax.sgd(0.5), wrt=nnx.Param)]
  for model, opt in zip(models, opts, strict=True):
    opt.update(model, nnx.state(model, nnx.Param))  # the parameters as gradients
  assert _bytes(models[0]) == _bytes(models[1]) != _bytes(build())
  assert int(opts[0].step[...]) == 1
  with pytest.raises(ValueError, match="holds no loss scaler"):
    _ = opts[0].loss_scale
  with pytest.raises(ValueError, match="holds no loss scaler"):
    opts[0].scale_metrics()


def test_plain_nnx_optimizer_with_skip_nonfinite_counts_calls():
  """The documented alternative: exact for params and state, but step counts calls."""
  model = build()
  opt = nnx.Optimizer(model, jmp_scaler.skip_nonfinite(TX), wrt=nnx.Param)
  before = _bytes((model, opt))
  grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.inf), nnx.state(model, nnx.Param))
  nnx.jit(lambda m, o, g: o.update(m, g))(model, opt, grads)
  after = _bytes((model, opt))
  changed = {p[1:] for p in before if before[p] != after[p]}
  assert {p for p in changed if p[:2] != ("opt_state", 0)} == {("step",)}
  assert ("opt_state", 0, "scale") in changed
  assert int(opt.step[...]) == 1 and float(jmp_scaler.get_scale(nnx.as_pure(opt.opt_state))) == 4.0
