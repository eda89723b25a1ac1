"""A debugging session: float16 training goes NaN; find the culprit, fix it.

The injected bug is a classic of tabular data: one feature, ``price``, is
left in raw units (tens of thousands). float32 does not mind; float16's
largest finite value is 65504. The session follows the article's habits:

1. symptom: float16 + ``dynamic_scale`` skips every step; ``ScaleMonitor``
   warns that the scale collapses;
2. control: a fixed scale of 1 (``fixed_scale(1.0)``) still skips every
   step, so no loss scale can help: something overflows on its own;
3. ``find_nonfinite(loss_fn, params, x, y, policy, scale=...)``, one call on
   one batch: the first inf is made by the cast of the inputs to float16 on
   ``loss_fn``'s line, in the forward pass, in the ``price`` column, and
   float32 would have been finite: float16's range, not a bug;
4. the per-leaf reports confirm it: ``nonfinite_report(grads)`` (every
   gradient leaf is NaN: the forward pass is broken), ``nonfinite_report`` of
   the float16 inputs and of each layer's output (flax's
   ``capture_intermediates``), and ``underflow_report`` of the float32 inputs,
   which names the feature that cannot be represented. Its advice names a
   *loss* scale, which multiplies the gradients and never the inputs: for an
   input, read it as the factor the data itself must shrink by, which step 2
   showed no loss scale can do;
5. fix: standardise the features (in float32, before the cast), retrain, and
   compare with the float32 baseline.

  python examples/debugging.py [--steps 300]
"""

from __future__ import annotations

import argparse
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_scaler

FEATURES = ("age", "rooms", "distance", "floor", "area", "rating", "noise", "price")
F32 = jmp_scaler.get_policy("f32")
FP16 = jmp_scaler.get_policy("p=f32,c=f16,o=f32")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(2)(x)


def make_data(n: int, seed: int):
  """Seven standardised features and a raw ``price`` (median 30000, long tail)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, len(FEATURES))).astype(np.float32)
  logit = x[:, :7] @ np.linspace(-1.0, 1.0, 7) + 1.5 * x[:, 7]
  x[:, 7] = np.exp(10.3 + 0.6 * x[:, 7])  # the bug: price in raw units
  return jnp.asarray(x), jnp.asarray(logit > 0, jnp.int32)


def loss_fn(params, x, y, policy):
  logits = policy.cast_to_output(MLP().apply(policy.cast_to_compute(params),
                                             policy.cast_to_compute(x)))
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def train(scaler, policy, params, data, args, label):
  """Trains; returns the state and the mean loss of the last 10% of steps."""
  x, y = data
  tx = optax.chain(scaler, optax.adam(args.lr))
  state = jmp_scaler.TrainState.create(apply_fn=MLP().apply, params=params, tx=tx)
  monitor = jmp_scaler.ScaleMonitor.for_state(state.opt_state, window=args.window)

  @jax.jit
  def step(state, idx):
    # Gradients of loss * scale (in float32); the loss comes back unscaled.
    loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params, x[idx], y[idx], policy)
    state = state.apply_gradients(grads=grads)
    return state, {"loss": loss, **state.scale_metrics()}

  rng = np.random.default_rng(args.seed)
  idx = rng.integers(0, len(y), size=(args.steps, args.batch)).astype(np.int32)
  metrics = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", jmp_scaler.ScaleWarning)
    for i in range(args.steps):
      state, m = step(state, idx[i])
      metrics.append(m)
      if (i + 1) % args.window == 0 or i + 1 == args.steps:
        monitor.update(jax.tree.map(lambda *v: jnp.stack(v), *metrics[-args.window:]))
  for w in caught:
    print(f"  ScaleWarning: {w.message}")
  losses = np.asarray([float(m["loss"]) for m in jax.device_get(metrics)])
  final = float(np.mean(losses[-max(1, len(losses) // 10):]))
  print(f"  {label}: loss {final:.4f}; {monitor.format_summary()}")
  return state, final


def main(argv=None) -> dict[str, float]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=300, help="train steps per run")
  p.add_argument("--window", type=int, default=50, help="ScaleMonitor window")
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")

  raw = make_data(8192, args.seed)
  params = jax.jit(MLP().init)(jax.random.key(args.seed), raw[0][:1])
  out = {}

  print("== 0. float32 baseline (run it first) ==")
  _, out["f32 raw"] = train(jmp_scaler.no_scale(), F32, params, raw, args, "float32")
  print("  finite, if poor: the raw feature dominates, but float32 can represent it.")

  print("\n== 1. symptom: float16 + dynamic_scale ==")
  _, out["fp16 raw"] = train(jmp_scaler.dynamic_scale(), FP16, params, raw, args, "float16")

  print("\n== 2. control: a fixed scale of 1 ==")
  train(jmp_scaler.fixed_scale(1.0), FP16, params, raw, args, "float16, scale 1")
  print("  still every step skipped: no loss scale can fix this, something overflows by itself.")

  x, y = raw[0][: args.batch], raw[1][: args.batch]
  print("\n== 3. which operation? jmp_scaler.find_nonfinite, one call on one batch ==")
  # The scale is dynamic_scale's first; the forward pass turns out to be broken already.
  found = jmp_scaler.find_nonfinite(loss_fn, params, x, y, FP16, scale=2.0**16)
  print(found)
  column = found.first_index[-1]
  print(f"  the first inf is in column {column} of the batch, {FEATURES[column]!r}: "
        f"{found.primitive} in the\n  {found.phase} pass, finite in float32: "
        f"{found.finite_in_float32}.")

  print("\n== 4. the per-leaf reports agree: which gradients, which layer? ==")
  loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)(params, x, y, FP16)
  print(jmp_scaler.nonfinite_report(grads))
  print(f"  the loss of this batch is {float(loss)}: the forward pass is already broken.")
  print("  nonfinite_report of the inputs and of every layer's output:")
  x16 = FP16.cast_to_compute(x)
  _, inter = jax.jit(lambda p, x: MLP().apply(FP16.cast_to_compute(p), x,
                                              capture_intermediates=True))(params, x16)
  forward = {"inputs": dict(zip(FEATURES, x16.T, strict=True)), **inter}  # in forward order
  print(jmp_scaler.nonfinite_report(forward))
  print("  what float16 makes of each float32 feature (underflow_report at scale 1):")
  report = jmp_scaler.underflow_report(dict(zip(FEATURES, x.T, strict=True)), scale=1.0)
  print(report)
  print("  the culprit is the input itself: price exceeds 65504 and becomes inf.\n"
        "  The advice above is written for gradients, where the scale is the loss scale. The\n"
        "  loss scale multiplies the backward pass only, never the inputs, so here read it as:\n"
        f"  price must be multiplied by at most {report.best_scale():g} to fit in float16. "
        "No loss scale does that\n  (step 2): the data must change.")

  print("\n== 5. fix: standardise the features in float32, before the cast ==")
  mean, std = raw[0].mean(0), raw[0].std(0)
  fixed = ((raw[0] - mean) / std, raw[1])
  _, out["f32 fixed"] = train(jmp_scaler.no_scale(), F32, params, fixed, args, "float32")
  state, out["fp16 fixed"] = train(jmp_scaler.dynamic_scale(), FP16, params, fixed, args,
                                   "float16")
  print("  float16 now follows the float32 baseline.")
  out["fp16 fixed skips"] = int(state.scale_metrics()["total_skips"])
  return out


if __name__ == "__main__":
  main()
