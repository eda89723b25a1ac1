"""Per-module precision for linen and NNX: the dtypes actually used, and training."""

import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

import jmp_scaler
from tests import _xla

F16 = "p=f32,c=f16,o=f32"
BF16 = "p=f32,c=bf16,o=f32"


def _ops(fn, *args):
  """(primitive, input dtypes) of the matmuls, convolutions, exps and reductions."""
  wanted = {"dot_general", "conv_general_dilated", "exp", "reduce_sum"}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in wanted:
        yield eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars)
      for sub in jaxprs_in_params(eqn.params):
        yield from walk(sub)

  closed = jax.make_jaxpr(fn)(*args)
  return list(walk(closed.jaxpr)), closed.out_avals


def _recorder(log):
  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    dtypes = lambda t: {str(x.dtype) for x in jax.tree.leaves(t) if hasattr(x, "dtype")}
    log.append((type(context.module).__name__, dtypes(args), dtypes(out)))
    return out

  return interceptor


# ---------------------------------------------------------------- models


class LinenRes(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    bn = lambda: nn.BatchNorm(use_running_average=not train)
    h = nn.relu(bn()(nn.Conv(8, (3, 3))(x)))
    h = bn()(nn.Conv(8, (3, 3))(h))
    return nn.Dense(4)(nn.relu(h + nn.Conv(8, (1, 1))(x)).mean((1, 2)))


class LinenTransformer(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    del train
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h, h)
    x = x + nn.Dense(8)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(x))))
    return nn.Dense(4)(x.mean(1))


class NNXRes(nnx.Module):
  def __init__(self, rngs):
    self.c1, self.bn1 = nnx.Conv(3, 8, (3, 3), rngs=rngs), nnx.BatchNorm(8, rngs=rngs)
    self.c2, self.bn2 = nnx.Conv(8, 8, (3, 3), rngs=rngs), nnx.BatchNorm(8, rngs=rngs)
    self.proj, self.head = nnx.Conv(3, 8, (1, 1), rngs=rngs), nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    h = self.bn2(self.c2(jax.nn.relu(self.bn1(self.c1(x)))))
    return self.head(jax.nn.relu(h + self.proj(x)).mean((1, 2)))


class NNXTransformer(nnx.Module):
  def __init__(self, rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 8, 8, decode=False, rngs=rngs)
    self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    h = self.ln1(x)
    x = x + self.attn(h, h)
    x = x + self.down(jax.nn.gelu(self.up(self.ln2(x))))
    return self.head(x.mean(1))


_RNG = np.random.default_rng(0)
IMAGES = jnp.asarray(_RNG.normal(size=(8, 6, 6, 3)), jnp.float32)
TOKENS = jnp.asarray(_RNG.normal(size=(8, 5, 8)), jnp.float32)
LABELS = jnp.asarray(_RNG.integers(0, 4, size=8), jnp.int32)


def key(seed):
  """A PRNG key whose ops compile fast (threefry's take seconds on a busy CPU)."""
  return jax.random.key(seed, impl="unsafe_rbg")


# Faster XLA compilation (about half the CPU time) for the jitted programs:
# what is under test is dtypes and training, not LLVM's optimisations.
FAST = _xla.compile_options()
SMALL = nnx.eval_shape(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)))  # abstract: no compile


@functools.cache
def _initial():
  """Every model's initial variables by one jitted program (one compile, not one per model):
  ({linen class name: variables}, {NNX class name: state})."""

  def init():
    with jmp_scaler.autocast_linen(F16):  # the linen models are initialised under the policy
      linen = {cls.__name__: cls().init(key(0), x, train=False)
               for cls, x in ((LinenRes, IMAGES), (LinenTransformer, TOKENS))}  # fmt: skip
    states = {make.__name__: nnx.split(make(nnx.Rngs(key(0))))[1]
              for make in (NNXRes, NNXTransformer)}  # fmt: skip
    return linen, states

  return jax.jit(init, compiler_options=FAST)()


