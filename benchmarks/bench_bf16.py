"""bfloat16 training without float32 master weights: quality, memory and time.

Four setups of the same AdamW step (``jmp_scaler.low_precision_optimizer``):

  f32     float32 parameters and Adam moments (the master-weights baseline)
  rtn     bfloat16 parameters, round-to-nearest update (p + u cast to bf16)
  sr      bfloat16 parameters, jmp_scaler.stochastic_round
  kahan   bfloat16 parameters, jmp_scaler.kahan_summation

The three bfloat16 setups keep both Adam moments in bfloat16 (stochastically
rounded) and differ only in how ``p + u`` is rounded. The forward and
backward passes compute in float32 in every setup (bfloat16 matmuls are
emulated on CPUs, jax#7431): only the storage differs. Tables:

  1. the micro-test: 1.0 + 1e-3, a thousand times, in bfloat16;
  2. digits (the MLP of examples/digits.py) and a character-level GPT on a
     Python source file, ``--seeds`` seeds each (all seeds in one vmapped,
     scanned program per setup): final loss and accuracy, mean +- sd;
  3. bytes per parameter: parameters + gradients + optimizer state from the
     arrays, and the compiled step's memory_analysis (arguments minus the
     batch, and temporaries);
  4. step time relative to f32 and to rtn (median over interleaved rounds).

  python benchmarks/bench_bf16.py            # about 5-8 minutes on 2 busy cores
  python benchmarks/bench_bf16.py --quick    # tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
try:
  import jmp_scaler
except ImportError:  # run from a checkout that is not installed
  sys.path.insert(0, _ROOT)
  import jmp_scaler
from jmp_scaler.lowbit._adam16 import low_precision_optimizer  # noqa: E402
from jmp_scaler.lowbit._stochastic import kahan_summation, stochastic_round  # noqa: E402

SETUPS = ("f32", "rtn", "sr", "kahan")
_POLICY = {"f32": "p=f32,c=f32,o=f32", "rtn": "p=bf16,c=f32,o=f32",
           "sr": "p=bf16,c=f32,o=f32", "kahan": "p=bf16,c=f32,o=f32"}
_ROUNDING = {"f32": "nearest", "rtn": "nearest", "sr": "stochastic", "kahan": "kahan"}


def make_tx(setup: str, lr: float, wd: float, seed: int = 0) -> optax.GradientTransformation:
  policy = jmp_scaler.get_policy(_POLICY[setup])
  return low_precision_optimizer(policy, lr, weight_decay=wd, rounding=_ROUNDING[setup],
                                 seed=seed, skip_nonfinite=False)


# ---------------------------------------------------------------- 1. micro-test


def micro_test(seeds: int) -> dict[str, tuple[float, float]]:
  """1.0 + 1e-3, 1000 times, one bfloat16 parameter per seed."""

  def run(tx, seed_count):
    p = jnp.ones((), jnp.bfloat16)

    def body(c, _):
      p, s = c
      u, s = tx.update(jnp.float32(1e-3), s, p)
      return (optax.apply_updates(p, u), s), None

    (p, s), _ = jax.lax.scan(body, (p, tx.init(p)), None, length=1000)
    extra = s.compensation.astype(jnp.float32) if hasattr(s, "compensation") else 0.0
    return p.astype(jnp.float32), p.astype(jnp.float32) + extra

  out = {}
  f32 = np.float32(1)
  for _ in range(1000):
    f32 = np.float32(f32 + np.float32(1e-3))
  out["f32"] = ([float(f32)], [float(f32)])
  for name, make in (("rtn", lambda s: optax.identity()), ("sr", stochastic_round),
                     ("kahan", lambda s: kahan_summation())):
    # one program per method: the seeds are static, so unroll them in one jit
    runs = jax.jit(lambda make=make: [run(make(seed), seed) for seed in range(seeds)])()
    out[name] = ([float(a) for a, _ in runs], [float(b) for _, b in runs])
  return out


# ---------------------------------------------------------------- tasks


class MLP(nn.Module):
  """examples/digits.py's model."""

  hidden: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(10)(x)


@dataclasses.dataclass
class Task:
  name: str
  init: Any  # key -> float32 params
  loss_acc: Any  # (params f32, x, y) -> (loss, accuracy)
  x_train: Any
  y_train: Any
  x_test: Any
  y_test: Any
  batch: int
  steps: int
  lr: float
  wd: float


def digits_task(args) -> Task:
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  xtr, xte, ytr, yte = train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=0,
                                        stratify=y)
  model = MLP(args.hidden, 2)

  def loss_acc(params, x, y):
    logits = model.apply({"params": params}, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)

  return Task("digits", lambda k: model.init(k, x[:1])["params"], loss_acc,
              xtr, ytr, xte, yte, 64, args.digits_steps, args.digits_lr, 0.0)


