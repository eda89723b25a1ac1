"""``jmp_scaler.full_precision`` around flax modules: a linen submodule inside ``nn.compact``
(``init`` gives the plain module's variables, real arrays; ``apply``, mutable collections and
gradients as the plain module's; its matmul the only float32 one under ``autocast``), an NNX
module (its state through the region, the changes written back, under ``nnx.jit`` and
``nnx.value_and_grad``), the cases refused with the scoped rule to use instead, and the advice
of the docs on what keeps a layer in float32 under autocast."""

import functools
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

import jmp_scaler

ROOT = pathlib.Path(__file__).resolve().parents[1]
POLICY = "p=f32,c=f16,o=f32"
SCOPED_HEAD = """rules={("dot_general", r"head"): "float32"}"""
fp = jmp_scaler.full_precision


def dots(closed, region=None, out=None):
  """``[(region, lhs dtype, rhs dtype)]`` of every ``dot_general`` of a jaxpr, sub-jaxprs
  included; ``region`` is the name of the innermost full-precision region around it."""
  out = [] if out is None else out
  for eqn in getattr(closed, "jaxpr", closed).eqns:
    if eqn.primitive.name == "dot_general":
      out.append((region, *(str(v.aval.dtype) for v in eqn.invars)))
    name = str(eqn.params.get("name", ""))
    inner = name if name.startswith("jmp_full_precision") else region
    for sub in jaxprs_in_params(eqn.params):
      dots(sub, inner, out)
  return out


def concrete(tree):
  """Whether every leaf is a real array (no tracer of a finished trace)."""
  return all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
             for x in jax.tree.leaves(tree))  # fmt: skip


def assert_close(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


# ------------------------------------------------------------------------------- linen


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, *, train):
    x = nn.BatchNorm(use_running_average=not train)(x)
    self.sow("intermediates", "h", x)
    return nn.Dense(8)(x)


class Model(nn.Module):
  """A body, a region around an unnamed block (batch statistics, sow, a keyword flag), one
  around a named head, one around a setup submodule's method (a tied output layer)."""

  wrap: bool = True

  def setup(self):
    self.embed = nn.Embed(10, 8)

  @nn.compact
  def __call__(self, ids, train=False):
    w = fp if self.wrap else (lambda m: m)
    x = nn.Dense(8)(self.embed(ids))
    x = w(Block())(x, train=train)
    x = nn.relu(w(nn.Dense(8, name="head"))(x))
    return w(self.embed.attend)(x)


IDS = jnp.arange(6) % 10


@pytest.fixture(scope="module")
def linen():
  return {wrap: Model(wrap).init(jax.random.key(0), IDS) for wrap in (True, False)}


def test_linen_init_gives_the_plain_models_variables_as_real_arrays(linen):
  wrapped, plain = linen[True], linen[False]
  assert concrete(wrapped)
  assert jax.tree_util.tree_structure(wrapped) == jax.tree_util.tree_structure(plain)
  assert set(wrapped["params"]) == {"embed", "Dense_0", "Block_0", "head"}
  jax.tree.map(np.testing.assert_array_equal, wrapped, plain)  # values too: init runs it plain


def test_linen_apply_collections_and_gradients_are_the_plain_models(linen):
  v = linen[True]
  runs = {}
  for wrap in (True, False):
    model = Model(wrap)

    @jax.jit
    def run(v, model=model):
      y, updates = model.apply(v, IDS, train=True, mutable=["batch_stats", "intermediates"])
      loss = lambda p: jnp.sum(model.apply({**v, "params": p}, IDS) ** 2)
      return y, updates, jax.grad(loss)(v["params"])

    runs[wrap] = run(v)
  assert concrete(runs[True])
  assert set(runs[True][1]) == {"batch_stats", "intermediates"}
  assert_close(runs[True], runs[False])
  assert any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(runs[True][2]["head"]))


def test_linen_under_autocast_only_the_regions_matmuls_run_in_float32(linen):
  v = linen[True]
  closed = jax.make_jaxpr(jmp_scaler.autocast(Model().apply, POLICY))(v, IDS)
  found = dots(closed)
  assert {d for d in found if d[0] is None} == {(None, "float16", "float16")}  # Dense_0
  assert {d for d in found if d[0] is not None} == {
    ("jmp_full_precision(Block)", "float32", "float32"),
    ("jmp_full_precision(Dense)", "float32", "float32"),
    ("jmp_full_precision(Embed.attend)", "float32", "float32"),
  }
  # ... and runs, differentiably, with the result the autocast function gives
  loss = lambda p: jnp.sum(jmp_scaler.autocast(Model().apply, POLICY)({**v, "params": p}, IDS))
  assert concrete(jax.grad(loss)(v["params"]))


def test_linen_random_streams_pass_through_a_region():
  class Dropped(nn.Module):
    @nn.compact
    def __call__(self, x):
      return fp(nn.Dropout(0.5, deterministic=False))(fp(nn.Dense(16, name="head"))(x))

  x = jnp.ones((4, 16))
  v = Dropped().init(jax.random.key(0), x)
  apply = jmp_scaler.autocast(Dropped().apply, POLICY)
  a = apply(v, x, rngs={"dropout": jax.random.key(1)})
  b = apply(v, x, rngs={"dropout": jax.random.key(2)})
  assert bool(jnp.any(a == 0)) and bool(jnp.any(a != 0)) and not bool(jnp.all((a == 0) == (b == 0)))


# --------------------------------------------------------------------------------- NNX


class Net(nnx.Module):
  """A body, then regions around a BatchNorm (training statistics), a Dropout (an nnx.Rngs
  count) and the head."""

  def __init__(self, rngs, wrap=True):
    self.body = nnx.Linear(4, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)
    self.wrap = wrap

  def __call__(self, x):
    w = fp if self.wrap else (lambda m: m)
    return w(self.head)(w(self.drop)(w(self.bn)(nnx.relu(self.body(x)))))