def build(make):
  """A fresh ``make(rngs)`` with the variables of the one init program (arrays copied in)."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(key(0)))))
  return nnx.merge(graphdef, jax.tree.map(lambda a: a, _initial()[1][make.__name__]))


def shape_of(model, fn, *args):
  """The abstract output of ``fn(model, *args)``: dtypes without compiling."""
  graphdef, state = nnx.split(model)
  return jax.eval_shape(lambda s: fn(nnx.merge(graphdef, s), *args), state)


# ---------------------------------------------------------------- linen dtypes


def _linen_variables(model_cls):
  return _initial()[0][model_cls.__name__]


def _transformer_params():
  return _linen_variables(LinenTransformer)


def test_linen_transformer_computes_in_half_with_float32_norms_softmax_and_logits():
  model = LinenTransformer()
  params = _transformer_params()
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  inner, outer = [], []

  def forward(params, x):
    with nn.intercept_methods(_recorder(outer)), jmp_scaler.autocast_linen(F16):
      with nn.intercept_methods(_recorder(inner)):
        return model.apply(params, x)

  ops, outs = _ops(forward, params, TOKENS)
  assert [str(a.dtype) for a in outs] == ["float32"]  # logits in the output dtype
  dots = [dt for name, dt in ops if name == "dot_general"]
  # Projections and MLP in float16; the attention weights (float32 softmax)
  # meet float16 values once, as flax's force_fp32_for_softmax does.
  assert dots.count(("float16", "float16")) == len(dots) - 1
  assert ("float32", "float32") not in dots
  assert {dt for name, dt in ops if name == "exp"} == {("float32",)}
  # Inner view (after the casts): norms get float32, dense layers float16.
  assert ("LayerNorm", {"float32"}, {"float32"}) in inner
  assert ("Dense", {"float16"}, {"float16"}) in inner
  # Outer view: the norms hand float16 back; the model returns float32.
  assert ("LayerNorm", {"float16"}, {"float16"}) in outer
  assert outer[-1] == ("LinenTransformer", {"float32"}, {"float32"})


def test_linen_overrides_scope_mro_and_norm_default():
  model = LinenTransformer()
  params = _transformer_params()

  class MyNorm(nn.LayerNorm):
    pass

  def dots(**kw):
    def forward(params, x):
      with jmp_scaler.autocast_linen(F16, **kw):
        return model.apply(params, x)

    return [dt for name, dt in _ops(forward, params, TOKENS)[0] if name == "dot_general"]

  # Overriding the attention type puts the modules inside it in float32 too.
  attn32 = dots(overrides={nn.MultiHeadDotProductAttention: "f32"})
  assert attn32.count(("float32", "float32")) == 6 and attn32.count(("float16", "float16")) == 3
  assert dots(overrides={nn.Dense: "f32"}).count(("float32", "float32")) == 3
  log = []

  def traced(module, params, **kw):  # the recorder logs while tracing: no compile
    with jmp_scaler.autocast_linen(F16, **kw), nn.intercept_methods(_recorder(log)):
      return jax.eval_shape(lambda: module.apply(params, TOKENS))

  traced(model, params, float32_norms=False)
  assert ("LayerNorm", {"float16"}, {"float16"}) in log
  log.clear()
  out = traced(MyNorm(), {"params": {"scale": jnp.ones(8), "bias": jnp.zeros(8)}})
  assert log == [("MyNorm", {"float32"}, {"float32"})]  # a LayerNorm by its MRO
  assert out.dtype == jnp.float16  # entered the norm policy: output = compute dtype


@pytest.mark.parametrize(
    "policy, linen_overrides, nnx_overrides",
    [("p=f99", None, None), (3, None, None), (F16, [nn.Dense], [nnx.Linear]),
     (F16, {"Dense": "f32"}, {"Linear": "f32"}), (F16, {nnx.Linear: "f32"}, {nn.Dense: "f32"}),
     (F16, {nn.Dense: "f8"}, {nnx.Linear: "f8"}), (F16, {nn.Dense: 1}, {nnx.Linear: 1})],
)  # fmt: skip
def test_autocast_validates_its_arguments(policy, linen_overrides, nnx_overrides):
  with pytest.raises(ValueError, match="policy|overrides"):
    with jmp_scaler.autocast_linen(policy, linen_overrides):
      pass
  with pytest.raises(ValueError, match="policy|overrides"):
    jmp_scaler.autocast_nnx(SMALL, policy, nnx_overrides)


# ---------------------------------------------------------------- NNX dtypes


def test_nnx_autocast_in_place_dtypes():
  model = jmp_scaler.autocast_nnx(build(NNXRes), F16)
  assert isinstance(model, NNXRes) and isinstance(model.bn1, nnx.BatchNorm)
  assert type(model.bn1).__name__ == "BatchNorm" and model.c1.dtype == jnp.float16
  params = nnx.state(model, nnx.Param)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  graphdef, state = nnx.split(model)
  ops, outs = _ops(lambda s, x: nnx.merge(graphdef, s)(x), state, IMAGES)
  assert [str(a.dtype) for a in outs] == ["float32"]
  convs = {dt for name, dt in ops if name == "conv_general_dilated"}
  assert convs == {("float16", "float16")}
  assert {dt for name, dt in ops if name == "dot_general"} == {("float16", "float16")}
  assert {dt for name, dt in ops if name == "reduce_sum"} == {("float32",)}  # BN stats
  # Re-applying changes the policy; a no-longer-overridden norm loses its casts.
  jmp_scaler.autocast_nnx(model, "p=f16,c=bf16,o=bf16", float32_norms=False)
  assert type(model.bn1) is nnx.BatchNorm and model.bn1.dtype == jnp.bfloat16
  assert model.c1.kernel[...].dtype == jnp.float16
  assert shape_of(model, lambda m, x: m(x), IMAGES).dtype == jnp.bfloat16
  assert model.bn1.mean[...].dtype == jnp.float32  # batch statistics keep their dtype


def test_nnx_override_scopes_submodules():
  model = jmp_scaler.autocast_nnx(
      build(NNXTransformer), F16, {nnx.MultiHeadAttention: "p=f32,c=f32,o=f16"}
  )
  assert model.attn.query.dtype == jnp.float32 and model.up.dtype == jnp.float16
  assert model.ln1.dtype == jnp.float32
  assert shape_of(model, lambda m, x: m.ln1(x), TOKENS).dtype == jnp.float16
  assert shape_of(model, lambda m, x: m.attn(x, x), TOKENS).dtype == jnp.float16
  ops, _ = _ops(lambda s, x: nnx.merge(*nnx.split(model)[:1], s)(x), nnx.state(model), TOKENS)
  dots = [dt for name, dt in ops if name == "dot_general"]
  assert dots.count(("float32", "float32")) == 6  # q, k, v, out, q·k and weights·v
  assert dots.count(("float16", "float16")) == 3  # MLP and head
  with pytest.raises(ValueError, match="nnx.Module"):
    jmp_scaler.autocast_nnx(LinenRes(), F16)


# ---------------------------------------------------------------- training


class BNState(jmp_scaler.TrainState):
  batch_stats: Any = None


def _same(a, b):
  return all(
      np.asarray(u).tobytes() == np.asarray(v).tobytes()
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


@pytest.mark.parametrize("policy", [F16, BF16])
@pytest.mark.parametrize("model_cls, x", [(LinenRes, IMAGES), (LinenTransformer, TOKENS)])
def test_linen_blocks_train_under_half_policies(model_cls, x, policy):
  model, policy = model_cls(), jmp_scaler.get_policy(policy)
  variables = _linen_variables(model_cls)
  tx = optax.chain(policy.loss_scaler(init_scale=2.0**10), optax.adam(3e-3))
  state = BNState.create(
      apply_fn=model.apply, params=variables["params"], tx=tx,
      batch_stats=variables.get("batch_stats", {}),
  )  # fmt: skip

  @functools.partial(jax.jit, compiler_options=FAST)
  def step(state, bad):
    def loss_fn(params):
      with jmp_scaler.autocast_linen(policy):
        logits, new = model.apply(
            {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
        )
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()
      return loss * state.loss_scale, (loss, new)

    grads, (loss, new) = jax.grad(loss_fn, has_aux=True)(state.params)
    grads = jax.tree.map(lambda g: jnp.where(bad, jnp.inf, g), grads)  # an fp16 overflow
    return state.apply_gradients(grads=grads, batch_stats=new["batch_stats"]), loss

  # float16 gets an overflow at step 2; bfloat16 has no scaler to skip with.
  overflow = 2 if policy.needs_loss_scaling else -1
  losses = []
  for i in range(6):
    before = state
    state, loss = step(state, jnp.asarray(i == overflow))
    losses.append(float(loss))
    if i == overflow:  # skipped: params, batch_stats and step kept, scale halved
      assert _same(before.params, state.params) and _same(before.batch_stats, state.batch_stats)
      assert int(state.step) == 2 and float(state.loss_scale) == 2.0**9
    elif model_cls is LinenRes:  # applied: the new batch statistics are kept
      assert not _same(before.batch_stats, state.batch_stats)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
  assert int(state.step) == (5 if policy.needs_loss_scaling else 6)


@pytest.mark.parametrize(
    "make, x, policy", [(NNXRes, IMAGES, F16), (NNXTransformer, TOKENS, BF16)]
)
def test_nnx_blocks_train_under_half_policies(make, x, policy):
  policy = jmp_scaler.get_policy(policy)
  model = jmp_scaler.autocast_nnx(build(make), policy)
  tx = optax.chain(policy.loss_scaler(init_scale=2.0**10), optax.adam(3e-3))
  opt = jmp_scaler.NNXOptimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))
  traces = []

  # The functional NNX style (split/merge around jax.jit) lets the test pass
  # faster compiler options; tests/test_nnx.py runs NNXOptimizer in nnx.jit.
  @functools.partial(jax.jit, compiler_options=FAST)
  def step(state):
    traces.append(None)
    model, opt = nnx.merge(graphdef, state)
    stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    scale = opt.loss_scale

    def loss_fn(model):
      logits = model(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean() * scale

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads, restore_on_skip=stats)
    return nnx.state((model, opt)), loss / scale

  losses = []
  for _ in range(6):
    state, loss = step(state)
    losses.append(float(loss))
  assert len(traces) == 1
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  model, _ = nnx.merge(graphdef, state)
  assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
      jnp.dtype("float32")
  }


# ---------------------------------------------------------------- the jit boundary


def _dense_dots(fn, *args):
  return [dt for name, dt in _ops(fn, *args)[0] if name == "dot_general"]


def test_linen_block_that_traces_nothing_warns_and_the_decorator_holds():
  model = nn.Dense(4)
  variables = {"params": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)}}
  x = jnp.ones((2, 8))
  # The trap: jitted inside the block, first traced after it: float32, and loud.
  with pytest.warns(UserWarning, match="no linen module was traced inside the block"):
    with jmp_scaler.autocast_linen(F16):
      step = jax.jit(model.apply)
  assert _dense_dots(step, variables, x) == [("float32", "float32")]
  # Traced inside the block: no warning, float16. (A new function: JAX caches the
  # trace of ``model.apply`` above, and a cache hit inside a block traces nothing.)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with jmp_scaler.autocast_linen(F16):
      assert _dense_dots(lambda v, x: model.apply(v, x), variables, x) == [("float16", "float16")]

  # The decorator enters the context at every trace, wherever it is jitted.
  @jax.jit
  @jmp_scaler.autocast_linen(F16)
  def decorated(variables, x):
    return model.apply(variables, x)

  assert _dense_dots(decorated, variables, x) == [("float16", "float16")]
  assert decorated(variables, x).dtype == jnp.float32
