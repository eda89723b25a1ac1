"""Multi-device scenarios on 8 virtual CPU devices; run by tests/test_multidevice.py.

Run as a script (``python tests/md_worker.py``): it sets ``XLA_FLAGS`` before
importing jax, plays every scenario and prints one JSON object whose values
the tests assert on. A scenario that raises reports its traceback instead.
"""

import os

# Eight virtual devices; fast compiles (tests/_xla.py): these programs are tiny, and it
# halves the compile time without changing the HLO whose collectives are counted.
from _xla import flags  # noqa: E402 - tests/_xla.py, beside this script

os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {flags()}")
os.environ["JAX_PLATFORMS"] = "cpu"

import collections  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import play  # noqa: E402 - tests/_report.py, beside this script
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_scaler  # noqa: E402

N = 8  # devices
SCALE = 2.0**10
LR = 1e-2
STEPS = 4
BAD = 2  # the step whose gradients overflow on one device
BAD_DEVICE = 3
F32_INF = np.float32(np.inf)


def init_params():
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
  return {"w1": f(16, 32), "b1": jnp.zeros(32, jnp.float32), "w2": f(32, 8)}


def batches():
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(64, 16)).astype(np.float32),
           rng.normal(size=(64, 8)).astype(np.float32)) for _ in range(STEPS)]


def loss_fn(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] - y) ** 2)


def new_state(axis_name=None, skip_mode="auto"):
  scaler = jmp_scaler.dynamic_scale(SCALE, axis_name=axis_name, skip_mode=skip_mode)
  tx = optax.chain(scaler, optax.adam(LR))
  return jmp_scaler.TrainState.create(apply_fn=None, params=init_params(), tx=tx)


def tolist(tree):
  return jax.tree.map(lambda a: np.asarray(a).tolist(), tree)


def rel_diff(a, b):
  """Largest difference between two parameter trees, relative to each leaf's largest value."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def bits_equal(a, b):
  return all(np.array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def shard_values(x):
  """Every device's copy (or block) of ``x``, in device order."""
  shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
  return [np.asarray(s.data) for s in shards]


def copies_identical(x):
  vals = shard_values(x)
  return all(np.array_equal(v.view(np.uint32), vals[0].view(np.uint32)) for v in vals)


@jax.jit
def reference_step(state, x, y, poison):
  s = state.loss_scale
  g = jax.grad(lambda p: loss_fn(p, x, y) * s)(state.params)
  return state.apply_gradients(grads=jax.tree.map(lambda a: a * poison, g))


@functools.cache
def reference(poison_grads):
  """One device, the global batch; at BAD the gradients are poisoned (or the data is)."""
  data = batches()
  step = reference_step
  state, scales = new_state(), []
  for i, (x, y) in enumerate(data):
    if i == BAD and not poison_grads:
      x = x.copy()
      x[BAD_DEVICE * 8, 0] = np.inf
    poison = F32_INF if (i == BAD and poison_grads) else np.float32(1.0)
    state = step(state, x, y, poison)
    scales.append(float(state.loss_scale))
  return state, scales


def collectives(text):
  ops = re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                   r"(?:-start)?\(", text)
  scalar_all_reduces = len(re.findall(
      r"= \(?(?:(?:f32|pred|s32)\[\](?:\{\})?(?:, )?)+\)? all-reduce(?:-start)?\(", text))
  return dict(collections.Counter(ops)), scalar_all_reduces


# --------------------------------------------------------------------------
# jax.jit + NamedSharding: data parallel (Explicit mesh) and FSDP (Auto mesh).


