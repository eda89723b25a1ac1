"""jmp_scaler with equinox modules, as they are (docs/equinox.md).

* ``jmp_scaler.value_and_grad`` differentiates the inexact array leaves only, as
  ``eqx.filter_value_and_grad`` does: the same gradient tree (``None`` where equinox puts
  ``None``), times the scale, bit for bit; Python ints, strings, functions, integer arrays
  and PRNG keys pass through; ``has_aux`` returns an ``eqx.nn.State`` untouched; no
  equinox import in the library (a plain pytree with static leaves works the same);
* models shaped like equinox's ``train_rnn`` (a GRU cell in ``lax.scan`` on a module with an
  int field) and ``stateful`` (BatchNorm and SpectralNorm with ``eqx.nn.State`` under
  ``vmap(axis_name="batch")``) train in float16 under ``autocast`` with
  ``jmp_scaler.value_and_grad`` to float32's loss; a skipped step keeps the parameters and
  the state bit for bit;
* docs/equinox.md's code runs, and is what trains the two models, in float32 and float16.
"""

import contextlib
import functools
import io
import math
import pathlib
import re
import tempfile
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import jmp_scaler

ROOT = pathlib.Path(__file__).resolve().parents[1]
F32, F16 = "p=f32,c=f32,o=f32", "p=f32,c=f16,o=f32"
SCALE = 1024.0  # a power of two: the scaled gradients are equinox's times it, exactly


def _bits(tree):
  return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def _opt_state(params, scale=SCALE):
  tx = jmp_scaler.skip_nonfinite(optax.chain(jmp_scaler.dynamic_scale(scale), optax.sgd(0.1)))
  return tx, tx.init(params)


# ---------------------------------------------------------------- the gradient tree


class Odd(eqx.Module):
  """Every kind of leaf an equinox module holds."""

  hidden_size: int
  axis_name: str
  activation: Any  # a function (a custom_jvp: jax.nn.relu)
  mlp: eqx.nn.MLP  # ints, bools and jax.nn.relu inside
  steps: jax.Array  # an int32 array
  key: jax.Array  # a PRNG key
  rate: float  # a Python float: a constant, as in equinox
  table: np.ndarray  # a NumPy float array: differentiated
  nothing: None
  w: jax.Array

  def __call__(self, x):
    h = self.activation(self.mlp(x[: self.hidden_size] * self.table) + 2.0)
    noise = jr.normal(self.key, h.shape) * 0.0
    return jnp.sum((h + noise) * self.w) * self.rate + jnp.sum(self.steps) * 0.0


def _odd():
  return Odd(hidden_size=3, axis_name="batch", activation=jax.nn.relu,
             mlp=eqx.nn.MLP(3, 2, 5, 1, activation=jax.nn.relu, key=jr.key(0)),
             steps=jnp.arange(4), key=jr.key(1), rate=0.5,
             table=np.linspace(0.5, 1.5, 3).astype(np.float32), nothing=None,
             w=jnp.asarray([1.0, -2.0], jnp.float32))


X = jnp.asarray([0.3, -0.2, 0.9, 0.4], jnp.float32)


@eqx.filter_jit
def _both(model, opt_state, x):
  f = lambda m, x: m(x)  # noqa: E731
  return jmp_scaler.value_and_grad(f, opt_state)(model, x), eqx.filter_value_and_grad(f)(model, x)


def test_the_gradient_tree_is_equinoxs_times_the_scale():
  model = _odd()
  _, opt_state = _opt_state(eqx.filter(model, eqx.is_inexact_array))
  (loss, grads), (want_loss, want_grads) = _both(model, opt_state, X)
  assert loss.dtype == np.float32 and _bits(loss) == _bits(want_loss)  # unscaled
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  assert _bits(grads) == _bits(jax.tree.map(lambda g: g * SCALE, want_grads))
  for field in ("hidden_size", "axis_name", "activation", "steps", "key", "rate", "nothing"):
    assert getattr(grads, field) is None and getattr(want_grads, field) is None, field
  assert grads.table.shape == (3,) and grads.mlp.activation is None
  assert float(jnp.abs(grads.w).sum()) > 0 and float(jnp.abs(grads.table).sum()) > 0


def test_jax_value_and_grad_refuses_a_module_that_value_and_grad_takes():
  # What jmp_scaler.value_and_grad did before: jax.grad of every leaf.
  with pytest.raises(TypeError, match="valid JAX type|real- or complex-valued"):
    jax.value_and_grad(lambda m: m(X))(_odd())


class Config(NamedTuple):  # a plain pytree: no equinox involved
  name: str
  depth: int
  scale: jax.Array
  fn: Any


