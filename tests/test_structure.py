"""The compiled step's structure as the leaf count grows (issue 14), and the sweep's smoke test.

Not timed: counts in the compiled HLO. The scaler's cost must grow linearly with
the number of parameter leaves, in every skip mode: one conditional (cond) or none
(select), a fixed number of reductions and selects per leaf, and no chain of scalar
ops copied into every kernel that reads the decision (which made select mode's
compile time grow with the square of the leaf count).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmp_scaler.scaling._accumulate import accumulate_gradients
from jmp_scaler.scaling._scaler import dynamic_scale
from jmp_scaler.scaling._skip import skip_nonfinite
from jmp_scaler.training._train_state import TrainState
from tests._subprocess import output


def _params(n):
  return {f"l{i:03d}": jnp.full((8, 8), 0.5 + i / n, jnp.float32) for i in range(n)}


def _step(variant):
  adam = optax.adam(1e-3)
  if variant in ("cond", "select"):
    tx = optax.chain(dynamic_scale(skip_mode=variant), adam)

    def step(params, grads):
      state = TrainState.create(apply_fn=None, params=params, tx=tx)
      return state.apply_gradients(grads=grads)

    return step
  wrap = {"skip": skip_nonfinite, "accumulate": lambda t: accumulate_gradients(t, 1),
          "bare": lambda t: t}[variant]
  tx = wrap(optax.chain(dynamic_scale(bare=True), adam))

  def step(params, grads):
    return tx.update(grads, tx.init(params), params)

  return step


def _counts(variant, n):
  params = _params(n)
  text = jax.jit(_step(variant)).lower(params, params).compile().as_text()
  ops = lambda op: len(re.findall(rf" {op}\(", text))  # noqa: E731
  return {"lines": len(text.splitlines()), "conditional": ops("conditional"),
          "select": ops("select"), "reduce": ops("reduce"), "and": ops("and")}


@pytest.mark.parametrize("variant", ["cond", "select", "skip", "accumulate", "bare"])
def test_compiled_step_grows_linearly_with_the_leaf_count(variant):
  small, large = _counts(variant, 8), _counts(variant, 32)
  # One conditional in cond mode whatever the leaf count, none in select mode (auto:
  # skip_nonfinite, and accumulate_gradients with every_k=1, on CPU).
  expected = {"cond": 1, "select": 0, "skip": 0, "accumulate": 0, "bare": 0}[variant]
  assert small["conditional"] == large["conditional"] == expected, (small, large)
  # Four times the leaves: at most about four times the module (the scalar chain
  # copied into every kernel made it grow 15-fold at 4x the leaves).
  assert large["lines"] <= 4.5 * small["lines"], (small, large)
  # A bounded number of reductions, selects and scalar ands per leaf.
  # (accumulate_gradients in select mode: 8 selects a leaf, its own three and the chain's.)
  for op, per_leaf in (("reduce", 4), ("select", 8), ("and", 3)):
    assert large[op] - small[op] <= per_leaf * 24, (op, small, large)


def _donated(mode, n):
  """The compiled Adam step on ``n`` 64x64 leaves, state donated: (temp bytes, leaf copies)."""
  leaves = lambda: {f"l{i:03d}": jnp.full((64, 64), 0.5 + i / n, jnp.float32) for i in range(n)}  # noqa: E731
  params, adam = leaves(), optax.adam(1e-3)
  if mode == "none":
    state = (params, adam.init(params))

    def step(s, g):
      updates, opt_state = adam.update(g, s[1], s[0])
      return optax.apply_updates(s[0], updates), opt_state
  else:
    tx = optax.chain(dynamic_scale(skip_mode=mode), adam)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)

    def step(s, g):
      return s.apply_gradients(grads=g)

  compiled = jax.jit(step, donate_argnums=0).lower(state, leaves()).compile()
  copies = len(re.findall(r"f32\[64,64\]\{1,0\} copy\(", compiled.as_text()))
  return compiled.memory_analysis().temp_size_in_bytes, copies


@pytest.mark.parametrize("n", [8, 32])
def test_select_mode_updates_the_moments_in_place(n):
  # Selected only at the end, XLA:CPU recomputed Adam's new moments inside the
  # parameter update after their select had overwritten the donated buffers, so
  # it copied every moment first: 2n leaf copies, temp = two copies of the
  # parameters. Selected as they are made, the moments are written once, in place.
  leaf_bytes = 64 * 64 * 4
  none, _ = _donated("none", n)
  cond, _ = _donated("cond", n)
  select, copies = _donated("select", n)
  assert copies == 0
  # The bound (no-scaler step + one float32 gradient copy), and no worse than cond.
  assert select <= none + n * leaf_bytes // 2, (select, none)
  assert select <= cond + leaf_bytes, (select, cond)


@functools.cache
def _dense_step(mode):
  """A float16 linear layer's TrainState step, compiled with the state donated (the
  kernel's gradient is a transpose), and a maker of fresh states for it. Cached: both
  tests below run the one compiled program (the tx is static in the state)."""
  tx = optax.chain(dynamic_scale(init_scale=16.0, skip_mode=mode), optax.adam(1e-3))

  def fresh():
    params = {"w": jnp.asarray(np.full((256, 128), 0.01, np.float32))}
    return TrainState.create(apply_fn=None, params=params, tx=tx)

  def step(state, x):
    def loss(p):
      y = x.astype(jnp.float16) @ p["w"].astype(jnp.float16)
      return jnp.sum(jnp.tanh(y).astype(jnp.float32)) * state.loss_scale

    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  x = jnp.asarray(np.ones((32, 256), np.float32))
  return jax.jit(step, donate_argnums=0).lower(fresh(), x).compile(), fresh


@pytest.mark.parametrize("mode", ["cond", "select"])
def test_a_kernel_gradient_is_transposed_once(mode):
  # JAX makes w's gradient as transpose(dot_general(...)) and XLA:CPU keeps the dot's
  # layout: Adam then transposed it inside each moment update, the check copied its
  # predicate into the logical order, and a conditional copied every such operand back
  # inside its branch (x1.5-1.9 per step from 64 leaves). Laid out row-major once, by
  # the kernel that makes it, every reader reads it in order.
  compiled, _ = _dense_step(mode)
  text = compiled.as_text()
  transposes = re.findall(r"(?:pred|f32)\[(?:256,128|128,256)\]\{[01],[01]\} transpose\(", text)
  assert len(transposes) == 1, transposes


@pytest.mark.parametrize("mode", ["cond", "select"])
def test_an_inf_in_one_element_of_a_transposed_gradient_skips_the_step(mode):
  step, fresh = _dense_step(mode)
  state = jax.device_get(fresh())  # host copies to compare with: the step donates its input
  x = np.ones((32, 256), np.float32)
  x[3, 7] = np.inf  # row 7 of w's gradient
  after = step(fresh(), jnp.asarray(x))
  assert int(after.step) == 0 and float(after.loss_scale) < float(state.loss_scale)
  assert np.array_equal(after.params["w"], state.params["w"])
  after = step(fresh(), jnp.asarray(np.ones((32, 256), np.float32)))
  assert int(after.step) == 1 and not np.array_equal(after.params["w"], state.params["w"])


def test_the_chain_is_traced_once_per_step():
  calls = []

  def counting():
    def update(u, s, p=None):
      calls.append(1)
      return u, s

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

  for mode in ("cond", "select"):
    calls.clear()
    tx = optax.chain(dynamic_scale(skip_mode=mode), counting(), optax.sgd(0.1))
    state = TrainState.create(apply_fn=None, params=_params(2), tx=tx)
    jax.jit(lambda s, g: s.apply_gradients(grads=g)).lower(state, _params(2))
    assert len(calls) == 1, mode


@pytest.mark.slow
@pytest.mark.runs("bench_sweep")
def test_bench_sweep_quick_prints_every_variant():
  out = output("bench_sweep")
  tables = re.split(r"\n## ", out)[1:]
  assert [t.split(":")[0] for t in tables] == ["mlp8", "gpt"]
  expected = ["none", "ts_cond", "ts_select", "ts_select16", "skip", "accumulate", "aif", "bare"]
  for table in tables:
    lines = table.splitlines()
    header = next(ln for ln in lines if ln.startswith("variant")).split()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("---")) + 1
    rows = {ln.split()[0]: ln.split() for ln in lines[start:] if ln.strip()}
    assert list(rows) == expected
    conds = header.index("conds") - 1  # "comp s" is two words in the header
    for name, row in rows.items():
      assert float(row[1]) > 0 and float(row[2]) > 0, row
      assert "yes" in row, row  # every timed step was finite
      if name not in ("none", "bare"):
        assert row[-1] == "kept", row
    assert rows["ts_cond"][conds] == "1" and rows["ts_select"][conds] == "0"


@pytest.mark.slow
@pytest.mark.runs("bench_sweep_codegen")
def test_bench_sweep_codegen_reads_the_kernels_xla_compiled():
  out = output("bench_sweep_codegen")
  lines = out.splitlines()
  start = next(i for i, ln in enumerate(lines) if ln.startswith("---")) + 1
  rows = {ln.split()[0]: ln.split() for ln in lines[start:] if ln.strip()}
  assert list(rows) == ["none", "ts_select"], out
  kernels = {v: int(row[1]) for v, row in rows.items()}  # "not read" would fail here
  # The scaler's check and state updates are kernels the step without a scaler lacks.
  assert 0 < kernels["none"] < kernels["ts_select"], out
  assert all(float(row[-1]) > 0 for row in rows.values()), out