def jit_scenario(fsdp):
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto if fsdp else AxisType.Explicit,))

  def spec(a):
    return P("d") if fsdp and a.ndim and a.shape[0] % N == 0 else P()

  def step(state, x, y):  # also the plain Adam baseline, which has no scaler (scale 1)
    found = jmp_scaler.find_scale_state(state.opt_state)
    s = 1.0 if found is None else found.scale
    g = jax.grad(lambda p: loss_fn(p, x, y) * s)(state.params)
    return state.apply_gradients(grads=g)

  def compiled(state):
    sh = jax.tree.map(lambda a: NamedSharding(mesh, spec(a)), state)
    state = jax.device_put(state, sh)
    fn = jax.jit(step, out_shardings=sh)
    return state, fn

  data_sh = NamedSharding(mesh, P("d"))
  state, fn = compiled(new_state())
  x0, y0 = (jax.device_put(a, data_sh) for a in batches()[0])
  with_scaler = collectives(fn.lower(state, x0, y0).compile().as_text())
  plain = jmp_scaler.TrainState.create(apply_fn=None, params=init_params(), tx=optax.adam(LR))
  plain, plain_fn = compiled(plain)
  baseline = collectives(plain_fn.lower(plain, x0, y0).compile().as_text())

  scales, before_bad, after_bad = [], None, None
  for i, (x, y) in enumerate(batches()):
    if i == BAD:
      x = x.copy()
      x[BAD_DEVICE * 8, 0] = np.inf  # one example in device 3's block of the batch
      before_bad = [shard_values(a) for a in jax.tree.leaves(state.params)]
    state = fn(state, jax.device_put(x, data_sh), jax.device_put(y, data_sh))
    scales.append(float(state.loss_scale))
    if i == BAD:
      after_bad = [shard_values(a) for a in jax.tree.leaves(state.params)]
  ref, ref_scales = reference(poison_grads=False)
  scaler = jmp_scaler.find_scale_state(state.opt_state)
  mu = state.opt_state[1][0].mu
  return {
      "scales": scales,
      "ref_scales": ref_scales,
      "rel_diff": rel_diff(state.params, ref.params),
      "bitwise_equal_to_ref": bits_equal(state.params, ref.params),
      "skip_exact_every_shard": all(
          np.array_equal(b.view(np.uint32), a.view(np.uint32))
          for bs, as_ in zip(before_bad, after_bad, strict=True)
          for b, a in zip(bs, as_, strict=True)),
      "scale_replicated": scaler.scale.sharding.is_fully_replicated,
      "scale_copies_identical": copies_identical(scaler.scale),
      "params_replicated": [a.sharding.is_fully_replicated for a in jax.tree.leaves(state.params)],
      "params_copies_identical": [copies_identical(a) for a in jax.tree.leaves(state.params)
                                  if a.sharding.is_fully_replicated],
      "mu_spec": str(mu["w1"].sharding.spec),
      "step": int(state.step),
      "collectives": with_scaler[0],
      "scalar_all_reduces": with_scaler[1],
      "baseline_collectives": baseline[0],
      "baseline_scalar_all_reduces": baseline[1],
  }


# --------------------------------------------------------------------------
# shard_map, FSDP-style: each device holds a block of params, grads, moments.


def shard_map_setup(axis_name, check=False, skip_mode="auto"):
  mesh = jax.make_mesh((N,), ("d",))
  state = new_state(axis_name, skip_mode)

  def spec(a):
    return P("d") if a.ndim and a.shape[0] % N == 0 else P()

  specs = jax.tree.map(spec, state)  # the scaler's scalars: P(), replicated

  def body(state, x, y, poison):
    full = jax.tree.map(lambda a: jax.lax.all_gather(a, "d", tiled=True), state.params)
    s = state.loss_scale
    g = jax.grad(lambda p: loss_fn(p, x, y) * s)(full)
    g = jax.tree.map(lambda a: jax.lax.psum_scatter(a, "d", tiled=True) / N, g)
    hit = jax.lax.axis_index("d") == BAD_DEVICE
    g = jax.tree.map(lambda a: a * jnp.where(hit, poison, 1.0), g)
    if check:
      jmp_scaler.check_axis_name(g, state.opt_state)
    state = state.apply_gradients(grads=g)
    return state, jmp_scaler.scale_in_sync(state.opt_state, "d")

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("d"), P("d"), P()),
                             out_specs=(specs, P())))
  state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  data_sh = NamedSharding(mesh, P("d"))
  return state, fn, data_sh


