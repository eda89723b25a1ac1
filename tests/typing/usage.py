"""The README's recipes as a typed program: mypy checks it against jmp_scaler's annotations
(``mypy``, configured in pyproject.toml; .ci/run's type-check step), and it runs
(``python tests/typing/usage.py``), so a signature that lies to a type checker, or a recipe
that stops working, fails CI.

Each function is one recipe: the Flax TrainState step with autocast, NNX, pure Optax, Equinox,
bfloat16's policy, find_nonfinite.
"""

from __future__ import annotations

from typing import Any, assert_type

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jmp_scaler


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def train_state_step() -> dict[str, float]:
  model, x, y = MLP(), jnp.ones((8, 16)), jnp.zeros(8, jnp.int32)
  params = model.init(jax.random.key(0), x)["params"]
  apply16 = jmp_scaler.autocast(model.apply, "p=f32,c=f16,o=f32")
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  state = jmp_scaler.TrainState.create(apply_fn=apply16, params=params, tx=tx)

  @jax.jit
  def train_step(state: jmp_scaler.TrainState, x: jax.Array, y: jax.Array
                 ) -> tuple[jmp_scaler.TrainState, dict[str, Any]]:
    def loss_fn(params: Any) -> jax.Array:
      logits = state.apply_fn({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params)
    state = state.apply_gradients(grads=grads)
    return state, {"loss": loss, **state.scale_metrics()}

  state, metrics = train_step(state, x, y)
  scale: float = float(jmp_scaler.get_scale(state.opt_state))
  assert scale > 0 and int(state.step) in (0, 1)
  return jmp_scaler.to_scalars(metrics)


def bfloat16_policy() -> float:
  policy: jmp_scaler.Policy = jmp_scaler.get_policy("p=f32,c=bf16,o=f32")
  fn = jmp_scaler.autocast(lambda p, x: x @ p["w"], policy)
  tx = optax.chain(policy.loss_scaler(), optax.adam(1e-3))
  state = jmp_scaler.TrainState.create(apply_fn=fn, params={"w": jnp.ones((4, 2))}, tx=tx)
  loss_fn = lambda p: jnp.mean(state.apply_fn(p, jnp.ones((3, 4))) ** 2)
  loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params)
  state = state.apply_gradients(grads=grads)
  return float(jmp_scaler.get_scale(state.opt_state))


def nnx_step() -> dict[str, Any]:
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  jmp_scaler.autocast_nnx(model, "p=f32,c=f16,o=f32")
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3))
  optimizer = jmp_scaler.NNXOptimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model: nnx.Linear, optimizer: jmp_scaler.NNXOptimizer, x: jax.Array
                 ) -> tuple[jax.Array, dict[str, Any]]:
    loss_fn = lambda model: jnp.mean(model(x) ** 2)
    loss, grads = jmp_scaler.value_and_grad(loss_fn, optimizer)(model)
    optimizer.update(model, grads)
    return loss, optimizer.scale_metrics()

  loss, metrics = train_step(model, optimizer, jnp.ones((3, 4)))
  return {"loss": float(loss), **jmp_scaler.to_scalars(metrics)}


def pure_optax_step() -> Any:
  tx = jmp_scaler.skip_nonfinite(optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3)))
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)

  @jax.jit
  def step(params: dict[str, jax.Array], opt_state: Any) -> tuple[dict[str, jax.Array], Any]:
    loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    _, grads = jmp_scaler.value_and_grad(loss_fn, opt_state)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = step(params, opt_state)
  scaler = jmp_scaler.find_scale_state(opt_state)
  assert scaler is not None
  assert_type(scaler, jmp_scaler.LossScaleState)
  return params


def equinox_step() -> float:
  model = eqx.nn.MLP(4, 1, 16, 2, key=jax.random.key(0))
  forward = jmp_scaler.autocast(lambda m, x: jax.vmap(m)(x), "p=f32,c=f16,o=f32")
  tx = jmp_scaler.skip_nonfinite(optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3)))
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def make_step(model: eqx.nn.MLP, opt_state: Any, x: jax.Array, y: jax.Array
                ) -> tuple[eqx.nn.MLP, Any, jax.Array]:
    loss_fn = lambda m, x, y: jnp.mean((forward(m, x) - y) ** 2)
    loss, grads = jmp_scaler.value_and_grad(loss_fn, opt_state)(model, x, y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  model, opt_state, loss = make_step(model, opt_state, jnp.ones((8, 4)), jnp.zeros((8, 1)))
  return float(loss)


def find_the_nan() -> jmp_scaler.NonFiniteOp:
  def loss_fn(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.sum((x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32))

  report = jmp_scaler.find_nonfinite(loss_fn, jnp.full((4, 2), 300.0), jnp.full((3, 4), 60.0))
  assert_type(report, jmp_scaler.NonFiniteOp | None)
  assert report is not None
  phase: str = report.phase
  assert phase == "forward" and report.finite_in_float32
  return report


if __name__ == "__main__":
  print("TrainState step:", train_state_step())
  print("bfloat16 scale:", bfloat16_policy())
  print("NNX step:", nnx_step())
  print("pure optax:", pure_optax_step())
  print("equinox loss:", equinox_step())
  print("find_nonfinite:", find_the_nan())
