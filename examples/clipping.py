"""Gradient clipping with a loss scaler: clip after the scaler, never before.

In PyTorch you must call ``scaler.unscale_(optimizer)`` before
``clip_grad_norm_``, or the threshold applies to gradients multiplied by the
scale (pytorch/examples#1196). Here the scaler is the head of an Optax chain
and hands *unscaled* gradients to what follows, so the order of the chain is
the whole story::

  optax.chain(jmp_scaler.dynamic_scale(), optax.clip_by_global_norm(1.0), optax.sgd(lr))

The same float16 model is trained two ways on a regression task whose
targets have heavy-tailed noise (rare, huge gradients):

* ``no clipping``: the outliers' gradients throw the parameters around;
* ``scaler, clip``: clips the true gradients at norm 1 (right).

The third order, ``clip, scaler``, would clip the *scaled* gradients at norm 1
and then divide by the scale: every update 65536 times too small, nothing
learnt, no error. The scaler refuses it when the chain is initialised; the
example prints that refusal.

For each run it prints the final test loss and the median norm of the
gradient the optimizer applied (plain SGD, so ``|update| / lr``) next to the
median norm of the true gradient.

  python examples/clipping.py [--steps 400]
"""

from __future__ import annotations

import argparse

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
    x = nn.tanh(nn.Dense(64)(x))
    x = nn.tanh(nn.Dense(64)(x))
    return nn.Dense(1)(x)[..., 0]


def make_data(n: int, seed: int):
  """``(x, noisy y, clean y)``: y = tanh(2 x.w), plus Student-t noise (df=1.2:
  rare, huge outliers)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  w = np.random.default_rng(123).normal(size=8) / np.sqrt(8)  # the same task for every seed
  y = np.tanh(2 * x @ w)
  noisy = y + 0.1 * rng.standard_t(1.2, size=n)
  return jnp.asarray(x), jnp.asarray(noisy, jnp.float32), jnp.asarray(y, jnp.float32)


def run(tx, params, data, args):
  """Trains with ``tx``; returns the test loss and per-step gradient norms."""
  model = MLP()
  x, y, _ = data["train"]
  state = jmp_scaler.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def mse(p, xb, yb):
    pred = POLICY.cast_to_output(model.apply(POLICY.cast_to_compute(p), POLICY.cast_to_compute(xb)))
    return jnp.mean((pred.astype(jnp.float32) - yb) ** 2)

  @jax.jit
  def step(state, idx):
    # The gradients of mse * scale (the loss itself is not needed here).
    _, grads = jmp_scaler.value_and_grad(mse, state)(state.params, x[idx], y[idx])
    new = state.apply_gradients(grads=grads)
    applied = optax.global_norm(jax.tree.map(jnp.subtract, new.params, state.params)) / args.lr
    true = optax.global_norm(jmp_scaler.unscale(grads, state.loss_scale))
    return new, (applied, true)

  rng = np.random.default_rng(args.seed)
  idx = rng.integers(0, len(y), size=(args.steps, args.batch)).astype(np.int32)
  norms = []
  for i in range(args.steps):
    state, n = step(state, idx[i])
    norms.append(n)
  applied, true = np.asarray(jax.device_get(norms)).T
  xt, _, yt = data["test"]
  return float(jax.jit(mse)(state.params, xt, yt)), applied, true, state


def main(argv=None) -> dict[str, float]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=400, help="train steps per run")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--lr", type=float, default=0.3, help="SGD learning rate")
  p.add_argument("--max-norm", type=float, default=1.0, help="clip_by_global_norm threshold")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")

  data = {"train": make_data(4096, args.seed), "test": make_data(1024, args.seed + 1)}
  params = jax.jit(MLP().init)(jax.random.key(args.seed), data["train"][0][:1])
  clip, sgd = optax.clip_by_global_norm(args.max_norm), optax.sgd(args.lr)
  runs = {
      "no clipping": optax.chain(jmp_scaler.dynamic_scale(), sgd),
      "scaler, clip": optax.chain(jmp_scaler.dynamic_scale(), clip, sgd),
  }
  wrong = optax.chain(clip, jmp_scaler.dynamic_scale(), sgd)
  xt, _, yt = data["test"]
  init_loss = float(jnp.mean((jax.jit(MLP().apply)(params, xt) - yt) ** 2))
  print(f"float16 compute, SGD lr={args.lr}, clip at global norm {args.max_norm}; "
        f"test loss (clean targets) at init {init_loss:.4f}")
  print(f"{'chain':<14} {'test loss':>10} {'median |true grad|':>19} {'median |applied|':>17}"
        f" {'max |applied|':>14} {'skipped':>8}")
  results = {}
  for name, tx in runs.items():
    loss, applied, true, state = run(tx, params, data, args)
    skipped = int(state.scale_metrics()["total_skips"])
    true = true[np.isfinite(true)]  # skipped steps have no true gradient
    print(f"{name:<14} {loss:>10.4g} {np.median(true):>19.4g} {np.median(applied):>17.4g}"
          f" {np.max(applied):>14.4g} {skipped:>8}")
    results[name] = loss
  try:
    wrong.init(params)
  except ValueError as e:
    print(f"{'clip, scaler':<14} refused at init: {str(e).split(', after')[0]}")
  print("Without clipping, outliers' gradients blow the parameters up; float16 then overflows\n"
        "on every step, which the scaler skips. The scaler hands unscaled gradients down the\n"
        "chain, so clip after it; clipped before it, updates would be `scale` times too small.")
  return results


if __name__ == "__main__":
  main()