def _corpus() -> str:
  """A fixed character corpus: the source of Python's argparse and textwrap."""
  import argparse as a
  import textwrap as t

  return inspect.getsource(a) + inspect.getsource(t)


def gpt_task(args) -> Task:
  text = _corpus()
  chars = sorted(set(text))
  ids = np.asarray([chars.index(c) for c in text], np.int32)
  layers = getattr(args, "gpt_layers", 2)  # bench_autocast passes its own
  seq, d, heads, vocab = args.seq, args.d_model, 4, len(chars)
  split = int(0.9 * len(ids))

  def windows(a, n, rng):
    starts = rng.integers(0, len(a) - seq - 1, n)
    xs = np.stack([a[s:s + seq] for s in starts])
    return xs, np.stack([a[s + 1:s + seq + 1] for s in starts])

  rng = np.random.default_rng(0)
  xtr, ytr = windows(ids[:split], 4096, rng)
  xte, yte = windows(ids[split:], 256, rng)

  def init(key):
    ks = iter(jax.random.split(key, 4 + 6 * layers))
    dense = lambda i, o: jax.random.normal(next(ks), (i, o)) * (1.0 / np.sqrt(i))
    p = {"emb": jax.random.normal(next(ks), (vocab, d)) * 0.1,
         "pos": jax.random.normal(next(ks), (seq, d)) * 0.1, "blocks": []}
    for _ in range(layers):
      p["blocks"].append({"ln1": jnp.ones(d), "qkv": dense(d, 3 * d), "out": dense(d, d),
                          "ln2": jnp.ones(d), "up": dense(d, 4 * d), "down": dense(4 * d, d)})
    p["lnf"] = jnp.ones(d)
    return p

  def norm(x, g):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5) * g

  def forward(p, x, keep):
    """``keep(fn)`` is a region for what a low-precision recipe keeps in higher precision:
    attention's batched matmuls, the last block and the head (NVFP4's recipe); identity
    unless bench_autocast's NVFP4 recipe setup passes a nested autocast."""
    h = p["emb"][x] + p["pos"]
    t = x.shape[-1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    sh = lambda a: a.reshape(*a.shape[:-1], heads, d // heads)  # noqa: E731

    def attend(q, k, v):
      s = jnp.einsum("bqhd,bkhd->bhqk", sh(q), sh(k)) / np.sqrt(d // heads)
      w = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
      return jnp.einsum("bhqk,bkhd->bqhd", w, sh(v)).reshape(h.shape)

    def block(b, h):
      q, k, v = jnp.split(norm(h, b["ln1"]) @ b["qkv"], 3, axis=-1)
      h = h + keep(attend)(q, k, v) @ b["out"]
      return h + jax.nn.gelu(norm(h, b["ln2"]) @ b["up"]) @ b["down"]

    for i, b in enumerate(p["blocks"]):
      h = (keep(block) if i == len(p["blocks"]) - 1 else block)(b, h)
    return keep(lambda h, e: norm(h, p["lnf"]) @ e.T)(h, p["emb"])

  def loss_acc(params, x, y, keep=lambda f: f):
    logits = forward(params, x, keep)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)

  return Task("char-GPT", init, loss_acc, xtr, ytr, xte, yte, args.gpt_batch, args.gpt_steps,
              args.gpt_lr, 0.0)


def _f32(params):
  return jax.tree.map(lambda a: a.astype(jnp.float32), params)


def _step_fn(task: Task, tx):
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: task.loss_acc(_f32(p), x, y)[0])(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def train_seeds(task: Task, setup: str, seeds: int):
  """All seeds at once: vmap over seeds of a scan over steps. Returns test loss, acc."""
  dtype = jnp.float32 if setup == "f32" else jnp.bfloat16
  xtr, ytr = jnp.asarray(task.x_train), jnp.asarray(task.y_train)
  n = len(task.y_train)

  def one(seed):
    params = jax.tree.map(lambda a: a.astype(dtype), task.init(jax.random.key(seed)))
    tx = make_tx(setup, task.lr, task.wd, seed=0)  # the data and init differ per seed
    step = _step_fn(task, tx)

    def body(c, i):
      p, s = c
      idx = jax.random.randint(jax.random.fold_in(jax.random.key(seed + 1000), i),
                               (task.batch,), 0, n)
      return step(p, s, xtr[idx], ytr[idx]), None

    (p, _), _ = jax.lax.scan(body, (params, tx.init(params)), jnp.arange(task.steps))
    return task.loss_acc(_f32(p), jnp.asarray(task.x_test), jnp.asarray(task.y_test))

  loss, acc = jax.jit(jax.vmap(one))(jnp.arange(seeds))
  return np.asarray(loss), np.asarray(acc)


def train_seeds_stepwise(task: Task, setup: str, seeds: int, compiled):
  """--quick: train_seeds' training, the seeds one after another through ``compiled``.

  ``compiled`` is the step memory_and_step compiled (and table 4 times), so a
  setup compiles one program for tables 2 to 4 instead of two: the same
  initialization, batches (the same keys), step and test evaluation as
  train_seeds, without its vmapped scan over the steps. Returns test loss, acc.
  """
  n = len(task.y_train)
  batches = jax.jit(jax.vmap(lambda seed: jax.vmap(lambda i: jax.random.randint(
      jax.random.fold_in(jax.random.key(seed + 1000), i), (task.batch,), 0, n))(
          jnp.arange(task.steps))))(jnp.arange(seeds))
  batches = np.asarray(batches)
  init = _init_fn(task, setup)
  evaluate = _evaluator(task)
  losses, accs = [], []
  for seed in range(seeds):
    p, s = init(seed)
    for idx in batches[seed]:
      p, s = compiled(p, s, task.x_train[idx], task.y_train[idx])
    # float32 copies on the host: one evaluation program for every setup
    loss, acc = evaluate(jax.tree.map(lambda a: np.asarray(a).astype(np.float32), p))
    losses.append(float(loss))
    accs.append(float(acc))
  return np.asarray(losses), np.asarray(accs)


_EVALUATORS: dict[int, Any] = {}


def _evaluator(task: Task):
  if id(task) not in _EVALUATORS:
    x, y = jnp.asarray(task.x_test), jnp.asarray(task.y_test)
    _EVALUATORS[id(task)] = task, jax.jit(lambda p: task.loss_acc(p, x, y))
  return _EVALUATORS[id(task)][1]


# ---------------------------------------------------------------- memory and time


def _nbytes(tree) -> int:
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


_INITS: dict[Any, Any] = {}


def _init_fn(task: Task, setup: str):
  """seed -> (parameters in the setup's dtype, optimizer state).

  Two compiled programs, each made once: the task's float32 initialization
  (shared by the setups), then the setup's cast and optimizer state.
  """
  # keyed by the task object (held in the value, so its id is not reused), not its name
  if id(task) not in _INITS:
    _INITS[id(task)] = task, jax.jit(lambda seed: task.init(jax.random.key(seed)))
  if (id(task), setup) not in _INITS:
    dtype = jnp.float32 if setup == "f32" else jnp.bfloat16
    tx = make_tx(setup, task.lr, task.wd)

    def cast_and_init(params):
      params = jax.tree.map(lambda a: a.astype(dtype), params)
      return params, tx.init(params)

    _INITS[id(task), setup] = task, jax.jit(cast_and_init)
  init32, init = _INITS[id(task)][1], _INITS[id(task), setup][1]
  return lambda seed: init(init32(seed))


def memory_and_step(task: Task, setup: str):
  tx = make_tx(setup, task.lr, task.wd)
  params, opt_state = _init_fn(task, setup)(0)  # one program, not one per eager op
  n = sum(a.size for a in jax.tree.leaves(params))
  x, y = jnp.asarray(task.x_train[:task.batch]), jnp.asarray(task.y_train[:task.batch])
  step = jax.jit(_step_fn(task, tx), donate_argnums=(0, 1))
  compiled = step.lower(params, opt_state, x, y).compile()
  ma = compiled.memory_analysis()
  batch = _nbytes((x, y))
  mem = {
      "n": n,
      "state": (2 * _nbytes(params) + _nbytes(opt_state)) / n,  # params + grads + opt state
      "args": (ma.argument_size_in_bytes - batch) / n if ma else float("nan"),
      "temp": ma.temp_size_in_bytes / n if ma else float("nan"),
  }
  return mem, compiled, (params, opt_state, x, y)


def time_steps(compiled, carry, rounds: int, steps: int):
  order = list(compiled)
  times = {k: [] for k in order}
  for r in range(rounds):
    for k in order[r % len(order):] + order[:r % len(order)]:
      p, s, x, y = carry[k]
      start = time.perf_counter()
      for _ in range(steps):
        p, s = compiled[k](p, s, x, y)
      jax.block_until_ready(p)
      times[k].append((time.perf_counter() - start) / steps)
      carry[k] = (p, s, x, y)
  return times


# ---------------------------------------------------------------- main


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
  ap.add_argument("--seeds", type=int, default=5)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--digits-steps", type=int, default=1500)
  ap.add_argument("--digits-lr", type=float, default=1e-4)
  ap.add_argument("--gpt-steps", type=int, default=400)
  ap.add_argument("--gpt-lr", type=float, default=1e-4)
  ap.add_argument("--gpt-batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=32)
  ap.add_argument("--d-model", type=int, default=32)
  ap.add_argument("--gpt-layers", type=int, default=2)
  ap.add_argument("--tasks", default="digits,char-GPT", help="comma-separated subset")
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
  args = ap.parse_args(argv)
  if args.quick:
    args.seeds, args.hidden, args.digits_steps, args.gpt_steps = 2, 32, 40, 10
    args.seq, args.d_model, args.gpt_layers, args.rounds, args.steps = 16, 16, 1, 3, 3
  print(f"jax {jax.__version__}, {jax.default_backend()}, {jax.device_count()} device(s); "
        f"seeds {args.seeds}")

  t0 = time.perf_counter()
  micro = micro_test(max(args.seeds, 2) * 2)
  print("\n1. micro-test: 1.0 + 1e-3, 1000 times, in bfloat16 "
        f"({len(micro['sr'][0])} seeds; exact answer 2.0)")
  print(f"{'setup':8}{'stored mean':>14}{'sd':>10}{'effective':>12}")
  print("-" * 44)
  for k, (stored, eff) in micro.items():
    print(f"{k:8}{np.mean(stored):14.4f}{np.std(stored):10.4f}{np.mean(eff):12.4f}")

  makers = {"digits": digits_task, "char-GPT": gpt_task}
  wanted = args.tasks.split(",")
  if any(t not in makers for t in wanted):
    ap.error(f"--tasks must name tasks among {list(makers)}, got {args.tasks!r}")
  tasks = [makers[t](args) for t in wanted]
  print(f"\n2. final test loss and accuracy, mean +- sd over {args.seeds} seeds")
  print(f"{'task':10}{'setup':7}{'loss':>18}{'accuracy %':>18}{'vs f32 (sd)':>13}")
  print("-" * 66)
  quality, steps = {}, {}
  for task in tasks:
    for setup in SETUPS:
      if args.quick:  # one compiled step per setup serves tables 2, 3 and 4
        steps[task.name, setup] = memory_and_step(task, setup)
        loss, acc = train_seeds_stepwise(task, setup, args.seeds, steps[task.name, setup][1])
      else:
        loss, acc = train_seeds(task, setup, args.seeds)
      quality[task.name, setup] = (loss, acc)
      ref = quality[task.name, "f32"][0]
      z = (loss.mean() - ref.mean()) / max(np.std(ref), 1e-12)
      print(f"{task.name:10}{setup:7}{loss.mean():11.4f} +-{loss.std():.4f}"
            f"{100 * acc.mean():11.2f} +-{100 * acc.std():.2f}{z:+13.1f}")
  print(f"(steps: digits {args.digits_steps} at lr {args.digits_lr}, char-GPT "
        f"{args.gpt_steps} at lr {args.gpt_lr}; last column: loss minus f32's, in f32 sds)")

  print("\n3. bytes per parameter (params + grads + optimizer state) and 4. step time")
  print(f"{'task':10}{'setup':7}{'params':>9}{'state B/p':>10}{'args B/p':>10}{'temp B/p':>10}"
        f"{'ms/step':>9}{'vs f32':>8}{'vs rtn':>8}")
  print("-" * 81)
  for task in tasks:
    mems, compiled, carry = {}, {}, {}
    for setup in SETUPS:
      made = steps.get((task.name, setup)) or memory_and_step(task, setup)
      mems[setup], compiled[setup], carry[setup] = made
    times = time_steps(compiled, carry, args.rounds, args.steps)
    med = {k: np.median(v) for k, v in times.items()}
    ratio = lambda k, b, t=times: np.median(np.asarray(t[k]) / np.asarray(t[b]))
    for setup in SETUPS:
      m = mems[setup]
      print(f"{task.name:10}{setup:7}{m['n']:9d}{m['state']:10.2f}{m['args']:10.2f}"
            f"{m['temp']:10.2f}{1e3 * med[setup]:9.3f}{ratio(setup, 'f32'):8.2f}"
            f"{ratio(setup, 'rtn'):8.2f}")
  print(f"(args B/p: the compiled step's argument bytes minus the batch, per parameter; "
        f"time: median of {args.rounds} interleaved rounds of {args.steps} steps; ratios: "
        f"median of per-round ratios)")
  print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
