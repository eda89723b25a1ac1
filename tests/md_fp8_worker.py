"""fp8_dot_general on 8 virtual CPU devices; run by tests/test_fp8_multidevice.py.

Run as a script: it sets ``XLA_FLAGS`` before importing jax, plays every
scenario (one fp8 MLP's loss and gradients, the same data everywhere) and
prints one JSON object: for each scenario, the largest difference from the
one-device result, per output. A scenario that raises reports its traceback.

Device 3's block of the batch is 100x larger than the rest, so a scale taken
from one block's amax instead of the whole tensor's changes the result
(``per_shard_control`` measures by how much).
"""

import os

from _xla import compile_options, flags  # noqa: E402 - tests/_xla.py, beside this script

os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {flags()}")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import play  # noqa: E402 - tests/_report.py, beside this script
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_scaler  # noqa: E402

N = 8
DN = (((1,), (0,)), ((), ()))
FAST = compile_options()


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  x[24:32] *= 100.0  # device 3's block holds the batch's amax
  w1 = (rng.normal(size=(16, 32)) / 4).astype(np.float32)
  w2 = (rng.normal(size=(32, 8)) / 6).astype(np.float32)
  return x, {"w1": w1, "w2": w2}


def mlp(p, x, axis=None):
  h = jnp.tanh(jmp_scaler.fp8_dot_general(x, p["w1"], DN))
  y = jmp_scaler.fp8_dot_general(h, p["w2"], DN)
  if axis is not None:  # tensor parallel: w2 holds a block of the output features
    return lax.psum(jnp.sum(jnp.sin(y)), axis)
  return jnp.sum(jnp.sin(y))


value_and_grads = jax.value_and_grad(mlp, argnums=(0, 1))


def plain_mlp(p, x):
  """``mlp`` in plain float32 code: its dots become fp8 by the autocast rule."""
  return jnp.sum(jnp.sin(jnp.tanh(x @ p["w1"]) @ p["w2"]))


# Under "f32" the rule binds fp8_dot_general(x, w, DN, preferred_element_type=float32): the op
# ``mlp`` calls, so the one-device reference is the same.
autocast_mlp = jmp_scaler.autocast(plain_mlp, "f32", rules={"dot_general": "fp8"})
autocast_grads = jax.value_and_grad(autocast_mlp, argnums=(0, 1))


def flat(out):
  """``[loss, dw1, dw2, dx]`` as NumPy arrays."""
  loss, (gp, gx) = out
  return [np.asarray(a) for a in (loss, gp["w1"], gp["w2"], gx)]


def diffs(out, ref):
  return [float(np.max(np.abs(a - b))) for a, b in zip(flat(out), flat(ref), strict=True)]


def reference():
  x, p = data()
  return jax.jit(value_and_grads, compiler_options=FAST)(p, x)


def jit_auto(ref):
  x, p = data()
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto,))
  xs = jax.device_put(x, NamedSharding(mesh, P("d")))
  ps = jax.device_put(p, NamedSharding(mesh, P()))
  return {"diffs": diffs(jax.jit(value_and_grads, compiler_options=FAST)(ps, xs), ref)}


def jit_explicit(ref):
  x, p = data()
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    xs, ps = jax.device_put(x, P("d")), jax.device_put(p, P())
    out = jax.jit(value_and_grads, compiler_options=FAST)(ps, xs)
    # out_sharding, as under explicit sharding: the result lands where it is asked to.
    y = jax.jit(lambda x, w: jmp_scaler.fp8_dot_general(x, w, DN, out_sharding=P(None, "d")),
                compiler_options=FAST)(xs, jax.device_put(p["w2"][:16], P()))
  return {"diffs": diffs(out, ref), "out_spec": str(y.sharding.spec)}


def shard_map_dp(ref, check_vma):
  x, p = data()
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto,))

  def body(p, x):
    loss, (gp, gx) = value_and_grads(p, x)
    if not check_vma:  # JAX does not sum a replicated weight's gradient for us
      gp = jax.tree.map(lambda g: lax.psum(g, "d"), gp)
    return lax.psum(loss, "d"), (gp, gx)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), (P(), P("d"))),
                     check_vma=check_vma)
  return {"diffs": diffs(jax.jit(fn, compiler_options=FAST)(p, x), ref)}


def shard_map_2d(ref):
  """Data parallel along "d" and tensor parallel along "m" (w2's output features)."""
  x, p = data()
  mesh = jax.make_mesh((4, 2), ("d", "m"), axis_types=(AxisType.Auto,) * 2)

  def body(p, x):
    loss, (gp, gx) = jax.value_and_grad(lambda p, x: mlp(p, x, "m"), argnums=(0, 1))(p, x)
    return lax.psum(loss, "d"), (gp, gx)

  specs = {"w1": P(), "w2": P(None, "m")}
  fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("d")),
                     out_specs=(P(), (specs, P("d"))))
  return {"diffs": diffs(jax.jit(fn, compiler_options=FAST)(p, x), ref)}


def autocast_one_device(ref):
  x, p = data()
  return {"diffs": diffs(jax.jit(autocast_grads, compiler_options=FAST)(p, x), ref)}


