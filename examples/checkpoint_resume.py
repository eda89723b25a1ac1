"""Stop a float16 run, resume it "tomorrow", and get the same run bit for bit.

A common complaint about loss scalers (metaseq#3, accelerate#4289,
fairseq2#1346): after a restart the scale goes back to its initial value, so
the resumed run overflows and backs off all over again, and it is no longer
the run that was stopped. Here the scaler's state (scale, counters and its
configuration) lives in ``opt_state``, so the checkpoint holds all of it.

The script trains a small linen MLP under ``p=f32,c=f16,o=f32`` (with
``jmp_scaler.autocast_linen``) and ``jmp_scaler.dynamic_scale`` with a short
growth interval, and turns the gradients of a few chosen steps into inf (an
fp16 overflow on demand), so the scale both grows and backs off before and
after the save. The short interval also lets the scale grow until float16
itself overflows: those steps are skipped too, and the table marks them apart
from the injected ones. It runs:

1. the whole run without interruption;
2. the same run stopped at ``--save-at``, saved with
   ``jmp_scaler.save_checkpoint`` (Orbax), then restored into a freshly built
   state with ``jmp_scaler.restore_checkpoint`` and continued;

and checks that the two give bit-identical parameters, optimizer states and
scale histories. ``TrainState.step`` counts *applied* updates, so after 20
steps with one skipped it reads 19; the scaler's ``steps`` metric counts every
step, skipped or not. Finally it shows what happens when the resumed run is built
with a different scaler configuration: a clear error, unless an explicit
``on_config_mismatch`` option says which configuration to use.

  python examples/checkpoint_resume.py --steps 40
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_scaler

POLICY = jmp_scaler.get_policy("p=f32,c=f16,o=f32")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.LayerNorm()(x)  # computed in float32 under the policy
    return nn.Dense(1)(x)


MODEL = MLP()


@jax.jit
def init(key):
  with jmp_scaler.autocast_linen(POLICY):
    return MODEL.init(key, jnp.zeros((1, 8)))["params"]


@functools.cache
def make_tx(growth_interval: int) -> optax.GradientTransformation:
  # One object per configuration: the jitted step is compiled once for it.
  return optax.chain(
      jmp_scaler.dynamic_scale(init_scale=2.0**10, growth_interval=growth_interval),
      optax.clip_by_global_norm(1.0),  # clips true gradients: the scaler unscaled them
      optax.adam(1e-2),
  )


def make_state(growth_interval: int) -> jmp_scaler.TrainState:
  """A freshly initialised train state: what a restarted process builds."""
  return jmp_scaler.TrainState.create(
      apply_fn=MODEL.apply, params=init(jax.random.key(0)), tx=make_tx(growth_interval)
  )


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
  """The batch of a step, a function of the step only (a resumable data order)."""
  rng = np.random.default_rng(step)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  return x, np.sin(x.sum(1, keepdims=True)).astype(np.float32)


@jax.jit
def train_step(state, x, y, overflow):
  def loss_fn(params):
    with jmp_scaler.autocast_linen(POLICY):
      pred = state.apply_fn({"params": params}, x)
    return jnp.mean((pred - y) ** 2)

  # Gradients of loss * scale (in float32); the loss comes back unscaled.
  loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params)
  grads = jax.tree.map(lambda g: jnp.where(overflow, jnp.inf, g), grads)  # fp16 overflow
  new = state.apply_gradients(grads=grads)
  return new, {"loss": loss, "ran_at": state.loss_scale, **new.scale_metrics()}


def run(state, start: int, stop: int, overflow_at: set[int]):
  """Steps ``start`` to ``stop - 1``; one row per step:
  (step, loss, scale the step ran at, applied updates after it, skipped)."""
  history = []
  for step in range(start, stop):
    x, y = batch(step)
    state, m = train_step(state, x, y, step in overflow_at)
    m = jmp_scaler.to_scalars(m)
    history.append((step, m["loss"], m["ran_at"], int(state.step), bool(m["skipped"])))
  return state, history


def note(step: int, scale: float, skipped: bool, overflow_at: set[int]) -> str:
  if not skipped:
    return ""
  if step in overflow_at:
    return "  skipped: injected inf; the scale halves"
  return f"  skipped: float16 overflowed at scale {scale:g} (not injected); the scale halves"


def same_bits(a, b) -> bool:
  return all(
      np.asarray(x).tobytes() == np.asarray(y).tobytes()
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40, help="steps of the whole run")
  parser.add_argument("--save-at", type=int, default=None, help="default: --steps // 2")
  parser.add_argument("--growth-interval", type=int, default=3)
  parser.add_argument("--dir", type=Path, default=None, help="default: a temporary folder")
  args = parser.parse_args(argv)
  if args.steps < 4:
    parser.error(f"--steps must be at least 4, got {args.steps}")
  save_at = args.steps // 2 if args.save_at is None else args.save_at
  if not 0 < save_at < args.steps:
    parser.error(f"--save-at must lie in (0, {args.steps}), got {save_at}")
  # Overflows before and after the save, each followed by room to grow again.
  overflow_at = {save_at // 2, save_at + (args.steps - save_at) // 2}

  final, whole = run(make_state(args.growth_interval), 0, args.steps, overflow_at)

  directory = Path(args.dir or tempfile.mkdtemp()) / f"step_{save_at}"
  stopped, first = run(make_state(args.growth_interval), 0, save_at, overflow_at)
  jmp_scaler.save_checkpoint(directory, stopped, force=True)
  skipped_before = [s for s, *_, skipped in first if skipped]
  print(f"saved after {save_at} steps (steps 0-{save_at - 1}, skipped: "
        f"{', '.join(f'step {s}' for s in skipped_before) or 'none'}), "
        f"scale {float(stopped.loss_scale):g}, to {directory}")
  resumed = jmp_scaler.restore_checkpoint(directory, make_state(args.growth_interval))
  seen = int(resumed.scale_metrics()["steps"])
  print(f"restored: scale {float(resumed.loss_scale):g}, TrainState.step {int(resumed.step)} "
        f"(applied updates: {seen} steps seen minus {seen - int(resumed.step)} skipped)")
  resumed, second = run(resumed, save_at, args.steps, overflow_at)

  print("scale: the loss scale the step ran at; applied: TrainState.step after the step")
  print(f"{'step':>5} {'loss':>10} {'scale':>8} {'applied':>8}")
  for step, loss, scale, applied, skipped in whole:
    sep = "  <- saved after this step" if step == save_at - 1 else ""
    print(f"{step:5d} {loss:10.5f} {scale:8g} {applied:8d}"
          f"{note(step, scale, skipped, overflow_at)}{sep}")
  natural = [s for s, *_, skipped in whole if skipped and s not in overflow_at]
  print(f"skipped steps: injected {sorted(overflow_at)}, float16 overflows {natural}")
  identical = first + second == whole and same_bits(final, resumed)
  print(f"resumed run bit-identical to the uninterrupted one: {identical}")

  try:
    jmp_scaler.restore_checkpoint(directory, make_state(args.growth_interval + 1))
  except ValueError as err:
    print(f"restoring into another configuration: ValueError: {err}")
  forced = jmp_scaler.restore_checkpoint(
      directory, make_state(args.growth_interval + 1), on_config_mismatch="target"
  )
  interval = int(jmp_scaler.find_scale_state(forced.opt_state).config.growth_interval)
  print(f"with on_config_mismatch='target': growth_interval {interval}, "
        f"scale kept at {float(forced.loss_scale):g}")  # fmt: skip
  return 0 if identical else 1


if __name__ == "__main__":
  raise SystemExit(main())