def run_shard_map(state, fn, data_sh):
  per_device_scales, in_sync = [], []
  for i, (x, y) in enumerate(batches()):
    poison = F32_INF if i == BAD else np.float32(1.0)
    state, ok = fn(state, jax.device_put(x, data_sh), jax.device_put(y, data_sh), poison)
    per_device_scales.append([float(v.reshape(-1)[0])
                              for v in shard_values(state.opt_state[0].scale)])
    in_sync.append(bool(ok))
  return state, per_device_scales, in_sync


def error_of(thunk):
  try:
    thunk()
  except Exception as e:  # noqa: BLE001 - the message is the result
    return f"{type(e).__name__}: {e}"
  return None


def shard_map_scenario():
  state, scales, in_sync = run_shard_map(*shard_map_setup("d", check=True))
  ref, ref_scales = reference(poison_grads=True)
  # Without axis_name, under lax.cond, the devices drift apart silently: check_vma does not
  # see it, because lax.cond on a varying predicate returns values typed as replicated
  # (jax-ml/jax#40823) ...
  _, drift, drift_in_sync = run_shard_map(*shard_map_setup(None, skip_mode="cond"))
  # ... check_axis_name does, at trace time, in either mode; and a select on a varying
  # decision makes the scaler's state varying, which shard_map refuses for its P() specs.
  named = error_of(lambda: run_shard_map(*shard_map_setup(None, check=True)))
  select = error_of(lambda: run_shard_map(*shard_map_setup(None, skip_mode="select")))
  return {
      "per_device_scales": scales,
      "ref_scales": ref_scales,
      "rel_diff": rel_diff(state.params, ref.params),
      "step": int(state.step),
      "no_axis_check_error": named,
      "no_axis_select_error": select,
      "no_axis_unchecked_scales": drift,
      "in_sync": in_sync,
      "no_axis_in_sync": drift_in_sync,
  }


# --------------------------------------------------------------------------
# shard_map + accumulate_gradients: one device's micro-batch overflows.


