"""Gradient accumulation with a loss scaler: float16 compute, k micro-batches per update.

A small MLP regresses a synthetic target. Each optimizer update averages
``--every-k`` micro-batches; the loss scale is fixed within a window. At
update ``--bad-step`` one micro-batch yields NaN gradients: it is dropped,
the update averages the other micro-batches, and the scale backs off
(``--mode skip_window`` skips that whole update instead).

float16 overflows on its own too: the scale starts at 2^16, too high for
these gradients on purpose (the scaler calibrates by halving), so a
micro-batch of the first window overflows and is dropped like the injected
one. Each line says which micro-batches were dropped and why, and the totals
count the two causes apart.

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
    # Gradients of loss * scale (the scale is fixed within a window); the loss unscaled.
    loss, grads = jmp_scaler.value_and_grad(loss_fn, opt_state)(params, x, y)
    grads = jax.tree.map(lambda g: g * poison, grads)  # poison = NaN injects an overflow
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  print(f"{args.every_k} micro-batches per update; scale: the one the window ran at")
  injected_total, natural = 0, []
  for step in range(args.steps):
    ran_at = jmp_scaler.get_scale(opt_state)
    losses, dropped = [], []
    for micro in range(args.every_k):
      x = rng.normal(size=(args.micro_batch, 8)).astype(np.float32)
      y = (np.tanh(x @ true_w) + 0.01 * rng.normal(size=(args.micro_batch, 1))).astype(np.float32)
      poison = np.float32(np.nan if (step, micro) == (args.bad_step, 1) else 1.0)
      before = opt_state.dropped
      params, opt_state, loss = micro_step(params, opt_state, x, y, poison)
      losses.append(loss)
      dropped.append(opt_state.dropped > before)  # this micro-batch was dropped
    losses, dropped, ran_at, m = jax.device_get(  # one transfer per update
        (losses, dropped, ran_at, jmp_scaler.scale_metrics(opt_state)))
    why = []
    for micro in np.flatnonzero(dropped):
      if (step, micro) == (args.bad_step, 1):
        injected_total += 1
        why.append(f"micro-batch {micro}: the injected NaN")
      else:
        natural.append(step)
        why.append(f"micro-batch {micro}: float16 overflow, not injected")
    if bool(m["skipped"]):
      why.append("update skipped; the scale halves")
    elif why:
      why.append(f"update = mean of the other {args.every_k - len(why)}; the scale halves")
    print(f"update {step:3d}  loss {np.mean(losses):.4f}  scale {float(ran_at):7g}  "
          f"dropped {int(np.sum(dropped))}  skipped {int(m['skipped'])}"
          + (f"  ({'; '.join(why)})" if why else ""))
  dropped = int(opt_state.dropped)
  print(f"dropped micro-batches: {dropped} = {injected_total} injected NaN + "
        f"{dropped - injected_total} float16 overflow(s) at update(s) {natural}")
  if natural and natural[0] == 0:
    print("  update 0 ran at the initial scale, 2^16, chosen too high on purpose: the scaler\n"
          "  calibrates by halving it until the float16 gradients fit (as GradScaler does).")
  skipped = int(jmp_scaler.scale_metrics(opt_state)["total_skips"])
  rule = ("an update is skipped only when all its micro-batches are dropped"
          if args.mode == "drop_micro_batch" else "one dropped micro-batch skips its update")
  print(f"skipped updates: {skipped} (--mode {args.mode}: {rule})")


if __name__ == "__main__":
  main()
