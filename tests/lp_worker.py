"""16-bit updates on 8 virtual CPU devices; run by tests/test_low_precision.py.

Run as a script (``python tests/lp_worker.py``): it sets ``XLA_FLAGS`` before
importing jax, plays every scenario and prints one JSON object whose values
the tests assert on. A scenario that raises reports its traceback instead.

Every scenario runs the same few steps of ``jmp_scaler.adamw`` (bfloat16,
stochastic moments) + ``stochastic_round`` on the same bfloat16 parameters
and gradients, on one device, under ``jax.jit`` with the parameters sharded
over 8 and over 4 devices, and inside ``shard_map`` (sharded with
``param_specs``, and replicated as in data parallelism): the parameters and
moments must be bit-identical to the one-device run.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import play  # noqa: E402 - tests/_report.py, beside this script
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jmp_scaler.lowbit._adam16 import adamw  # noqa: E402
from jmp_scaler.lowbit._stochastic import random_bits, step_key, stochastic_round  # noqa: E402

STEPS = 3
SHAPES = {"w": (16, 24), "b": (16,)}
SPECS = {"w": P("d", None), "b": P("d")}


def init_params():
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.normal(size=s), jnp.bfloat16) for k, s in SHAPES.items()}


def grads_of(t):
  rng = np.random.default_rng(100 + t)
  return {k: jnp.asarray(rng.normal(size=s) * 1e-2, jnp.bfloat16) for k, s in SHAPES.items()}


def make_tx(param_specs=None):
  return optax.chain(
      adamw(1e-3, weight_decay=0.1, param_specs=param_specs),
      stochastic_round(seed=7, param_specs=param_specs),
  )


def bits(tree):
  return [np.asarray(x).view(np.uint16).tolist() for x in jax.tree.leaves(tree)]


def moments(opt_state):
  adam = opt_state[0][0]
  return bits((adam.mu, adam.nu)) + [int(adam.count), int(opt_state[1].count)]


def run(step, params, opt_state, put=lambda x: x):
  for t in range(STEPS):
    params, opt_state = step(params, opt_state, put(grads_of(t)))
  return {"params": bits(params), "moments": moments(opt_state)}


def reference():
  tx = make_tx()

  @jax.jit
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = init_params()
  return run(step, params, tx.init(params))


def jit_sharded(n):
  mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
  put = lambda tree: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                                  tree, SPECS)
  tx = make_tx()
  params = put(init_params())
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  out = run(step, params, opt_state, put)
  out["sharded"] = len(params["w"].sharding.device_set)
  return out


def shard_map_sharded(n, specs=True):
  """FSDP-like: each device holds a block of the parameters and of the moments."""
  mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))
  tx = make_tx(param_specs=SPECS if specs else None)
  params = init_params()
  opt_state = tx.init(params)
  state_specs = jax.tree.map(lambda _: P(), opt_state)
  adam_specs = state_specs[0][0]._replace(mu=SPECS, nu=SPECS)
  state_specs = ((adam_specs,) + tuple(state_specs[0][1:]), state_specs[1])

  def local(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(SPECS, state_specs, SPECS),
                               out_specs=(SPECS, state_specs)))
  return run(step, params, opt_state)


def shard_map_replicated(n):
  """Data parallelism: every device holds all parameters; gradients are averaged."""
  mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
  tx = make_tx()
  params = init_params()
  opt_state = tx.init(params)

  def local(params, opt_state, grads):
    grads = jax.lax.pmean(grads, "d")
    updates, opt_state = tx.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    same = jax.lax.pmin(jnp.all(jax.lax.pmax(new["w"], "d") == new["w"]), "d")
    return new, opt_state, same

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P()),
                               out_specs=(P(), P(), P())))
  p, s = params, opt_state
  agree = True
  for t in range(STEPS):
    p, s, same = step(p, s, grads_of(t))
    agree = agree and bool(same)
  return {"params": bits(p), "moments": moments(s), "devices_agree": agree}


def block_bits():
  """The bits each of 8 shards draws for its block, and the global draw."""
  mesh = jax.make_mesh((8,), ("d",))
  key = step_key(7, 0, jnp.int32(0))
  local = jax.jit(jax.shard_map(lambda: random_bits(key, 0, (2, 24), P("d", None)),
                                mesh=mesh, in_specs=(), out_specs=P("d", None)))()
  whole = jax.jit(lambda: random_bits(key, 0, (16, 24)))()
  blocks = np.asarray(local).reshape(8, -1)
  return {"equal_to_global": bool(np.array_equal(np.asarray(local), np.asarray(whole))),
          "distinct_blocks": len({b.tobytes() for b in blocks})}


SCENARIOS = {
    "reference": reference,
    "jit_8": lambda: jit_sharded(8),
    "jit_4": lambda: jit_sharded(4),
    "shard_map_8": lambda: shard_map_sharded(8),
    "shard_map_2": lambda: shard_map_sharded(2),
    "shard_map_8_no_specs": lambda: shard_map_sharded(8, specs=False),  # must differ
    "replicated_8": lambda: shard_map_replicated(8),
    "block_bits": block_bits,
}


def main():
  play(SCENARIOS, {"devices": jax.device_count()})


if __name__ == "__main__":
  main()
