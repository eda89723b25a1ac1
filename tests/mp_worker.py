"""One process of the multi-process test (tests/test_multiprocess.py).

Each process owns 2 virtual CPU devices of a 4-device global mesh, joins the
others through ``jax.distributed.initialize`` (the coordinator on the
127.0.0.1 port the test holds for it; gloo collectives on the address of the
host's name, as jaxlib chooses) and trains data parallel, FSDP-style (each
device holds a block of the parameters, gradients and Adam moments) under
``jax.shard_map`` with ``dynamic_scale(axis_name="d")``. At ``--bad-step``
the process ``--bad-process`` multiplies its local gradient blocks by inf.
Writes the scale history and final parameters to ``--out``.
"""

import argparse
import json
import socket
import sys

import jax
import jax.numpy as jnp
import numpy as np

LOCAL_DEVICES = 2
EXIT_SKIP = 77  # the test skips: loopback-only collectives are not available here
SCALE = 2.0**10
LR = 1e-2
GLOBAL_BATCH = 32


def init_params():
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
  return {"w1": f(16, 32), "b1": jnp.zeros(32, jnp.float32), "w2": f(32, 8)}


def batches(steps):
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(GLOBAL_BATCH, 16)).astype(np.float32),
           rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32)) for _ in range(steps)]


def loss_fn(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] - y) ** 2)


# Under load (two suites on two cores) a process can wait minutes for its peer:
# every rendezvous timeout is wide; the test bounds the whole run instead.
INIT_TIMEOUT_S = 600
HEARTBEAT_TIMEOUT_S = 600


def _gloo_can_listen():
  """Exits with EXIT_SKIP unless this host's name resolves to an address it can bind.

  jaxlib's gloo transport listens on that address (no public API picks
  another), as ``gloo::transport::tcp::CreateDefaultDevice`` does.
  """
  try:
    address = socket.gethostbyname(socket.gethostname())
    with socket.socket() as s:
      s.bind((address, 0))
  except OSError as e:
    print(f"gloo cannot listen on the host name's address: {e}", file=sys.stderr)
    sys.exit(EXIT_SKIP)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--process-id", type=int, required=True)
  ap.add_argument("--num-processes", type=int, default=2)
  ap.add_argument("--port", type=int, required=True)
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--bad-step", type=int, default=2)
  ap.add_argument("--bad-process", type=int, default=1)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_cpu_get_local_topology_timeout_minutes", 10)
  jax.config.update("jax_cpu_get_global_topology_timeout_minutes", 15)
  _gloo_can_listen()
  address = f"127.0.0.1:{args.port}"
  jax.distributed.initialize(
      coordinator_address=address,
      num_processes=args.num_processes,
      process_id=args.process_id,
      initialization_timeout=INIT_TIMEOUT_S,
      coordinator_bind_address=address,  # loopback only, the port the test holds
      heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
  )
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jmp_scaler

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",))
  tx = optax.chain(jmp_scaler.dynamic_scale(SCALE, axis_name="d"), optax.adam(LR))
  state = jmp_scaler.TrainState.create(apply_fn=None, params=init_params(), tx=tx)
  # FSDP-style: parameters and Adam's moments in blocks over the 4 devices of both
  # processes; the scaler's scalars replicated. Every process builds the same host
  # state and hands each of its devices its block.
  specs = jax.tree.map(lambda a: P("d") if a.ndim and a.shape[0] % n == 0 else P(), state)
  to_global = lambda a, spec: jax.make_array_from_callback(
      a.shape, NamedSharding(mesh, spec), lambda idx: np.asarray(a)[idx])
  state = jax.tree.map(to_global, state, specs)

  def body(state, x, y, poison):
    full = jax.tree.map(lambda a: jax.lax.all_gather(a, "d", tiled=True), state.params)
    s = state.loss_scale
    g = jax.grad(lambda p: loss_fn(p, x, y) * s)(full)
    g = jax.tree.map(lambda a: jax.lax.psum_scatter(a, "d", tiled=True) / n, g)
    g = jax.tree.map(lambda a: a * poison[0], g)  # one process poisons its own blocks
    jmp_scaler.check_axis_name(g, state.opt_state)
    state = state.apply_gradients(grads=g)
    return state, jmp_scaler.scale_in_sync(state.opt_state, "d")

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("d"), P("d"), P("d")),
                               out_specs=(specs, P())))
  by_device = NamedSharding(mesh, P("d"))
  local = lambda a: a.addressable_data(0)
  per_process = GLOBAL_BATCH // args.num_processes
  rows = slice(args.process_id * per_process, (args.process_id + 1) * per_process)
  scales, skipped, in_sync = [], [], []
  for i, (x, y) in enumerate(batches(args.steps)):
    bad = i == args.bad_step and args.process_id == args.bad_process
    poison = np.full(LOCAL_DEVICES, np.inf if bad else 1.0, np.float32)
    x, y, poison = (jax.make_array_from_process_local_data(by_device, a)
                    for a in (x[rows], y[rows], poison))
    state, ok = step(state, x, y, poison)
    m = jmp_scaler.scale_metrics(state.opt_state)
    scales.append(float(local(m["scale"])))
    skipped.append(bool(local(m["skipped"])))
    in_sync.append(bool(local(ok)))
  # Gather the parameter blocks of both processes onto every device.
  params = jax.jit(lambda p: p, out_shardings=NamedSharding(mesh, P()))(state.params)
  result = {
      "process_id": jax.process_index(),
      "devices": n,
      "local_devices": jax.local_device_count(),
      "scales": scales,
      "skipped": skipped,
      "in_sync": in_sync,
      "step": int(local(state.step)),
      "params": jax.tree.map(lambda a: np.asarray(local(a)).tolist(), params),
  }
  with open(args.out, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