def test_any_pytree_with_static_leaves_and_argnums():
  tx, opt_state = _opt_state({"w": jnp.ones(2)})
  cfg = Config("relu", 2, jnp.float32(3.0), jnp.tanh)

  def f(params, config, x):
    h = config.fn(x * params["w"] * config.scale) ** config.depth
    return jnp.sum(h) * (1.0 if config.name == "relu" else 2.0)

  params = {"w": jnp.asarray([0.5, -1.0]), "n": 3, "ids": jnp.arange(2)}
  loss, (g_params, g_cfg) = jmp_scaler.value_and_grad(f, opt_state, argnums=(0, 1))(
      params, cfg, jnp.ones(2))
  want = jax.grad(lambda w, s: f({**params, "w": w}, cfg._replace(scale=s), jnp.ones(2)),
                  argnums=(0, 1))(params["w"], cfg.scale)
  assert float(loss) == float(f(params, cfg, jnp.ones(2)))
  assert g_params["n"] is None and g_params["ids"] is None
  assert (g_cfg.name, g_cfg.depth, g_cfg.fn) == (None, None, None)
  np.testing.assert_array_equal(g_params["w"], want[0] * SCALE)
  np.testing.assert_array_equal(g_cfg.scale, want[1] * SCALE)
  with pytest.raises(ValueError, match="argnums must name each argument once"):
    jmp_scaler.value_and_grad(f, opt_state, argnums=(0, 0))


def test_the_library_does_not_import_equinox():
  package = pathlib.Path(jmp_scaler.__file__).parent  # the source tree, or an installed wheel
  sources = "".join(p.read_text() for p in package.rglob("*.py"))
  assert not re.search(r"^\s*(import equinox|from equinox)", sources, re.M)


# ---------------------------------------------------------------- docs/equinox.md, trained


@functools.cache
def _docs(spec):
  """docs/equinox.md's two complete blocks, each run in a namespace of its own (as
  tests/_subprocess.py runs the migration guide's), under the policy ``spec``; and what
  they printed. The tests below train the models with the docs' own ``make_step``."""
  text = (ROOT / "docs" / "equinox.md").read_text()
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
            if b.startswith("import ")]
  assert len(blocks) == 2
  spaces, out = [], io.StringIO()
  with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp), \
       contextlib.redirect_stdout(out):
    for block in blocks:
      assert block.count(f'"{F16}"') == 1  # the one line that sets the precision
      namespace = {}
      exec(compile(block.replace(f'"{F16}"', f'"{spec}"'), "docs/equinox.md", "exec"),  # noqa: S102
           namespace)
      spaces.append(namespace)
    saved = (pathlib.Path(tmp) / "equinox_checkpoint.eqx").stat().st_size
  return spaces, out.getvalue(), saved


def test_the_docs_code_runs():
  (rnn, stateful), out, saved = _docs(F16)
  assert re.findall(r"^step (\d): loss [\d.]+, scale \d+, skipped [01]$", out, re.M) == \
      ["0", "1", "2"]
  assert saved > 0  # the checkpoint, restored and checked inside the block
  assert stateful["policy"].compute_dtype == jnp.float16 and rnn["policy"] == stateful["policy"]