X = jax.random.normal(jax.random.key(3), (5, 4))


def test_nnx_under_jit_and_value_and_grad_as_the_plain_module():
  runs = {}
  for wrap in (True, False):
    net = Net(nnx.Rngs(0, dropout=1), wrap)

    @nnx.jit
    def step(net):
      return nnx.value_and_grad(lambda n: jnp.sum(n(X) ** 2))(net)

    first, second = step(net), step(net)  # the statistics and the count move between them
    runs[wrap] = (first, second, nnx.state(net, nnx.BatchStat), net.drop.rngs.count[...])
  assert concrete(runs[True][:2]) and concrete(nnx.state(Net(nnx.Rngs(0)), nnx.Param))
  assert int(runs[True][3]) == 2
  assert_close(runs[True], runs[False])
  assert not bool(jnp.all(runs[True][2]["bn"]["mean"][...] == 0))


def test_nnx_under_autocast_the_regions_matmul_runs_in_float32():
  net = Net(nnx.Rngs(0, dropout=1))
  net.eval()
  graphdef, state = nnx.split(net)
  forward = jmp_scaler.autocast(lambda s, x: nnx.merge(graphdef, s)(x), POLICY)
  assert dots(jax.make_jaxpr(forward)(state, X)) == [
    (None, "float16", "float16"), ("jmp_full_precision(Linear)", "float32", "float32")]
  plain = nnx.merge(graphdef, state)
  plain.wrap = False
  np.testing.assert_allclose(forward(state, X), plain(X), rtol=1e-2, atol=1e-2)


def test_nnx_objects_among_the_arguments_are_updated():
  drop, bn = nnx.Dropout(0.5), nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  rngs, again = nnx.Rngs(dropout=0), nnx.Rngs(dropout=0)
  x = jnp.ones((2, 4))
  a, b = fp(drop)(x, rngs=rngs), fp(drop)(x, rngs=rngs)
  assert int(rngs.dropout.count[...]) == 2  # two masks drawn, the plain module's two
  np.testing.assert_array_equal(a, drop(x, rngs=again))
  np.testing.assert_array_equal(b, drop(x, rngs=again))
  fp(lambda m, h: m(h))(bn, 3.0 * x)  # a function given a module: its statistics move
  np.testing.assert_allclose(bn.mean[...], jnp.full((4,), 0.03), rtol=1e-6)
  assert fp(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))(x.astype(jnp.float16)).dtype == jnp.float32


# ----------------------------------------------------------------------------- refused


class Refused(nn.Module):
  kind: str

  @nn.compact
  def __call__(self, x):
    head = nn.Dense(3, name="head")
    if self.kind == "closure":
      return fp(lambda h: head(h))(x)
    if self.kind == "partial":
      return fp(functools.partial(lambda m, h: m(h), head))(x)
    return fp(lambda m, h: m(h))(head, x)  # "argument"


class Unassigned(nn.Module):
  def setup(self):
    self.head = fp(nn.Dense(3))

  def __call__(self, x):
    return self.head(x)


@pytest.mark.parametrize("kind", ["closure", "partial", "argument"])
def test_a_function_around_a_linen_submodule_is_refused_with_the_scoped_rule(kind):
  with pytest.raises(ValueError, match="flax linen module 'head'") as e:
    Refused(kind).init(jax.random.key(0), jnp.ones((1, 2)))
  assert SCOPED_HEAD in str(e.value) and "full_precision(self.head)(x)" in str(e.value)


def test_an_unbound_linen_module_is_refused_at_construction():
  with pytest.raises(ValueError, match=r"not bound to a parent.*full_precision\(model.apply\)"):
    fp(nn.Dense(3))
  with pytest.raises(ValueError, match=r"created in setup without being assigned.*scoped rule"):
    Unassigned().init(jax.random.key(0), jnp.ones((1, 2)))


# ------------------------------------------------------------------ what the docs advise


class Float32Head(nn.Module):
  how: str

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    if self.how == "dtype":
      return nn.Dense(4, dtype=jnp.float32, name="head")(x)
    head = nn.Dense(4, name="head")
    return fp(head)(x) if self.how == "full_precision" else head(x)


@pytest.mark.parametrize("how,rules,head_dtype", [
  ("dtype", None, "float16"),  # an explicit float32 dtype is not exempt: torch.autocast's way
  ("plain", {("dot_general", r"head"): "float32"}, "float32"),
  ("full_precision", None, "float32"),
])  # fmt: skip
def test_what_keeps_a_layer_in_float32_under_autocast_is_what_the_docs_say(how, rules, head_dtype):
  model, x = Float32Head(how), jnp.ones((2, 4))
  v = model.init(jax.random.key(0), x)
  found = dots(jax.make_jaxpr(jmp_scaler.autocast(model.apply, POLICY, rules=rules))(v, x))
  assert len(found) == 2 and found[0][1:] == ("float16", "float16")
  assert found[1][1:] == (head_dtype, head_dtype)
  diagnostics = " ".join((ROOT / "docs/diagnostics.md").read_text().split())
  assert (f"under `jmp_scaler.autocast`: a scoped rule `{SCOPED_HEAD}` or "
          "`jmp_scaler.full_precision(...)` around the module; `dtype=jnp.float32` on the module "
          "only without autocast") in diagnostics  # fmt: skip
  autocast_md = " ".join((ROOT / "docs/autocast.md").read_text().split())
  assert "`dtype=jnp.float32` alone does not keep a layer in float32 under autocast" in autocast_md
