"""jmp_scaler.compare_precision: the float32 baseline, layer by layer (issue 37).

A model with one deliberately fragile layer (its weights shifted by 1000 before a float16
matmul and the shift subtracted after: float16 rounds the weights away) must be named as the
layer where the error jumps; flax linen module paths, NNX and equinox attribute paths and the
user's lines name the layers; the gradient columns are the half run's against float32's.
"""

import functools
import pathlib
import re
import runpy
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jmp_scaler
from jmp_scaler.diagnostics import _compare

F16, F32 = jnp.float16, jnp.float32
POLICY = "p=f32,c=f16,o=f32"
HERE = pathlib.Path(__file__).resolve()
LINES = HERE.read_text().splitlines()


class Fragile(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.1), (x.shape[-1], x.shape[-1]))
    return x @ (w + 1000.0) - jnp.sum(x, -1, keepdims=True) * 1000.0  # w + 1000: w is lost


class Net(nn.Module):
  fragile: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, name="embed")(x))
    if self.fragile:
      x = Fragile(name="fragile")(x)
    x = nn.relu(nn.Dense(16, name="hidden")(x))
    return nn.Dense(4, name="head")(x)


X = jax.random.normal(jax.random.key(1), (8, 8))


def linen_loss(params, x, fragile=True):
  return jnp.mean(Net(fragile).apply(params, x) ** 2)


@pytest.fixture(scope="module")
def fragile_report():
  params = Net().init(jax.random.key(0), X)
  return jmp_scaler.compare_precision(linen_loss, params, X, policy=POLICY)


def test_the_fragile_layer_is_where_the_error_jumps(fragile_report):
  r = fragile_report
  assert r.jump == "fragile"
  names = [row.name for row in r.layers]
  assert {"embed", "fragile", "hidden", "head"} <= set(names)
  assert "Net" not in names  # nn.relu's body repeats the name stack around it: not a layer
  assert names.index("embed") < names.index("fragile") < names.index("hidden")
  embed, fragile = r.layer("embed"), r.layer("fragile")
  assert embed.activation_error < 3e-3  # float16's rounding, no more
  assert fragile.activation_error > 100 * embed.activation_error
  assert fragile.gradient_error is not None and fragile.size == 16 * 16
  assert r.layer("head").gradient_error > 0.1  # the damage reaches the gradients downstream
  assert r.policy == POLICY and r.dtype == "float16" and r.scale == 1.0
  assert abs(r.loss - float(linen_loss(Net().init(jax.random.key(0), X), X))) < 1e-5
  text = str(r)
  row = next(line for line in text.splitlines() if line.strip().startswith("fragile"))
  assert row.endswith("<- the error jumps here") and "first jump: fragile" in text
  with pytest.raises(KeyError, match="no layer 'nope'"):
    r.layer("nope")


def test_without_the_fragile_layer_no_error_jumps():
  params = Net(False).init(jax.random.key(0), X)
  r = jmp_scaler.compare_precision(linen_loss, params, X, False, policy=POLICY)
  assert r.jump is None and "no layer's error jumps" in str(r)
  assert all(row.activation_error < 1e-2 for row in r.layers)
  assert all(row.gradient_error < 1e-2 for row in r.layers if row.gradient_error is not None)


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.fc2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.relu(self.fc1(x)))


def nnx_loss(model, x):
  return jnp.mean(model(x) ** 2)


def test_nnx_attribute_paths_and_the_underflow_at_a_small_scale():
  model = NNXNet(nnx.Rngs(0))
  r = jmp_scaler.compare_precision(nnx_loss, model, X, policy=POLICY, scale=2.0**-30)
  fc1, fc2 = r.layer("fc1"), r.layer("fc2")
  assert fc1.size == 8 * 16 + 16 and fc2.size == 16 * 4 + 4
  # At scale 2^-30 the float32 gradients (1e-4 to 1e-1) are below float16's 6e-8: they flush
  # to 0, and the half run's gradients are lost with them.
  assert fc1.underflow > 0.9 and fc2.underflow > 0.9
  assert fc1.gradient_error > 0.9
  assert type(model.fc1) is nnx.Linear  # the model itself is left as it was
  r1 = jmp_scaler.compare_precision(nnx_loss, model, X, policy=POLICY)
  assert r1.layer("fc1").underflow == 0.0 and r1.layer("fc1").gradient_error < 1e-2