def _spirals(n, seed=0):
  """train_rnn's data (clockwise 1, anticlockwise 0), shuffled, made with NumPy."""
  rng = np.random.default_rng(seed)
  t = np.linspace(0, 2 * math.pi, 16, dtype=np.float32)
  offset = rng.uniform(0, 2 * math.pi, (n, 1)).astype(np.float32)
  x1, x2 = np.sin(t + offset) / (1 + t), np.cos(t + offset) / (1 + t)
  y = np.ones((n, 1), np.float32)
  x1[: n // 2] *= -1
  y[: n // 2] = 0
  perm = rng.permutation(n)
  return np.stack([x1, x2], axis=-1)[perm], y[perm]


RNN_STEPS, RNN_BATCH = 200, 32


@functools.cache
def _train_rnn(spec):
  """equinox's train_rnn (a GRU cell in lax.scan, an int field) with the docs' make_step."""
  ns = _docs(spec)[0][0]
  xs, ys = _spirals(RNN_STEPS * RNN_BATCH)
  model = ns["RNN"](in_size=2, out_size=1, hidden_size=16, key=jr.key(5678))
  opt_state = ns["tx"].init(eqx.filter(model, eqx.is_inexact_array))
  losses, skipped = [], []
  for x, y in zip(xs.reshape(RNN_STEPS, RNN_BATCH, 16, 2), ys.reshape(RNN_STEPS, RNN_BATCH, 1),
                  strict=True):
    model, opt_state, loss = ns["make_step"](model, opt_state, x, y)
    losses.append(loss)
    skipped.append(jmp_scaler.scale_metrics(opt_state)["skipped"])
  params, static = eqx.partition(model, eqx.is_inexact_array)
  jaxpr = jax.make_jaxpr(lambda p, x: ns["forward"](eqx.combine(p, static), x))(params, xs[:2])
  dots = re.findall(r"(\w+)\[[\d,]*\] = dot_general", str(jaxpr))
  return np.array([float(x) for x in losses]), np.array([bool(x) for x in skipped]), dots


def test_train_rnn_in_float16_reaches_float32s_loss():
  l32, skipped32, dots32 = _train_rnn(F32)
  l16, skipped16, dots16 = _train_rnn(F16)
  assert set(dots16) == {"f16"} and set(dots32) == {"f32"}  # every GRU and Linear matmul
  assert len(dots16) >= 3
  assert l32[0] > 0.6 and l32[-20:].mean() < 0.005  # it learns: from 0.69 to about 0.0013
  assert abs(l16[-20:].mean() - l32[-20:].mean()) < 0.01 * l32[-20:].mean()  # within 1%
  np.testing.assert_allclose(l16[:100], l32[:100], rtol=0.01)  # the plateau, step by step
  assert not skipped32.any() and skipped16.sum() <= 2  # at most the scale's calibration


STATEFUL_STEPS, BAD_STEP = 60, 20


@functools.cache
def _train_stateful(spec):
  """equinox's stateful example (BatchNorm, SpectralNorm, eqx.nn.State under
  vmap(axis_name="batch")) with the docs' make_step; an inf batch at BAD_STEP."""
  ns = _docs(spec)[0][1]
  model, state = eqx.nn.make_with_state(ns["Model"])(jr.key(5678))
  opt_state = ns["tx"].init(eqx.filter(model, eqx.is_inexact_array))
  xs, ys = ns["xs"], ns["ys"]  # the example's full batch of 10
  bad = xs.at[0, 0].set(jnp.inf)
  losses, skipped, history = [], [], [(eqx.filter(model, eqx.is_inexact_array), state)]
  for i in range(STATEFUL_STEPS):
    model, state, opt_state, loss = ns["make_step"](
        model, state, opt_state, bad if i == BAD_STEP else xs, ys)
    losses.append(loss)
    skipped.append(jmp_scaler.scale_metrics(opt_state)["skipped"])
    history.append((eqx.filter(model, eqx.is_inexact_array), state))
  return np.array([float(x) for x in losses]), np.array([bool(x) for x in skipped]), history


def test_stateful_in_float16_reaches_float32s_loss():
  l32, skipped32, _ = _train_stateful(F32)
  l16, skipped16, _ = _train_stateful(F16)
  assert skipped32.nonzero()[0].tolist() == [BAD_STEP]
  assert BAD_STEP in skipped16.nonzero()[0] and skipped16.sum() <= 3  # and calibration
  # It learns: from 1.57 to about 0.0007 (the mean of the last 10 steps), 2000 times less.
  # Near the end Adam's loss oscillates (x3 over ~10 steps), and float16's oscillation is
  # out of phase with float32's (and moves with the XLA and equinox versions), so the two
  # are compared on that scale: the same thousandfold fall, within a factor of 1.5.
  assert l32[0] > 1.0 and l16[0] > 1.0 and l32[-10:].mean() < 0.002
  assert 1 / 1.5 < l16[-10:].mean() / l32[-10:].mean() < 1.5


@pytest.mark.parametrize("spec", [F32, F16])
def test_a_skipped_step_keeps_the_parameters_and_the_state_bit_for_bit(spec):
  _, skipped, history = _train_stateful(spec)
  for i in np.nonzero(skipped)[0]:  # history[i + 1] is after step i
    assert _bits(history[i + 1]) == _bits(history[i])  # parameters, BatchNorm, SpectralNorm
  assert _bits(history[BAD_STEP + 2][1]) != _bits(history[BAD_STEP + 1][1])  # the control


def test_has_aux_returns_the_state_untouched():
  ns = _docs(F16)[0][1]
  model, state = eqx.nn.make_with_state(ns["Model"])(jr.key(5678))

  @eqx.filter_jit
  def both(model, state, xs, ys):
    opt_state = ns["tx"].init(eqx.filter(model, eqx.is_inexact_array))
    got = jmp_scaler.value_and_grad(ns["loss_fn"], opt_state, has_aux=True)(
        model, state, xs, ys)[0]
    return got, ns["loss_fn"](model, state, xs, ys)

  (loss, new_state), (want_loss, want_state) = both(model, state, ns["xs"], ns["ys"])
  assert type(new_state) is eqx.nn.State
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert _bits(new_state) == _bits(want_state) and _bits(loss) == _bits(want_loss)
  assert _bits(new_state) != _bits(state)  # the forward pass did update it
