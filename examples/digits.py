"""float32 vs bfloat16 vs float16 + dynamic loss scaling, on scikit-learn's digits.

The habit to keep: run a float32 baseline first, then the same model in half
precision, and compare. One MLP, one train step, three dtype policies:

* ``f32``: everything in float32, no loss scaling (the baseline);
* ``bf16``: compute in bfloat16; float32's range, so no loss scaling is
  needed (``Policy.loss_scaler()`` is ``jmp_scaler.no_scale()``: the scale
  stays 1, a non-finite step would still be skipped);
* ``fp16``: compute in float16, with ``jmp_scaler.dynamic_scale`` at the head
  of the chain and ``jmp_scaler.TrainState`` skipping overflowing steps.

The train step is the same for the three (``jmp_scaler.value_and_grad``
scales the loss by whatever scale the state holds). It prints a side-by-side
table (final loss, accuracy, steps/s, skipped steps, final scale) and writes
two PNGs to ``--out`` (with matplotlib): the loss curves next to the test
accuracy (the three runs drawn in different line styles, since they mostly
overlap), and the fp16 scale history with its skipped steps marked. The
growth interval is shortened from PyTorch's 2000 to 100 (``--growth-interval``)
so that a short run shows the scale growing until float16 overflows and
backing off; the plot's title says which interval it ran with.

  pip install -e ".[examples]" && python examples/digits.py

Half-precision matmuls are slow on CPUs (jax#7431): on a CPU the steps/s
column measures the emulation, not the speed-up a GPU or TPU gives.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import jmp_scaler

RUNS = (("f32", "p=f32,c=f32,o=f32"), ("bf16", "p=f32,c=bf16,o=f32"), ("fp16", "p=f32,c=f16,o=f32"))


class MLP(nn.Module):
  hidden: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(10)(x)


def load_digits(seed: int):
  """Digits as float32 in [0, 1], split 80/20 (stratified)."""
  from sklearn.datasets import load_digits as sk_load
  from sklearn.model_selection import train_test_split

  x, y = sk_load(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  return train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=seed, stratify=y)


def make_fns(model: MLP, policy: jmp_scaler.Policy):
  """The jitted train step and evaluation for one policy."""

  def loss_and_logits(params, x, y):
    logits = model.apply(policy.cast_to_compute(params), policy.cast_to_compute(x))
    logits = policy.cast_to_output(logits).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

  @jax.jit
  def train_step(state, x_all, y_all, idx):
    x, y = x_all[idx], y_all[idx]
    # Gradients of loss * scale (1 under bf16 and f32); loss and logits come back unscaled.
    (loss, _), grads = jmp_scaler.value_and_grad(loss_and_logits, state, has_aux=True)(
        state.params, x, y)
    state = state.apply_gradients(grads=grads)
    return state, {"loss": loss, **state.scale_metrics()}

  @jax.jit
  def evaluate(params, x_train, y_train, x_test, y_test):
    """Loss on the training set, accuracy on the test set."""
    loss, _ = loss_and_logits(params, x_train, y_train)
    return loss, test_accuracy(params, x_test, y_test)

  @jax.jit
  def test_accuracy(params, x_test, y_test):
    _, logits = loss_and_logits(params, x_test, y_test)
    return jnp.mean(jnp.argmax(logits, -1) == y_test)

  return train_step, evaluate, test_accuracy


def train(name, spec, args, data, model, params, progress):
  """Trains one policy from ``params``; returns its row of the table and its curves."""
  x_train, x_test, y_train, y_test = data
  policy = jmp_scaler.get_policy(spec)
  scaler = policy.loss_scaler(growth_interval=args.growth_interval)
  tx = optax.chain(scaler, optax.adam(args.lr))
  state = jmp_scaler.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  monitor = None  # every policy has a scaler; only float16's scale moves
  if policy.needs_loss_scaling:
    monitor = jmp_scaler.ScaleMonitor.for_state(state.opt_state, window=args.growth_interval)
  init_scale = float(jmp_scaler.get_scale(state.opt_state))
  train_step, evaluate, test_accuracy = make_fns(model, policy)

  rng = np.random.default_rng(args.seed)
  per_epoch = len(y_train) // args.batch
  batches = np.concatenate([
      rng.permutation(len(y_train))[: per_epoch * args.batch].reshape(per_epoch, args.batch)
      for _ in range(-(-args.steps // per_epoch))
  ]).astype(np.int32)
  step = train_step.lower(state, x_train, y_train, batches[0]).compile()  # compile, untimed

  task = progress.add_task(name, total=args.steps, info="")
  losses, pending, acc_at, accs, eval_time = [], [], [], [], 0.0
  start = time.perf_counter()
  for i in range(args.steps):
    state, metrics = step(state, x_train, y_train, batches[i])
    pending.append(metrics)
    if len(pending) == args.log_every or i == args.steps - 1:
      host = jax.device_get(pending)  # one transfer per log_every steps
      losses += [float(m["loss"]) for m in host]
      t0 = time.perf_counter()  # the test accuracy, not counted in steps/s
      acc_at.append(i + 1)
      accs.append(float(test_accuracy(state.params, x_test, y_test)))
      eval_time += time.perf_counter() - t0
      if monitor is not None:
        monitor.update(jax.tree.map(lambda *v: np.stack(v), *host))
      info = f"loss {np.mean(losses[-len(host):]):.4f}"
      if monitor is not None:
        info += f"  scale {float(host[-1]['scale']):g}  skipped {int(host[-1]['total_skips'])}"
      progress.update(task, advance=len(host), info=info)
      pending = []
  jax.block_until_ready(state)
  elapsed = time.perf_counter() - start - eval_time

  train_loss, accuracy = evaluate(state.params, x_train, y_train, x_test, y_test)
  m = jax.device_get(state.scale_metrics())
  return {
      "name": name,
      "policy": str(policy),
      "compute": policy.compute_dtype.name,
      "loss": float(train_loss),
      "accuracy": float(accuracy),
      "steps_per_s": args.steps / elapsed,
      "skipped": int(m["total_skips"]) if policy.needs_loss_scaling else None,
      "scale": float(m["scale"]) if policy.needs_loss_scaling else None,
      "losses": np.asarray(losses),
      "accuracy_curve": (np.asarray(acc_at), np.asarray(accs)),
      "monitor": monitor,
      "init_scale": init_scale,
  }


def print_table(console: Console, rows) -> None:
  table = Table(title="digits: the same MLP in three dtype policies")
  for col, just in (("run", "left"), ("compute", "left"), ("final loss", "right"),
                    ("accuracy", "right"), ("steps/s", "right"), ("skipped", "right"),
                    ("final scale", "right")):
    table.add_column(col, justify=just)
  for r in rows:
    scaled = r["scale"] is not None  # bf16 and f32: no_scale(), the scale stays 1
    table.add_row(r["name"], r["compute"], f"{r['loss']:.4f}", f"{100 * r['accuracy']:.1f}%",
                  f"{r['steps_per_s']:.0f}", str(r["skipped"]) if scaled else "-",
                  f"{r['scale']:g}" if scaled else "-")
  console.print(table)


STYLES = {"f32": dict(ls="-", lw=4, alpha=0.35), "bf16": dict(ls="--", lw=1.8),
          "fp16": dict(ls=":", lw=2.2)}  # the curves overlap: tell them apart by style


def plot(rows, out: pathlib.Path, console: Console, growth_interval: int) -> None:
  """Loss and test accuracy curves, and the fp16 scale history, as PNGs (needs matplotlib).

  Each PNG records its panels' titles in its metadata ("Title"), for tools
  and tests that read the file.
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    console.print("matplotlib is not installed: no plots (pip install matplotlib)")
    return
  out.mkdir(parents=True, exist_ok=True)
  fig, (ax, acc) = plt.subplots(1, 2, figsize=(11, 4))
  for r in rows:
    k = max(1, len(r["losses"]) // 50)
    smooth = np.convolve(r["losses"], np.ones(k) / k, mode="valid")
    style = STYLES.get(r["name"], {})
    ax.plot(np.arange(len(smooth)) + k, smooth, label=f"{r['name']} ({r['policy']})", **style)
    at, accs = r["accuracy_curve"]
    acc.plot(at, 100 * accs, label=r["name"], **style)
  titles = ("digits: training loss per dtype policy", "digits: test accuracy per dtype policy")
  ax.set(yscale="log", xlabel="step", ylabel="training loss (moving average)", title=titles[0])
  acc.set(xlabel="step", ylabel="test accuracy (%)", title=titles[1])
  ax.legend()
  acc.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(out / "digits_loss.png", dpi=120, metadata={"Title": " | ".join(titles)})
  plt.close(fig)
  monitored = [r for r in rows if r["monitor"] is not None]
  for r in monitored:
    h = r["monitor"].history
    before = np.concatenate([[r["init_scale"]], h["scale"][:-1]])  # the scale each step ran at
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(h["steps"], before, where="post", label="loss scale")
    ax.plot(h["steps"][h["skipped"]], before[h["skipped"]], "rx", label="skipped (overflow)")
    title = (f"{r['name']}: dynamic loss scale, growth_interval={growth_interval} "
             "(PyTorch's default: 2000)")
    ax.set(xlabel="step", ylabel="scale", title=title)
    ax.set_yscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"digits_scale_{r['name']}.png", dpi=120, metadata={"Title": title})
    plt.close(fig)
  console.print(f"plots written to {out}/")


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=1500, help="train steps per run")
  p.add_argument("--hidden", type=int, default=256, help="hidden width")
  p.add_argument("--depth", type=int, default=2, help="hidden layers")
  p.add_argument("--batch", type=int, default=128, help="batch size")
  p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
  p.add_argument("--growth-interval", type=int, default=100, help="fp16 scaler growth interval")
  p.add_argument("--log-every", type=int, default=25, help="steps between host syncs")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out"), help="PNG directory")
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")

  console = Console()
  data = tuple(jnp.asarray(a) for a in load_digits(args.seed))
  model = MLP(args.hidden, args.depth)
  # The same float32 initial parameters for every run (one jitted init).
  params = jax.jit(model.init)(jax.random.key(args.seed), data[0][:1])
  columns = (TextColumn("{task.description:>5}"), BarColumn(), MofNCompleteColumn(),
             TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
  with Progress(*columns, console=console) as progress:
    rows = [train(name, spec, args, data, model, params, progress) for name, spec in RUNS]
  print_table(console, rows)
  for r in rows:
    if r["monitor"] is not None:
      console.print(f"{r['name']} scale monitor: {r['monitor'].format_summary()}")
  plot(rows, args.out, console, args.growth_interval)
  return rows


if __name__ == "__main__":
  main()
