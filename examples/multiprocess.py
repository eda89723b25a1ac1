"""Multi-process data parallel training with a loss scaler, on one machine.

Run without ``--process-id`` it is the launcher: it holds a free port on
127.0.0.1 and starts ``--num-processes`` copies of itself, each with
``--local-devices`` virtual CPU devices, and waits for them (bounded by
``--timeout``, killing them if they overrun). Each copy joins the others with
``jax.distributed.initialize`` (gloo collectives on the CPU) and trains an MLP
data parallel under ``jax.jit`` with ``NamedSharding``: the batch is split
over the devices of all processes, the parameters are replicated. At
``--bad-step`` the last process puts an inf into its own part of the batch;
the gradients are global arrays, so every process skips that step and keeps
the same scale. On a real cluster, start one process per host with the
coordinator's address instead of the launcher.

  python examples/multiprocess.py --num-processes 2 --steps 20
"""

import argparse
import os
import signal
import socket
import subprocess
import sys


def parse():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--num-processes", type=int, default=2)
  ap.add_argument("--local-devices", type=int, default=2, help="virtual CPU devices per process")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--bad-step", type=int, default=5, help="step at which one process overflows")
  ap.add_argument("--timeout", type=float, default=900, help="seconds, launcher only")
  ap.add_argument("--process-id", type=int, default=None, help="set by the launcher")
  ap.add_argument("--coordinator", default=None, help="host:port, set by the launcher")
  return ap.parse_args()


def _held_port() -> socket.socket:
  """A 127.0.0.1 port held until the run ends, so no other process takes it in between.

  The coordinator binds with ``SO_REUSEPORT`` and shares it; where that option
  does not exist, the port is closed and handed over (a small race).
  """
  s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  if hasattr(socket, "SO_REUSEPORT"):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
  s.bind(("127.0.0.1", 0))
  if not hasattr(socket, "SO_REUSEPORT"):
    s.close()
  return s


def launch(args):
  held = _held_port()
  coordinator = f"127.0.0.1:{held.getsockname()[1]}"
  procs = [
      subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--process-id", str(i),
                        "--coordinator", coordinator])
      for i in range(args.num_processes)
  ]
  try:
    codes = [p.wait(timeout=args.timeout) for p in procs]
  finally:
    held.close()
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
        p.wait()
  sys.exit(max(codes, key=abs))


def gloo_can_listen():
  """Single-machine demo: gloo listens on the host name's address; exit 77 if it cannot."""
  try:
    with socket.socket() as s:
      s.bind((socket.gethostbyname(socket.gethostname()), 0))
  except OSError as e:
    print(f"gloo cannot listen on the host name's address: {e}", file=sys.stderr)
    sys.exit(77)


def train(args):
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  jax.config.update("jax_num_cpu_devices", args.local_devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  gloo_can_listen()
  bind = {"coordinator_bind_address": args.coordinator}  # loopback only, on the held port
  jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                             initialization_timeout=600, **bind)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jmp_scaler

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  rng = np.random.default_rng(0)  # same seed everywhere: same initial parameters
  params = {"w1": rng.normal(size=(8, 32)) / np.sqrt(8), "w2": rng.normal(size=(32, 1)) / 6}
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  tx = optax.chain(jmp_scaler.dynamic_scale(2.0**12), optax.adam(1e-2))
  state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)
  # Every process holds the whole initial state; each device gets a copy.
  state = jax.tree.map(lambda a: jax.make_array_from_callback(
      a.shape, replicated, lambda idx: np.asarray(a)[idx]), state)

  def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  @jax.jit
  def step(state, x, y):
    # Gradients of loss * scale; the loss comes back unscaled.
    loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  local = lambda a: a.addressable_data(0)  # this process's copy of a replicated value
  per_process = 8 * jax.local_device_count()
  data = np.random.default_rng(1 + args.process_id)  # each process reads its own shard
  for i in range(args.steps):
    x = data.normal(size=(per_process, 8)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    if i == args.bad_step and args.process_id == args.num_processes - 1:
      x[0, 0] = np.inf
    x, y = (jax.make_array_from_process_local_data(batch_sharding, a) for a in (x, y))
    state, loss = step(state, x, y)
    m = jmp_scaler.scale_metrics(state.opt_state)
    print(f"[process {args.process_id}] step {i:3d} loss {float(local(loss)):.4f} "
          f"scale {float(local(m['scale'])):.0f} skipped={bool(local(m['skipped']))}",
          flush=True)
  checksum = sum(float(jnp.sum(jnp.abs(local(a)))) for a in jax.tree.leaves(state.params))
  print(f"[process {args.process_id}] final scale {float(local(state.loss_scale)):.0f} "
        f"step {int(local(state.step))} params checksum {checksum:.6f}", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  parsed = parse()
  if parsed.process_id is None:
    launch(parsed)
  else:
    train(parsed)