def test_equinox_attribute_paths():
  eqx = pytest.importorskip("equinox")

  class Stack(eqx.Module):
    layers: list

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.layers = [eqx.nn.Linear(8, 16, key=k1), eqx.nn.Linear(16, 4, key=k2)]

    def __call__(self, x):
      for layer in self.layers:
        x = jnp.tanh(layer(x))
      return x

  model = Stack(jax.random.key(0))
  r = jmp_scaler.compare_precision(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), model, X,
                                   policy=POLICY)  # fmt: skip
  assert r.layer("layers.0").size == 8 * 16 + 16 and r.layer("layers.1").size == 16 * 4 + 4
  assert r.layer("layers.0").activation_error < 1e-2
  assert type(model.layers[0]) is eqx.nn.Linear


def plain(w, x):
  h = jnp.tanh(x.astype(F16) @ w["a"].astype(F16))  # a float16 layer
  s = h @ (w["b"] + 100.0).astype(F16) - jnp.sum(h, -1, keepdims=True) * 100.0  # cancellation
  return jnp.mean(s.astype(F32) ** 2)


def comment(name):
  """The comment of the line of this file a layer ``name`` ("file:LINE (function)") names."""
  path, _, line = name.partition(" (")[0].rpartition(":")
  assert pathlib.Path(path).resolve() == HERE, name
  return LINES[int(line) - 1].partition("#")[2].strip()


def test_a_plain_function_as_given_names_its_lines():
  w = {"a": jnp.full((8, 4), 0.01), "b": jnp.full((4, 4), 0.01)}  # 100.01 is 100 in float16
  r = jmp_scaler.compare_precision(plain, w, X)  # no policy: fn runs as written
  assert r.policy is None and r.dtype == "float16"
  lines = {comment(row.name): row for row in r.layers}
  assert lines["cancellation"].activation_error > 10 * lines[
    "a float16 layer"].activation_error
  assert comment(r.jump) == "cancellation"


class MLP(nn.Module):  # a plain MLP, float16 where dtype says (else the policy's)
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10, dtype=self.dtype)(nn.relu(nn.Dense(32, dtype=self.dtype)(x)))


