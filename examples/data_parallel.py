"""Data parallel (and FSDP-style) training with a loss scaler under ``jax.jit``.

One process, ``--devices`` devices (virtual CPU devices here; real GPUs or
TPUs need no flag). The batch is split over the devices; the parameters are
replicated, or with ``--fsdp`` split over the devices together with Adam's
moments. ``jax.jit`` partitions the step: the scaler sees global arrays, so
its decision is global, its state stays replicated, and a skip is exact on
every shard. At ``--bad-step`` one example in one device's block of the batch
is inf: every device skips.

  python examples/data_parallel.py --devices 8 --steps 20 [--fsdp]
"""

import argparse
import os


def parse():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--batch-per-device", type=int, default=16)
  ap.add_argument("--bad-step", type=int, default=5, help="step at which one shard overflows")
  ap.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state")
  return ap.parse_args()


def main(args):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jmp_scaler

  n = jax.device_count()
  # Auto axes: the compiler places the all-gathers FSDP needs. (With the default
  # Explicit axes, data parallel works as is; FSDP would reshard params in loss_fn.)
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
  policy = jmp_scaler.get_policy("params=f32,compute=f16,output=f32")
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(16, 8 * n)) / 4, "b1": np.zeros(8 * n),
            "w2": rng.normal(size=(8 * n, 1)) / np.sqrt(8 * n)}
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  tx = optax.chain(jmp_scaler.dynamic_scale(2.0**12), optax.adam(1e-2))
  state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)

  def spec(a):  # FSDP: split every array whose first axis divides evenly; scalars replicated
    return P("data") if args.fsdp and a.ndim and a.shape[0] % n == 0 else P()

  state_sharding = jax.tree.map(lambda a: NamedSharding(mesh, spec(a)), state)
  state = jax.device_put(state, state_sharding)
  batch_sharding = NamedSharding(mesh, P("data"))

  def loss_fn(p, x, y):
    p, x = policy.cast_to_compute((p, x))
    pred = policy.cast_to_output(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])
    return jnp.mean((pred - y) ** 2)

  @jax.jit
  def step(state, x, y):
    # Gradients of loss * scale; the loss comes back unscaled.
    loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params, x, y)
    state = state.apply_gradients(grads=grads)
    # Pin the output layout (the scaler's scalars replicated, FSDP blocks kept).
    return jax.lax.with_sharding_constraint(state, state_sharding), loss

  b = args.batch_per_device * n
  for i in range(args.steps):
    x = rng.normal(size=(b, 16)).astype(np.float32)
    y = np.sin(x[:, :1] * 2).astype(np.float32)
    if i == args.bad_step:
      x[3 * b // n if n > 3 else 0, 0] = np.inf  # an example in device 3's block
    state, loss = step(state, jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding))
    m = jmp_scaler.scale_metrics(state.opt_state)
    print(f"step {i:3d}  loss {float(loss):.4f}  scale {float(m['scale']):7.0f}  "
          f"skipped={bool(m['skipped'])}")
  scale = jmp_scaler.find_scale_state(state.opt_state).scale
  print(f"devices: {n}  applied updates: {int(state.step)}  "
        f"total skips: {int(jmp_scaler.scale_metrics(state.opt_state)['total_skips'])}")
  print(f"scale replicated: {scale.sharding.is_fully_replicated}")
  print(f"Adam mu['w1'] sharding: {state.opt_state[1][0].mu['w1'].sharding.spec}")


if __name__ == "__main__":
  parsed = parse()
  # Must be set before jax is imported: it creates the virtual devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={parsed.devices}")
  main(parsed)