def autocast_jit_auto(ref):
  x, p = data()
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto,))
  xs = jax.device_put(x, NamedSharding(mesh, P("d")))
  ps = jax.device_put(p, NamedSharding(mesh, P()))
  return {"diffs": diffs(jax.jit(autocast_grads, compiler_options=FAST)(ps, xs), ref)}


def autocast_in_shard_map(ref):
  """The autocast loss inside a data-parallel shard_map (check_vma on)."""
  x, p = data()
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto,))

  def body(p, x):
    loss, grads = autocast_grads(p, x)
    return lax.psum(loss, "d"), grads

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), (P(), P("d"))))
  return {"diffs": diffs(jax.jit(fn, compiler_options=FAST)(p, x), ref)}


def shard_map_in_autocast(ref):
  """A shard_map inside the function autocast transforms: the rule runs in its body."""
  x, p = data()
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto,))
  sharded = jax.shard_map(lambda p, x: lax.psum(plain_mlp(p, x), "d"), mesh=mesh,
                          in_specs=(P(), P("d")), out_specs=P())
  loss = jmp_scaler.autocast(sharded, "f32", rules={"dot_general": "fp8"})
  fn = jax.value_and_grad(loss, argnums=(0, 1))
  return {"diffs": diffs(jax.jit(fn, compiler_options=FAST)(p, x), ref)}


def unreduced():
  """A partial sum (unreduced along "d", explicit sharding) is refused, not scaled."""
  x, p = data()
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    xs, w = jax.device_put(x, P(None, "d")), jax.device_put(p["w1"], P("d", None))
    partial = lambda x, w: jnp.dot(x, w, out_sharding=P(None, None, unreduced={"d"}))
    f = jax.jit(lambda x, w, w2: jmp_scaler.fp8_dot_general(partial(x, w), w2, DN))
    try:
      f(xs, w, jax.device_put(p["w2"], P()))
    except ValueError as e:
      return {"refused": str(e)}
  return {"refused": None}


def per_shard_control(ref):
  """What a scale from each block's own amax gives (Megatron-LM PR#442's bug)."""
  x, p = data()
  f = jax.jit(lambda x, w: jmp_scaler.fp8_dot_general(x, w, DN), compiler_options=FAST)
  whole = np.asarray(f(x, p["w1"])).reshape(N, 8, -1)
  blocks = np.stack([np.asarray(f(x[i * 8:(i + 1) * 8], p["w1"])) for i in range(N)])
  # Each block's largest difference, relative to the block's own largest value.
  rel = np.max(np.abs(blocks - whole), axis=(1, 2)) / np.max(np.abs(whole), axis=(1, 2))
  return {"block_rel_diffs": rel.tolist()}


def nvfp4_shard_map():
  """NVFP4's tensor scale inside shard_map is the whole batch's (device 3 holds its amax), so
  the forward of a batch-sharded dot equals the one-device forward bit for bit; the control
  quantises each block with its own amax and differs."""
  from jmp_scaler.lowbit._block import nv_tensor_scale

  x, p = data()
  recipe = jmp_scaler.Nvfp4Recipe(stochastic_rounding=False)
  dot = lambda x, w: jmp_scaler.block_scaled_dot_general(x, w, DN, recipe=recipe)  # noqa: E731
  mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Auto,))
  scales = jax.jit(jax.shard_map(lambda x: nv_tensor_scale(x)[None], mesh=mesh,
                                 in_specs=P("d"), out_specs=P("d")))(x)  # fmt: skip
  sharded = jax.jit(jax.shard_map(lambda x, w: dot(x, w), mesh=mesh, in_specs=(P("d"), P()),
                                  out_specs=P("d")))(x, p["w1"])  # fmt: skip
  one = jax.jit(dot)(x, p["w1"])
  local = np.concatenate([np.asarray(jax.jit(dot)(b, p["w1"])) for b in np.split(x, N)])
  return {"scales": [float(s) for s in np.asarray(scales)],
          "whole": float(jax.jit(nv_tensor_scale)(x)),
          "sharded_vs_one": float(np.max(np.abs(np.asarray(sharded) - np.asarray(one)))),
          "local_vs_one": float(np.max(np.abs(local - np.asarray(one))))}


def main():
  assert jax.device_count() == N, jax.devices()
  ref = reference()
  scenarios = {
      "jit_auto": lambda: jit_auto(ref),
      "jit_explicit": lambda: jit_explicit(ref),
      "shard_map": lambda: shard_map_dp(ref, check_vma=True),
      "shard_map_no_check_vma": lambda: shard_map_dp(ref, check_vma=False),
      "shard_map_2d": lambda: shard_map_2d(ref),
      "per_shard_control": lambda: per_shard_control(ref),
      "unreduced": unreduced,
      "autocast_one_device": lambda: autocast_one_device(ref),
      "autocast_jit_auto": lambda: autocast_jit_auto(ref),
      "autocast_in_shard_map": lambda: autocast_in_shard_map(ref),
      "shard_map_in_autocast": lambda: shard_map_in_autocast(ref),
      "nvfp4_shard_map": nvfp4_shard_map,
  }
  play(scenarios, {"ref_max": [float(np.max(np.abs(a))) for a in flat(ref)]})


if __name__ == "__main__":
  main()
