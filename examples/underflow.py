"""A down-weighted loss term whose float16 gradients underflow without scaling.

A network with a shared trunk and two heads: ``head`` classifies, ``aux``
reconstructs the input, and the reconstruction loss is down-weighted
(``--aux-weight 1e-5``, as auxiliary, distillation or regularisation terms
often are). Adam normalises each parameter's gradient, so in float32 the small
weight barely slows ``aux`` down. In float16 its gradients are ~1e-8, below
float16's smallest subnormal (6e-8): most flush to exactly zero and ``aux``
barely learns. Scaling the loss by 2^16 lifts them back into float16's range.

First, ``jmp_scaler.underflow_report`` on the float32 gradients of the
weighted term predicts it (``perturbations/recon`` is the gradient at the
head's output, which the float16 backward pass casts first). The report's
advice reads only the tree it is given: on the aux term alone, its largest
safe scale ignores the main term, whose gradients are far larger. So the
second report takes the whole loss's gradients, the ones the backward pass
holds, at the scaler's initial scale of 2^16. Then three runs:
float32, float16 without scaling (``jmp_scaler.no_scale()``), and float16
with ``jmp_scaler.dynamic_scale()``.

  python examples/underflow.py [--steps 600]
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_scaler


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(128, name="trunk")(x))
    logits = nn.Dense(10, name="head")(h)
    recon = self.perturb("recon", nn.Dense(x.shape[-1], name="aux")(h))
    return logits, recon


def make_data(n: int, seed: int):
  rng = np.random.default_rng(seed)
  teacher = np.random.default_rng(123).normal(size=(32, 10))  # the same task for every seed
  x = rng.normal(size=(n, 32)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(np.argmax(x @ teacher, -1), jnp.int32)


def losses(variables, x, y, policy):
  """(main, aux): cross-entropy, and the (unweighted) reconstruction error."""
  variables = policy.cast_to_compute(variables)
  logits, recon = policy.cast_to_output(Net().apply(variables, policy.cast_to_compute(x)))
  main = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
  return main, jnp.mean((recon.astype(jnp.float32) - x) ** 2)


def train(policy, scaler, params, data, args):
  x, y = data
  tx = optax.chain(scaler, optax.adam(args.lr))
  state = jmp_scaler.TrainState.create(apply_fn=Net().apply, params=params, tx=tx)

  @jax.jit
  def step(state, idx):
    def loss_fn(p):
      main, aux = losses({"params": p}, x[idx], y[idx], policy)
      return main + args.aux_weight * aux, aux

    # Gradients of the loss times the scale; the aux loss passes through untouched.
    (_, aux), grads = jmp_scaler.value_and_grad(loss_fn, state, has_aux=True)(state.params)
    zero = jnp.mean(grads["aux"]["kernel"] == 0)  # flushed in the real backward pass
    return state.apply_gradients(grads=grads), (aux, zero)

  rng = np.random.default_rng(args.seed)
  idx = rng.integers(0, len(y), size=(args.steps, args.batch)).astype(np.int32)
  out = []
  for i in range(args.steps):
    state, o = step(state, idx[i])
    out.append(o)
  aux, zero = np.asarray(jax.device_get(out)).T
  return state, aux, zero


def main(argv=None) -> dict[str, dict[str, float]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=600, help="train steps per run")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
  p.add_argument("--aux-weight", type=float, default=1e-5, help="weight of the aux loss")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")

  data = make_data(8192, args.seed)
  x, y = data[0][: args.batch], data[1][: args.batch]
  variables = jax.jit(Net().init)(jax.random.key(args.seed), x)
  f32 = jmp_scaler.get_policy("f32")

  # 1. Predict: the float32 gradients of the weighted term, cast to float16 unscaled.
  grads = jax.jit(jax.grad(lambda v: args.aux_weight * losses(v, x, y, f32)[1]))(variables)
  grads = {"params": {"aux": grads["params"]["aux"]}, "perturbations": grads["perturbations"]}
  aux_only = jmp_scaler.underflow_report(grads, scale=1.0, dtype=jnp.float16)
  print("underflow_report of the aux term's gradients at scale 1:")
  print(aux_only)
  print(f"That advice sees only the aux term: {aux_only.best_scale():.3g} would overflow the "
        "main term's\ngradients. Ask about the whole loss's gradients, at the scaler's "
        "initial scale:\n")
  # 2. The whole loss (main + weighted aux), every leaf the float16 backward pass holds.
  def total(v):
    main, aux = losses(v, x, y, f32)
    return main + args.aux_weight * aux

  whole = jax.jit(jax.grad(total))(variables)
  report = jmp_scaler.underflow_report(whole, scale=2.0**16, dtype=jnp.float16)
  print("underflow_report of the whole loss's gradients at scale 65536:")
  print(report)
  print(f"The largest scale that keeps every gradient of the loss finite is "
        f"{report.best_scale():.3g},\nnot {aux_only.best_scale():.3g}; "
        "dynamic_scale finds it by itself (it grows until an overflow).\n")

  # 3. Train: float32, float16 unscaled, float16 with dynamic scaling.
  fp16 = jmp_scaler.get_policy("p=f32,c=f16,o=f32")
  runs = {"f32": (f32, f32.loss_scaler()), "fp16 no_scale": (fp16, jmp_scaler.no_scale()),
          "fp16 dynamic": (fp16, jmp_scaler.dynamic_scale())}
  print(f"{'run':<14} {'aux loss: first':>16} {'last':>8} {'aux grads == 0':>15} {'scale':>8}")
  results = {}
  k = max(1, args.steps // 10)  # average the first and last 10% of the steps
  for name, (policy, scaler) in runs.items():
    state, aux, zero = train(policy, scaler, variables["params"], data, args)
    first, last = float(np.mean(aux[:k])), float(np.mean(aux[-k:]))
    scale = float(state.loss_scale)
    print(f"{name:<14} {first:>16.4f} {last:>8.4f} {np.mean(zero):>15.1%} {scale:>8g}")
    results[name] = {"first": first, "last": last, "zero": float(np.mean(zero))}
  print("Without scaling, almost every gradient of the aux head is exactly zero in float16: it\n"
        "barely learns. The loss scale lifts them into float16's range, and the float16 run\n"
        "follows the float32 one. bfloat16 has float32's range and would need no scale.")
  return results


if __name__ == "__main__":
  main()
