"""Where does mixed precision hurt? ``jmp_scaler.compare_precision`` on a model with a weak layer.

A small regression network in float16 (``jmp_scaler.autocast``, policy ``p=f32,c=f16,o=f32``,
``dynamic_scale``) trains worse than the same network in float32, and the loss curves only say
*that*. One of its layers is fragile on purpose: it shifts its weights by 1000 before its matmul
and takes the shift off after (``x @ (w + 1000) - 1000 * sum(x)``), so float16, which spaces its
numbers 0.5 apart near 1000, rounds the weights away. ``compare_precision`` on one batch says
*where*: the table of each layer's activation and gradient error against float32, and the layer
where the error jumps. The fix is to keep that layer in float32 (``jmp_scaler.full_precision``):
the run is then as good as float32's.

``plot_comparison`` draws the table (matplotlib, in the ``examples`` extra); without matplotlib
the example prints the table only.

  python examples/compare_precision.py [--steps 200] [--plot compare.png]
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jmp_scaler

POLICY = "p=f32,c=f16,o=f32"


class Shifted(nn.Module):
  """The fragile layer: ``x @ (w + 1000) - 1000 * sum(x)`` is ``x @ w``, but not in float16."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.3), (x.shape[-1], x.shape[-1]))
    return x @ (w + 1000.0) - jnp.sum(x, -1, keepdims=True) * 1000.0


class Net(nn.Module):
  safe: bool = False  # keep the fragile layer in float32

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32, name="embed")(x))
    shifted = Shifted(name="shifted")
    x = jmp_scaler.full_precision(shifted)(x) if self.safe else shifted(x)
    x = nn.relu(nn.Dense(32, name="hidden")(x))
    return nn.Dense(1, name="head")(x)


def make_data(n: int, seed: int):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (n, 8))
  y = jnp.sin(x[:, :1] * 2.0) + 0.5 * x[:, 1:2] * x[:, 2:3]
  return x, y + 0.01 * jax.random.normal(k2, y.shape)


def loss_fn(params, x, y, safe=False):
  return jnp.mean((Net(safe).apply(params, x) - y) ** 2)


def train(steps: int, policy: str | None, safe: bool, x, y) -> float:
  """Trains from the same initial parameters; returns the final full-batch loss in float32."""
  params = Net().init(jax.random.key(0), x[:1])
  fn = (lambda p, x, y: loss_fn(p, x, y, safe))
  if policy is not None:
    fn = jmp_scaler.autocast(fn, policy)
  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.adam(3e-3))
  state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)

  @jax.jit
  def step(state, x, y):
    _, grads = jmp_scaler.value_and_grad(fn, state)(state.params, x, y)
    return state.apply_gradients(grads=grads)

  for _ in range(steps):
    state = step(state, x, y)
  return float(loss_fn(state.params, x, y))


def plot_comparison(report: jmp_scaler.PrecisionComparison, path: str) -> bool:
  """Bars of each layer's activation and gradient error (log scale), the jump marked; False
  (nothing written) without matplotlib."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  rows = [r for r in report.layers if r.activation_error is not None or r.gradient_error]
  names = [r.name if len(r.name) < 24 else "..." + r.name[-21:] for r in rows]
  floor = 1e-8  # a zero error drawn at the bottom of the log axis
  fig, ax = plt.subplots(figsize=(max(6, len(rows)), 4))
  xs = range(len(rows))
  for offset, attr, label in ((-0.2, "activation_error", "activation"),
                              (0.2, "gradient_error", "gradient")):
    values = [getattr(r, attr) for r in rows]
    ax.bar([i + offset for i in xs], [max(v, floor) if v is not None else 0 for v in values],
           width=0.4, label=label, log=True)
  if report.jump is not None:
    ax.axvline([r.name for r in rows].index(report.jump), color="red", linestyle="--",
               label=f"the error jumps: {report.jump}")
  ax.set_xticks(list(xs), names, rotation=30, ha="right")
  ax.set_ylabel("relative error vs float32")
  ax.set_title(f"compare_precision: {report.policy or 'fn as given'}, scale {report.scale:g}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--plot", default="", help="write the comparison's plot to this PNG")
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error(f"--steps must be at least 1, got {args.steps}")
  x, y = make_data(256, 0)
  params = Net().init(jax.random.key(0), x[:1])
  report = jmp_scaler.compare_precision(loss_fn, params, x[:32], y[:32], policy=POLICY)
  print(report)
  fixed = jmp_scaler.compare_precision(loss_fn, params, x[:32], y[:32], True, policy=POLICY)
  print(f"\nwith the {report.jump} layer in float32 (jmp_scaler.full_precision): the error jumps "
        f"at {fixed.jump}; its activation error "
        f"{fixed.layer('shifted').activation_error:.2e} (was "
        f"{report.layer('shifted').activation_error:.2e})")  # fmt: skip
  print(f"\nfinal loss after {args.steps} steps:")
  for label, policy, safe in (("float32", None, False), ("float16", POLICY, False),
                              ("float16, shifted in float32", POLICY, True)):
    print(f"  {label:<28} {train(args.steps, policy, safe, x, y):.4f}")
  if args.plot:
    if plot_comparison(report, args.plot):
      print(f"\nplot: {args.plot}")
    else:
      print("\nno plot: matplotlib is not installed (pip install jmp_scaler[examples])")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
