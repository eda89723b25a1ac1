"""jmp_scaler.value_and_grad, and one train step for every precision policy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jmp_scaler

X_NP = np.asarray(np.random.default_rng(0).normal(size=(8, 4)), np.float32)
X = jnp.asarray(X_NP)
Y = jnp.sin(X.sum(1))


def _poisoned(value):
  """X with X[0, 0] = value, built in numpy (an eager .at[].set compiles a program)."""
  x = X_NP.copy()
  x[0, 0] = value
  return x


def loss_fn(params, x, y):
  pred = jnp.tanh(x @ params["w"]) @ params["v"]
  return jnp.mean((pred[:, 0] - y) ** 2)


def make_params():
  rng = np.random.default_rng(1)
  return {"w": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),
          "v": jnp.asarray(rng.normal(size=(8, 1)), jnp.float32)}  # fmt: skip


@functools.cache  # a TrainState is immutable: the tests share one per policy and scale
def make_state(policy="p=f32,c=f16,o=f32", init_scale=1024.0):
  policy = jmp_scaler.get_policy(policy)
  scaler = policy.loss_scaler(init_scale=init_scale)
  tx = optax.chain(scaler, optax.adam(1e-2))
  create = lambda params: jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)
  return jax.jit(create)(make_params())  # one program (eagerly, one compile per leaf)


def test_loss_is_unscaled_and_gradients_are_scaled():
  state = make_state()
  loss, grads = jax.jit(
      lambda s: jmp_scaler.value_and_grad(loss_fn, s)(s.params, X, Y)
  )(state)
  want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(state.params, X, Y)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(g, w * 1024.0, rtol=1e-4, atol=1e-3)


def test_has_aux_and_argnums():
  state = make_state()

  def f(x, params, y):
    return loss_fn(params, x, y), {"n": x.shape[0]}

  # Each under jit: one program (eagerly, one compile per op); the aux comes back an array.
  (loss, aux), grads = jax.jit(
      jmp_scaler.value_and_grad(f, state.opt_state, argnums=1, has_aux=True))(X, state.params, Y)
  assert aux == {"n": 8}
  np.testing.assert_allclose(loss, jax.jit(loss_fn)(state.params, X, Y), rtol=1e-6)
  assert jax.tree.structure(grads) == jax.tree.structure(state.params)
  _, both = jax.jit(jmp_scaler.value_and_grad(f, state, argnums=(0, 1), has_aux=True))(
      X, state.params, Y)
  assert both[0].shape == X.shape and jax.tree.structure(both[1]) == jax.tree.structure(
      state.params)


def test_a_float16_loss_is_scaled_in_float32():
  """2**16 does not fit in float16: scaling a float16 loss in float16 would give inf."""
  state = make_state(init_scale=2.0**16)
  f16 = lambda p: (loss_fn(p, X, Y) * 1e-3).astype(jnp.float16)  # noqa: E731
  loss, _ = jax.jit(jmp_scaler.value_and_grad(f16, state))(state.params)  # one program
  assert loss.dtype == jnp.float32 and bool(np.isfinite(loss))


def test_bad_arguments_raise_when_built():
  with pytest.raises(ValueError, match="argnums must be an integer"):
    jmp_scaler.value_and_grad(loss_fn, make_state(), argnums=-1)
  with pytest.raises(ValueError, match="has_aux must be a bool"):
    jmp_scaler.value_and_grad(loss_fn, make_state(), has_aux=1)
  with pytest.raises(ValueError, match="scalar loss"):
    jmp_scaler.value_and_grad(lambda p: p["w"], make_state())(make_params())


def test_under_nnx_jit_with_an_nnx_optimizer():
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  tx = optax.chain(jmp_scaler.dynamic_scale(256.0), optax.sgd(0.1))
  optimizer = jmp_scaler.NNXOptimizer(model, tx, wrt=nnx.Param)

  def f(m):
    return jnp.mean((m(X)[:, 0] - Y) ** 2)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = jmp_scaler.value_and_grad(f, optimizer)(model)
    optimizer.update(model, grads)
    return loss, grads

  want_loss, want_grads = nnx.jit(nnx.value_and_grad(f))(model)
  loss, grads = step(model, optimizer)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(
      grads["kernel"][...], want_grads["kernel"][...] * 256.0, rtol=1e-4, atol=1e-3)
  assert int(optimizer.step[...]) == 1 and not bool(optimizer.scale_metrics()["skipped"])


def test_inside_shard_map():
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  state = make_state()

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                     out_specs=(P(), P()))  # fmt: skip
  def grads_of(state, x, y):
    loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params, x, y)
    return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")

  loss, grads = grads_of(state, X, Y)
  want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(state.params, X, Y)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(grads["w"], want_grads["w"] * 1024.0, rtol=1e-4, atol=1e-3)


@jax.jit
def train_step(state, x, y):
  """The README's step: the same code under every policy."""
  loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params, x, y)
  state = state.apply_gradients(grads=grads)
  return state, {"loss": loss, **state.scale_metrics()}


@pytest.mark.parametrize("policy", ["p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32", "f32"])
def test_one_train_step_for_every_policy_with_the_same_metrics(policy):
  state = make_state(policy)
  losses = []
  for i in range(3):
    x = X if i != 1 else _poisoned(np.nan)  # a NaN batch: skipped under every policy
    before = state.params
    state, metrics = train_step(state, x, Y)
    losses.append(float(metrics["loss"]))
    if i == 1:
      assert bool(metrics["skipped"])
      assert all(np.array_equal(a, b) for a, b in zip(
          jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True))
  assert set(metrics) == {"loss", "scale", "skipped", "consecutive_skips", "total_skips",
                          "steps", "growth_tracker"}  # fmt: skip
  assert int(metrics["steps"]) == 3 and int(metrics["total_skips"]) == 1 and int(state.step) == 2
  assert losses[2] < losses[0]


def test_the_documented_batch_stats_subclass_keeps_stats_of_applied_steps_only():
  """docs/flax.md's ``class TrainState(jmp_scaler.TrainState): batch_stats: Any``."""
  from typing import Any

  import flax.linen as nn

  class TrainState(jmp_scaler.TrainState):
    batch_stats: Any

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      x = nn.Dense(8)(x)
      return nn.Dense(1)(nn.BatchNorm(use_running_average=not train)(x))

  model = Net()
  variables = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(X)  # one program
  tx = optax.chain(jmp_scaler.dynamic_scale(64.0), optax.adam(1e-2))
  state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                            batch_stats=variables["batch_stats"], tx=tx)  # fmt: skip

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      out, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x,
                                    train=True, mutable=["batch_stats"])  # fmt: skip
      return jnp.mean((out[:, 0] - y) ** 2), updates

    (loss, updates), grads = jmp_scaler.value_and_grad(loss_fn, state, has_aux=True)(
        state.params)
    return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"]), loss

  applied, _ = train_step(state, X, Y)
  assert int(applied.step) == 1
  assert not np.array_equal(applied.batch_stats["BatchNorm_0"]["mean"],
                            state.batch_stats["BatchNorm_0"]["mean"])  # fmt: skip
  skipped, loss = train_step(applied, _poisoned(np.inf), Y)
  assert int(skipped.step) == 1 and bool(skipped.scale_metrics()["skipped"])
  for a, b in zip(jax.tree.leaves(skipped.batch_stats), jax.tree.leaves(applied.batch_stats),
                  strict=True):  # fmt: skip
    np.testing.assert_array_equal(a, b)
