"""autocast on 8 virtual CPU devices; run by tests/test_autocast_multidevice.py.

Run as a script (``python tests/md_autocast_worker.py``): it sets ``XLA_FLAGS`` before
importing jax, plays every scenario and prints one JSON object whose values the tests
assert on. A scenario that raises reports its traceback instead.

* ``grad``: ``jax.grad`` of an autocast loss with ``custom_jvp`` and ``custom_vjp`` ops
  (relu, gelu, softmax, a user's own of each) inside a data-parallel ``shard_map`` step
  with ``check_vma`` on, gradients ``psum``-ed over the data axis; autocast inside the
  step and around it, against the same step on one device and without autocast.
* ``resnet``: a ResNet-style step (convolutions, ``BatchNorm(axis_name="b")``, a residual,
  ``dynamic_scale``, ``jmp_scaler.TrainState``) under ``shard_map`` and under ``pmap``.
"""

import os

from _xla import flags  # noqa: E402 - tests/_xla.py, beside this script

os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {flags()}")
os.environ["JAX_PLATFORMS"] = "cpu"

import re  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import play  # noqa: E402 - tests/_report.py, beside this script
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_scaler  # noqa: E402

N = 8
F16 = "p=f32,c=f16,o=f32"
MESH = jax.make_mesh((N,), ("b",))
_RNG = np.random.default_rng(0)


def rel_diff(a, b):
  """Largest difference between two trees, relative to each leaf's largest value."""
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                   / max(float(np.max(np.abs(np.asarray(y, np.float64)))), 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))  # fmt: skip


def dtypes(tree):
  return sorted({str(x.dtype) for x in jax.tree.leaves(tree)})


# --------------------------------------------------------------------------
# grad inside shard_map, check_vma on


@jax.custom_jvp
def squareplus(x):  # a user's own custom_jvp
  return 0.5 * (x + jnp.sqrt(x * x + 4.0))


squareplus.defjvp(lambda p, t: (squareplus(p[0]), 0.5 * (1 + p[0] / jnp.sqrt(p[0] ** 2 + 4.0))
                                * t[0]))  # fmt: skip


@jax.custom_vjp
def clip_gradient(x):  # a user's own custom_vjp: identity forward, clipped backward
  return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))


def loss(w, x):
  h = clip_gradient(x @ w["a"])
  h = jax.nn.relu(h) + jax.nn.gelu(h) + squareplus(h)
  return jnp.sum(jax.nn.softmax(h @ w["b"]) * jnp.arange(4.0))


def grad_scenario():
  w = {"a": jnp.asarray(_RNG.normal(size=(8, 16)) / 3, jnp.float32),
       "b": jnp.asarray(_RNG.normal(size=(16, 4)) / 4, jnp.float32)}  # fmt: skip
  x = jnp.asarray(_RNG.normal(size=(4 * N, 8)), jnp.float32)
  w = jax.device_put(w, NamedSharding(MESH, P()))
  x = jax.device_put(x, NamedSharding(MESH, P("b")))
  auto = jmp_scaler.autocast(loss, F16)

  def step(fn):
    body = lambda w, x: jax.lax.psum(jax.grad(fn)(w, x), "b")
    return jax.shard_map(body, mesh=MESH, in_specs=(P(), P("b")), out_specs=P(), check_vma=True)

  inside = jax.jit(step(auto))(w, x)  # autocast inside the step
  around = jax.jit(jmp_scaler.autocast(step(loss), F16))(w, x)  # the step inside autocast
  plain = jax.jit(step(loss))(w, x)
  # With check_vma, jax.grad already sums the gradient of the replicated w over "b"; the
  # psum adds the N equal copies: N times the gradient of the whole batch, on one device.
  one_device = jax.tree.map(lambda g: N * g, jax.jit(jax.grad(auto))(
      jax.device_get(w), jax.device_get(x)))  # fmt: skip
  jaxpr = str(jax.make_jaxpr(step(auto))(w, x))
  forward = str(jax.make_jaxpr(auto)(w, x))
  return {
      "inside_vs_one_device": rel_diff(inside, one_device),
      "around_vs_one_device": rel_diff(around, one_device),
      "inside_vs_float32": rel_diff(inside, plain),
      "dtypes": dtypes(inside),
      "finite": all(bool(np.isfinite(g).all()) for g in jax.tree.leaves(inside)),
      "float16_dots": len(re.findall(r"f16\[[\d,]*\](?:\{[^}]*\})? = dot_general", jaxpr)),
      "custom_calls": [n for n in ("custom_jvp_call", "custom_vjp_call") if n in forward],
  }