def accumulate_scenario():
  """FSDP blocks, 2 micro-batches per update; device 3's micro-batch 1 is inf."""
  mesh = jax.make_mesh((N,), ("d",))
  k = 2

  def make_tx(axis_name):
    return jmp_scaler.accumulate_gradients(
        optax.chain(jmp_scaler.dynamic_scale(SCALE, axis_name=axis_name), optax.adam(LR)), k)

  tx = make_tx("d")
  params = init_params()
  opt_state = tx.init(params)
  spec = lambda a: P("d") if a.ndim and a.shape[0] % N == 0 else P()
  p_specs, o_specs = jax.tree.map(spec, params), jax.tree.map(spec, opt_state)

  def body(params, opt_state, x, y, poison):
    full = jax.tree.map(lambda a: jax.lax.all_gather(a, "d", tiled=True), params)
    s = jmp_scaler.get_scale(opt_state)
    g = jax.grad(lambda p: loss_fn(p, x, y) * s)(full)
    g = jax.tree.map(lambda a: jax.lax.psum_scatter(a, "d", tiled=True) / N, g)
    hit = jax.lax.axis_index("d") == BAD_DEVICE
    g = jax.tree.map(lambda a: a * jnp.where(hit, poison, 1.0), g)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(p_specs, o_specs, P("d"), P("d"), P()),
                             out_specs=(p_specs, o_specs)))
  put = lambda t, sp: jax.device_put(t, jax.tree.map(lambda q: NamedSharding(mesh, q), sp))
  params, opt_state = put(params, p_specs), put(opt_state, o_specs)
  data_sh = NamedSharding(mesh, P("d"))

  ref_tx = make_tx(None)
  ref_params = init_params()
  ref_state = ref_tx.init(ref_params)

  @jax.jit
  def ref_step(params, opt_state, x, y, poison):
    s = jmp_scaler.get_scale(opt_state)
    g = jax.grad(lambda p: loss_fn(p, x, y) * s)(params)
    updates, opt_state = ref_tx.update(jax.tree.map(lambda a: a * poison, g), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  scales = []
  for i, (x, y) in enumerate(batches()):
    poison = F32_INF if i == 1 else np.float32(1.0)
    params, opt_state = fn(params, opt_state, jax.device_put(x, data_sh),
                           jax.device_put(y, data_sh), poison)
    ref_params, ref_state = ref_step(ref_params, ref_state, x, y, poison)
    scales.append([float(v.reshape(-1)[0])
                   for v in shard_values(jmp_scaler.find_scale_state(opt_state).scale)])
  return {
      "per_device_scales": scales,
      "ref_scale": float(jmp_scaler.get_scale(ref_state)),
      "dropped": int(opt_state.dropped),
      "adam_count": int(opt_state.inner_state[1][0].count),
      "rel_diff": rel_diff(params, ref_params),
  }


# --------------------------------------------------------------------------
# pmap: data parallel, gradients averaged with pmean, then one device overflows.


def pmap_scenario(axis_name):
  def body(state, x, y, poison):
    s = state.loss_scale
    g = jax.grad(lambda p: loss_fn(p, x, y) * s)(state.params)
    g = jax.lax.pmean(g, "d")
    hit = jax.lax.axis_index("d") == BAD_DEVICE
    g = jax.tree.map(lambda a: a * jnp.where(hit, poison, 1.0), g)
    state = state.apply_gradients(grads=g)
    return state, jmp_scaler.scale_in_sync(state.opt_state, "d")

  fn = jax.pmap(body, axis_name="d", in_axes=(0, 0, 0, None))
  state = jax.tree.map(lambda a: jnp.stack([a] * N), new_state(axis_name))
  scales, in_sync = [], []
  for i, (x, y) in enumerate(batches()):
    poison = F32_INF if i == BAD else np.float32(1.0)
    state, ok = fn(state, x.reshape(N, 8, 16), y.reshape(N, 8, 8), poison)
    scales.append(np.asarray(state.opt_state[0].scale).tolist())
    in_sync.append(np.asarray(ok).tolist())
  ref, ref_scales = reference(poison_grads=True)
  params = jax.tree.map(lambda a: np.asarray(a), state.params)
  return {
      "per_device_scales": scales,
      "ref_scales": ref_scales,
      "in_sync": in_sync,
      "rel_diff": rel_diff(jax.tree.map(lambda a: a[0], params), ref.params),
      "devices_bitwise_equal": all(
          np.array_equal(a[0].view(np.uint32), a[d].view(np.uint32))
          for a in jax.tree.leaves(params) for d in range(N)),
  }


def axis_name_scenario():
  """The scaler's decision with and without ``axis_name``, four devices, one row each.

  Read by tests/test_scaler.py::test_axis_name_makes_every_device_take_the_same_decision.
  """
  mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
  grads = jax.device_put(jnp.ones((4, 3)).at[2, 1].set(jnp.inf), NamedSharding(mesh, P("d")))

  def run(axis_name):
    tx = jmp_scaler.dynamic_scale(axis_name=axis_name)
    state = tx.init(None)

    def update(g):  # each device sees only its own row
      s = tx.update({"g": g}, state)[1]
      return s.skipped[None], s.scale[None]

    f = jax.shard_map(update, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False)
    return [np.asarray(x).tolist() for x in f(grads)]

  return {"shared": run("d"), "local": run(None)}


def main():
  assert jax.device_count() == N, jax.devices()
  scenarios = {
      "dp": lambda: jit_scenario(fsdp=False),
      "fsdp": lambda: jit_scenario(fsdp=True),
      "shard_map": shard_map_scenario,
      "accumulate": accumulate_scenario,
      "pmap": lambda: pmap_scenario("d"),
      "axis_name": axis_name_scenario,
  }
  play(scenarios)


if __name__ == "__main__":
  main()
