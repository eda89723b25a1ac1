"""Gradient accumulation with a loss scaler: float16 compute, k micro-batches per update.

A small MLP regresses a synthetic target. Each optimizer update averages
``--every-k`` micro-batches; the loss scale is fixed within a window. At
update ``--bad-step`` one micro-batch yields NaN gradients: it is dropped,
the update averages the other micro-batches, and the scale backs off
(``--mode skip_window`` skips that whole update instead).

  python examples/accumulation.py --steps 20 --every-k 4
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_scaler


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=50, help="optimizer updates (windows)")
  ap.add_argument("--every-k", type=int, default=4, help="micro-batches per update")
  ap.add_argument("--micro-batch", type=int, default=16, help="examples per micro-batch")
  ap.add_argument("--bad-step", type=int, default=1, help="update with a NaN micro-batch")
  ap.add_argument("--mode", default="drop_micro_batch",
                  choices=["drop_micro_batch", "skip_window"])
  args = ap.parse_args()

  policy = jmp_scaler.get_policy("params=f32,compute=f16,output=f32")
  rng = np.random.default_rng(0)
  params = {
      "w1": jnp.asarray(rng.normal(size=(8, 32)) / np.sqrt(8), jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(32, 1)) / np.sqrt(32), jnp.float32),
  }
  true_w = rng.normal(size=(8, 1))

  def loss_fn(p, x, y):
    p, x = policy.cast_to_compute((p, x))
    pred = policy.cast_to_output(jnp.tanh(x @ p["w1"]) @ p["w2"])
    return jnp.mean((pred - y) ** 2)

  tx = jmp_scaler.accumulate_gradients(
      optax.chain(policy.loss_scaler(), optax.adam(1e-2)),
      args.every_k,
      on_nonfinite=args.mode,
  )
  opt_state = tx.init(params)

  @jax.jit
  def micro_step(params, opt_state, x, y, poison):
    scale = jmp_scaler.get_scale(opt_state)
    loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x, y) * scale)(params)
    grads = jax.tree.map(lambda g: g * poison, grads)  # poison = NaN injects an overflow
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss / scale

  for step in range(args.steps):
    losses = []
    for micro in range(args.every_k):
      x = rng.normal(size=(args.micro_batch, 8)).astype(np.float32)
      y = (np.tanh(x @ true_w) + 0.01 * rng.normal(size=(args.micro_batch, 1))).astype(np.float32)
      poison = np.float32(np.nan if (step, micro) == (args.bad_step, 1) else 1.0)
      params, opt_state, loss = micro_step(params, opt_state, x, y, poison)
      losses.append(loss)
    m = jmp_scaler.scale_metrics(opt_state)
    print(f"update {step:3d}  loss {float(np.nanmean(np.asarray(losses))):.4f}  "
          f"scale {float(m['scale']):9.1f}  skipped {bool(m['skipped'])}")
  print(f"dropped micro-batches: {int(opt_state.dropped)}")
  print(f"skipped updates: {int(jmp_scaler.scale_metrics(opt_state)['total_skips'])}")


if __name__ == "__main__":
  main()