# --------------------------------------------------------------------------
# a ResNet-style step with BatchNorm over the data axis: shard_map and pmap


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    bn = lambda: nn.BatchNorm(use_running_average=not train, axis_name="b", momentum=0.9)
    h = nn.relu(bn()(nn.Conv(8, (3, 3), use_bias=False)(x)))
    h = bn()(nn.Conv(8, (3, 3), use_bias=False)(h))
    return nn.relu(h + x)


class ResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Conv(8, (3, 3))(x)
    x = Block()(x, train)
    return nn.Dense(4)(x.mean((1, 2)))


class State(jmp_scaler.TrainState):
  batch_stats: Any = None


def resnet_scenario():
  model = ResNet()
  images = jnp.asarray(_RNG.normal(size=(2 * N, 6, 6, 8)), jnp.float32)
  labels = jnp.asarray(_RNG.integers(0, 4, size=2 * N), jnp.int32)
  init = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(images)

  def new_state(apply_fn):
    tx = optax.chain(jmp_scaler.dynamic_scale(2.0**10), optax.sgd(0.1))
    return State.create(apply_fn=apply_fn, params=init["params"], tx=tx,
                        batch_stats=init["batch_stats"])  # fmt: skip

  def body(state, x, y, average):
    def loss_fn(params):
      logits, new = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x,
                                   train=True, mutable=["batch_stats"])  # fmt: skip
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, new["batch_stats"]

    (loss, stats), grads = jmp_scaler.value_and_grad(loss_fn, state, has_aux=True)(state.params)
    grads = average(grads)
    return state.apply_gradients(grads=grads, batch_stats=stats), jax.lax.pmean(loss, "b")

  def run_shard_map(apply_fn):
    # jax.grad has summed the replicated parameters' gradients over "b" (check_vma): / N.
    average = lambda g: jax.tree.map(lambda a: a / N, g)
    step = jax.jit(jax.shard_map(lambda s, x, y: body(s, x, y, average), mesh=MESH,
                                 in_specs=(P(), P("b"), P("b")), out_specs=(P(), P()),
                                 check_vma=True))  # fmt: skip
    state, losses = new_state(apply_fn), []
    x = jax.device_put(images, NamedSharding(MESH, P("b")))
    y = jax.device_put(labels, NamedSharding(MESH, P("b")))
    for _ in range(2):
      state, loss = step(state, x, y)
      losses.append(float(loss))
    return state, losses

  def run_pmap(apply_fn):
    step = jax.pmap(lambda s, x, y: body(s, x, y, lambda g: jax.lax.pmean(g, "b")),
                    axis_name="b")  # fmt: skip
    state = jax.tree.map(lambda a: jnp.stack([a] * N), new_state(apply_fn))
    x, y = images.reshape(N, 2, 6, 6, 8), labels.reshape(N, 2)
    losses = []
    for _ in range(2):
      state, loss = step(state, x, y)
      losses.append(float(loss[0]))
    stats = [np.asarray(a) for a in jax.tree.leaves(state.batch_stats)]
    synced = all(np.array_equal(a[0], a[d]) for a in stats for d in range(N))
    return jax.tree.map(lambda a: a[0], state), losses, synced

  auto = jmp_scaler.autocast(model.apply, F16)
  sm, sm_losses = run_shard_map(auto)
  pm, pm_losses, synced = run_pmap(auto)
  ref, ref_losses = run_shard_map(model.apply)
  return {
      "shard_map_losses": sm_losses, "pmap_losses": pm_losses, "float32_losses": ref_losses,
      "shard_map_vs_pmap": rel_diff(sm.params, pm.params),
      "stats_shard_map_vs_pmap": rel_diff(sm.batch_stats, pm.batch_stats),
      "params_vs_float32": rel_diff(sm.params, ref.params),
      "pmap_batch_stats_synced": synced,
      "dtypes": dtypes((sm.params, sm.batch_stats, pm.params, pm.batch_stats)),
      "steps": [int(sm.step), int(pm.step)],
      "stats_moved": rel_diff(sm.batch_stats, init["batch_stats"]) > 0,
  }  # fmt: skip


def main():
  play({"grad": grad_scenario, "resnet": resnet_scenario})


if __name__ == "__main__":
  main()
