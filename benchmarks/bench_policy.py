"""What skipping non-finite steps costs under the bfloat16 and float32 policies.

``Policy.loss_scaler()`` is ``no_scale()`` for bfloat16 and float32: no scaling,
but a non-finite step is still skipped exactly. This measures that choice
against the same step with no scaler at all (flax's ``TrainState`` and
``optax.adam``), in interleaved rounds in one process; it prints the median of
the per-round ratios. Run: ``python benchmarks/bench_policy.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jmp_scaler


class MLP(nn.Module):
  width: int
  depth: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.relu(nn.Dense(self.width, dtype=self.dtype)(x))
    return nn.Dense(10, dtype=self.dtype)(x)


def make_step(policy: jmp_scaler.Policy, scaled: bool, width: int, depth: int, batch: int):
  model = MLP(width, depth, policy.compute_dtype)
  x = jnp.ones((batch, width), jnp.float32)
  y = jnp.zeros(batch, jnp.int32)
  params = model.init(jax.random.key(0), x)["params"]

  def loss_fn(p):
    logits = policy.cast_to_output(model.apply({"params": p}, policy.cast_to_compute(x)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  if scaled:
    tx = optax.chain(policy.loss_scaler(), optax.adam(1e-3))
    state = jmp_scaler.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state):
      loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params)
      return state.apply_gradients(grads=grads), loss
  else:
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(1e-3))  # fmt: skip

    def step(state):
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss

  return jax.jit(step, donate_argnums=0), state


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny model, few rounds")
  args = parser.parse_args()
  width, depth, batch, rounds, iters = (64, 2, 16, 3, 5) if args.quick else (1024, 4, 128, 15, 10)
  print(f"MLP {depth}x{width}, batch {batch}, Adam; {rounds} interleaved rounds of {iters} steps; "
        f"{jax.device_count()} {jax.default_backend()} device(s)")
  print(f"{'policy':<22} {'no scaler (ms)':>15} {'no_scale (ms)':>14} {'ratio (median)':>15}")
  for spec in ("p=f32,c=bf16,o=f32", "f32"):
    policy = jmp_scaler.get_policy(spec)
    runs = {k: make_step(policy, k, width, depth, batch) for k in (False, True)}
    states = {}
    for k, (step, state) in runs.items():  # compile and warm up
      state, loss = step(state)
      jax.block_until_ready(loss)
      states[k] = state
    times = {False: [], True: []}
    for _ in range(rounds):
      for k, (step, _) in runs.items():
        state = states[k]
        start = time.perf_counter()
        for _ in range(iters):
          state, loss = step(state)
        jax.block_until_ready(loss)
        times[k].append((time.perf_counter() - start) / iters)
        states[k] = state
    ratios = [s / b for b, s in zip(times[False], times[True], strict=True)]
    print(f"{spec:<22} {1e3 * statistics.median(times[False]):>15.2f} "
          f"{1e3 * statistics.median(times[True]):>14.2f} {statistics.median(ratios):>15.3f}")


if __name__ == "__main__":
  main()