def cross_entropy(params, x, y, dtype=None):  # optax gathers the labelled logit
  logits = MLP(dtype).apply(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def scatter_adds(fn, *args):
  jaxpr = jax.make_jaxpr(jax.grad(fn))(*args)
  return [str(e.invars[0].aval.dtype) for e, _ in _compare._flat_eqns(jaxpr)
          if e.primitive.name == "scatter-add"]


@pytest.mark.parametrize("dtype", [None, F16], ids=["autocast", "float16_model"])
def test_the_gradient_of_optax_cross_entropy_s_gather_needs_no_note(dtype):
  # The gather of the labelled logit has a scatter-add for its gradient, an operation with a
  # body of its own (a note once said it "stayed in float16": any such operation was named,
  # whatever its dtype). It is in the gathered logits' dtype: float16 in a float16 model; under
  # the policy float16 (the last bias add is in the matmul's dtype, torch's addmm) where optax
  # gathers the logits themselves (0.2.8), float32 where it gathers them less their max, a
  # float32 subtraction (0.2.5). The float32 run computes it in float32 (lax.scatter_add with
  # its parameters): no note in any case.
  y = jax.random.randint(jax.random.key(2), (8,), 0, 10)
  params = MLP().init(jax.random.key(0), X)
  policy = POLICY if dtype is None else None
  run = functools.partial(cross_entropy, dtype=dtype)
  fn = jmp_scaler.autocast(run, POLICY) if dtype is None else run
  gathered = {str(e.invars[0].aval.dtype) for e, _ in _compare._flat_eqns(
      jax.make_jaxpr(fn)(params, X, y)) if e.primitive.name == "gather"}  # fmt: skip
  half = scatter_adds(fn, params, X, y)
  assert len(half) == 2 and set(half) == gathered, (half, gathered)
  assert dtype is None or half == ["float16"] * 2
  r = jmp_scaler.compare_precision(run, params, X, y, policy=policy)
  assert r.note == "" and "note:" not in str(r), str(r)
  assert r.jump is None and {"Dense_0", "Dense_1"} <= {row.name for row in r.layers}
  assert "MLP" not in {row.name for row in r.layers}  # nn.relu's max: the line, not the root
  assert abs(r.loss - float(cross_entropy(params, X, y))) < 1e-6


def embedding_sum(table, ids):
  return jnp.sum(table.astype(F16)[ids].astype(F32))  # the gradient: a float16 scatter-add


def test_the_float32_run_sums_a_scatter_add_in_float32():
  # 4096 lookups of one row: float16 sums their gradient to 2048 (2049 is not a float16), the
  # float32 run to 4096, so the half run's gradient is half of float32's.
  table, ids = jnp.ones((4, 2)), jnp.zeros(4096, jnp.int32)
  assert scatter_adds(embedding_sum, table, ids) == ["float16"]
  r = jmp_scaler.compare_precision(embedding_sum, table, ids)
  assert r.note == "" and r.layers[0].gradient_error == pytest.approx(0.5)


def custom_reduction(w, x):
  s = lax.reduce(x.astype(F16), np.float16(0), lambda a, b: a + b * b, (0,))  # its own body
  return jnp.mean(w * s.astype(F32))


def test_an_operation_that_stays_in_half_precision_is_named_by_its_line():
  r = jmp_scaler.compare_precision(custom_reduction, jnp.ones(3), jnp.ones((5, 3)))
  m = re.fullmatch(r"in the float32 run, the reduce at (.*) stayed in float16: an operation with "
                   r"a body of its own \(a custom reduction\) computes in its own dtype, so the "
                   r"float32 run rounds there as the half run does", r.note)  # fmt: skip
  assert m and comment(m.group(1)) == "its own body", r.note
  assert "\nnote: in the float32 run, the reduce at" in str(r)


def test_bad_input_is_refused_at_the_call():
  w = {"a": jnp.ones((8, 4)), "b": jnp.ones((4, 4))}
  with pytest.raises(ValueError, match="fn must be callable, got 3"):
    jmp_scaler.compare_precision(3, w, X)
  with pytest.raises(ValueError, match="policy must be a jmp_scaler.Policy"):
    jmp_scaler.compare_precision(plain, w, X, policy=jnp.float16)
  with pytest.raises(ValueError, match="^scale must be positive"):
    jmp_scaler.compare_precision(plain, w, X, scale=0.0)
  with pytest.raises(ValueError, match="jump_factor must be a number above 1, got 1"):
    jmp_scaler.compare_precision(plain, w, X, jump_factor=1)
  with pytest.raises(ValueError, match="fn must return a floating scalar loss"):
    jmp_scaler.compare_precision(lambda w, x: x @ w["a"], w, X)
  with pytest.raises(ValueError, match="first argument of fn must hold floating arrays"):
    jmp_scaler.compare_precision(lambda n, x: jnp.sum(x), 3, X)
  with pytest.raises(ValueError, match="call it outside jax.jit"):
    jax.jit(lambda x: jmp_scaler.compare_precision(plain, w, x))(X)
  assert np.isfinite(plain(w, X))


# ---------------------------------------------------------------- the example and the benchmark


ROOT = HERE.parents[1]


@pytest.mark.slow
def test_the_example_names_the_shifted_layer_and_plots_it(capsys, tmp_path):
  example = runpy.run_path(str(ROOT / "examples" / "compare_precision.py"))
  assert example["main"](["--steps", "3", "--plot", str(tmp_path / "c.png")]) == 0
  out = capsys.readouterr().out
  assert "first jump: shifted" in out
  assert "with the shifted layer in float32 (jmp_scaler.full_precision): the error jumps at None" \
    in out  # fmt: skip
  assert f"plot: {tmp_path / 'c.png'}" in out and (tmp_path / "c.png").stat().st_size > 1000


@pytest.mark.slow
def test_bench_compare_quick_times_compare_against_the_budget(capsys):
  sys.path.insert(0, str(ROOT / "benchmarks"))
  try:
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_compare.py"))
  finally:
    sys.path.remove(str(ROOT / "benchmarks"))
  assert bench["main"](["--quick", "--models", "cnn"]) == 0
  out = capsys.readouterr().out
  compare = next(line.split() for line in out.splitlines() if line.split()[:1] == ["compare"])
  seconds, to_step, to_budget = map(float, compare[1:])
  assert seconds > 0 and to_step > 0 and 0 < to_budget < 1.5  # within the budget, with noise
  assert re.search(r"CNN: \d+ layers, error jumps at \S+", out), out
