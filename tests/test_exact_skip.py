"""Exact skip: a non-finite step changes no parameter and no optimizer state."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_scaler

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(optax.linear_schedule(1e-2, 1e-3, 100)),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
      "dense": {"kernel": jax.random.normal(k1, (4, 3)), "bias": jnp.array([0.0, -0.0, 1.0])},
      "half": jax.random.normal(k2, (5,)).astype(jnp.float16),
  }


def _grads(params, scale, bad=None):
  g = jax.tree.map(lambda p: (jnp.ones_like(p, jnp.float32) * 0.25 * scale).astype(p.dtype),
                   params)
  if bad is not None:
    g["dense"]["kernel"] = g["dense"]["kernel"].at[1, 2].set(bad)
  return g


def _bits(tree):
  """Every leaf as raw bits, so -0.0 != 0.0 and NaN payloads count."""
  return [np.asarray(x).view(f"u{np.asarray(x).dtype.itemsize}") if np.asarray(x).dtype.kind
          == "f" else np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_bit_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_bits(a), _bits(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _inner(opt_state):
  """Everything in a chain's state but the scaler's."""
  return opt_state[1:]


@functools.partial(jax.jit, static_argnums=0)
def _train_state_step(_, state, bad):
  scale = state.loss_scale
  grads = _grads(state.params, scale)
  grads["dense"]["kernel"] = grads["dense"]["kernel"].at[1, 2].add(bad)
  return state.apply_gradients(grads=grads)


MODES = ["cond", "select"]


@functools.cache
def _scaled_chain(name, mode):
  """One chain per optimizer and mode, shared by the bad values: the TrainState's tx is
  static under jit, so a new chain would compile the step again."""
  return optax.chain(jmp_scaler.dynamic_scale(skip_mode=mode), OPTIMIZERS[name]())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan, -jnp.inf])
def test_train_state_skip_is_bit_identical(name, bad, mode):
  tx = _scaled_chain(name, mode)
  state = jmp_scaler.TrainState.create(apply_fn=None, params=_params(), tx=tx)
  state = _train_state_step(name, state, 0.0)  # one real step: non-trivial moments
  before = state
  after = _train_state_step(name, state, bad)
  _assert_bit_identical(after.params, before.params)
  _assert_bit_identical(_inner(after.opt_state), _inner(before.opt_state))
  assert int(after.step) == int(before.step) == 1
  m = after.scale_metrics()
  assert bool(m["skipped"]) and float(m["scale"]) == 2.0**15 and int(m["steps"]) == 2
  # ... and the next finite step is applied.
  resumed = _train_state_step(name, after, 0.0)
  assert int(resumed.step) == 2
  assert not np.array_equal(resumed.params["dense"]["kernel"], before.params["dense"]["kernel"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_pure_optax_skip_is_bit_identical(name, mode):
  tx = jmp_scaler.skip_nonfinite(
      optax.chain(jmp_scaler.dynamic_scale(skip_mode=mode), OPTIMIZERS[name]()))
  params = _params()

  @jax.jit
  def step(params, opt_state, bad):
    grads = _grads(params, jmp_scaler.get_scale(opt_state))
    grads["dense"]["kernel"] = grads["dense"]["kernel"].at[0, 0].add(bad)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = step(params, tx.init(params), 0.0)
  new_params, new_state = step(params, opt_state, jnp.nan)
  _assert_bit_identical(new_params, params)  # -0.0 updates: even the -0.0 bias survives
  _assert_bit_identical(_inner(new_state), _inner(opt_state))
  assert float(jmp_scaler.get_scale(new_state)) == 2.0**15
  assert step._cache_size() == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_applied_step_equals_the_optimizer_on_true_gradients(name, mode):
  scaled = optax.chain(jmp_scaler.dynamic_scale(skip_mode=mode), OPTIMIZERS[name]())
  plain = OPTIMIZERS[name]()
  params = {"w": jnp.linspace(-1.0, 1.0, 6)}
  state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=scaled)
  reference = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=plain)

  @jax.jit  # the scaled and the reference runs, three steps each, as one program
  def run(state, reference):
    for i in range(3):
      true = {"w": jnp.linspace(0.1, 0.6, 6) * (i + 1)}
      state = state.apply_gradients(
          grads=jax.tree.map(functools.partial(jnp.multiply, state.loss_scale), true))
      reference = reference.apply_gradients(grads=true)
    return state, reference

  state, reference = run(state, reference)
  np.testing.assert_allclose(state.params["w"], reference.params["w"], rtol=1e-6)


@pytest.mark.parametrize(
    "path, mode",
    [("train_state", "cond"), ("train_state", "select"), ("skip_nonfinite", "cond"),
     ("skip_nonfinite", "select"), ("bare_chain", "auto")],
)
def test_no_inf_or_nan_reaches_state_over_long_bad_streaks(path, mode):
  tx = optax.chain(jmp_scaler.dynamic_scale(growth_interval=3, skip_mode=mode), optax.adam(1e-2))
  params = _params()
  pattern = np.array([False] * 3 + [True] * 300 + [False, True] * 20 + [False] * 5)
  values = np.where(np.arange(pattern.size) % 2 == 0, np.nan, np.inf).astype(np.float32)

  def body(carry, xs):
    bad, value = xs
    p, s = carry
    grads = _grads(p, jmp_scaler.get_scale(s.opt_state if path == "train_state" else s))
    grads["half"] = jnp.where(bad, value, grads["half"].astype(jnp.float32)).astype(jnp.float16)
    if path == "train_state":
      s = s.apply_gradients(grads=grads)
      return (s.params, s), None
    t = jmp_scaler.skip_nonfinite(tx) if path == "skip_nonfinite" else tx
    updates, s = t.update(grads, s, p)
    return (optax.apply_updates(p, updates), s), None

  if path == "train_state":
    state = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)
  else:
    state = tx.init(params)
  (params, state), _ = jax.jit(lambda c: jax.lax.scan(body, c, (pattern, values)))(
      (params, state))
  for leaf in jax.tree.leaves((params, state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert np.all(np.isfinite(np.asarray(leaf, np.float32))), path
  metrics = jmp_scaler.scale_metrics(state.opt_state if path == "train_state" else state)
  assert int(metrics["total_skips"]) == 320
  if path != "bare_chain":
    count = optax.tree.get(state.opt_state if path == "train_state" else state, "count")
    assert int(count) == pattern.size - 320  # schedules keyed on the count did not advance


def test_clipping_after_the_scaler_clips_true_gradients():
  clip_then_sgd = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  scaled = optax.chain(jmp_scaler.dynamic_scale(), optax.clip_by_global_norm(1.0),
                       optax.sgd(1.0))
  params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
  true = {"a": jnp.array([3.0, 0.0, 0.0]), "b": jnp.array([0.0, 4.0])}  # norm 5

  @jax.jit  # both chains as one program (eagerly some fifty small compiles)
  def both(true):
    expected, _ = clip_then_sgd.update(true, clip_then_sgd.init(params))
    got, _ = scaled.update(jax.tree.map(lambda g: g * 2.0**16, true), scaled.init(params))
    return expected, got

  expected, got = both(true)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6)
  assert float(optax.tree.norm(got)) == pytest.approx(1.0)


@pytest.mark.parametrize("mode", MODES)
def test_skipped_step_keeps_extra_fields_like_batch_stats(mode):
  tx = optax.chain(jmp_scaler.dynamic_scale(skip_mode=mode), optax.sgd(0.1))

  class State(jmp_scaler.TrainState):
    batch_stats: dict

  state = State.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx,
                       batch_stats={"mean": jnp.zeros(2)})
  step = jax.jit(lambda s, g, m: s.apply_gradients(grads={"w": g}, batch_stats={"mean": m}))
  skipped = step(state, jnp.array([jnp.inf, 0.0]), jnp.full(2, 5.0))
  np.testing.assert_array_equal(skipped.batch_stats["mean"], np.zeros(2))
  applied = step(state, jnp.ones(2), jnp.full(2, 5.0))
  np.testing.assert_array_equal(applied.batch_stats["mean"], np.full(2, 5.0))


def _case_ops(fn, args, platform):
  """The ``stablehlo.case`` ops of ``fn`` lowered (not compiled) for ``platform``: no device
  of it needed (what ``jax.export`` does, without its check of the custom calls)."""
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  return lowered.as_text().count("stablehlo.case")


@pytest.mark.parametrize("mode, shape, conds", [
    # auto: the TPU's conditional, the select elsewhere, by the platform the step is lowered
    # for (from this CPU host), whatever the leaf sizes (with row-major gradients, cond no
    # longer pays on large ones on CPU).
    ("auto", (2,), {"cpu": 0, "tpu": 1, "cuda": 0}),
    ("auto", (1024, 512), {"cpu": 0, "tpu": 1, "cuda": 0}),
    ("cond", (2,), {"cpu": 1, "tpu": 1, "cuda": 1}),
    ("select", (2,), {"cpu": 0, "tpu": 0, "cuda": 0}),
])
def test_auto_skip_mode_follows_the_platform_lowered_for(mode, shape, conds):
  tx = optax.chain(jmp_scaler.dynamic_scale(skip_mode=mode), optax.sgd(0.1))
  params = {"w": jnp.ones(shape), "b": jnp.ones(shape[-1:])}
  train = jmp_scaler.TrainState.create(apply_fn=None, params=params, tx=tx)
  step = lambda s, g: s.apply_gradients(grads=g)
  # Compiled for this CPU: the conditionals XLA runs.
  compiled = jax.jit(step).lower(train, params).compile().as_text()
  assert compiled.count("conditional(") == conds["cpu"]
  # Lowered for a TPU and a GPU (no hardware needed): each platform_dependent lowers to the
  # same case ops on every platform, so the case ops beyond the CPU's are the skip's.
  cpu = _case_ops(step, (train, params), "cpu")
  for platform in ("tpu", "cuda"):
    extra = _case_ops(step, (train, params), platform) - cpu
    assert extra == conds[platform] - conds["cpu"], platform


def test_train_state_without_a_scaler_behaves_like_flax():
  with pytest.warns(UserWarning, match="holds no loss scaler"):
    state = jmp_scaler.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
                                         tx=optax.sgd(1.0))
  state = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])})
  assert int(state.step) == 1 and float(state.params["w"][1]) == 0.0
  with pytest.raises(ValueError, match="holds no loss scaler"):  # no scale to read: not 1
    _ = state.loss_scale


@pytest.mark.parametrize("mode", MODES)
def test_skip_nonfinite_inside_shard_map_with_per_device_gradients(mode):
  # The skip's -0.0 updates must vary over the mesh axis like the applied ones.
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((1,), ("d",))
  tx = jmp_scaler.skip_nonfinite(optax.chain(
      jmp_scaler.dynamic_scale(axis_name="d", skip_mode=mode), optax.sgd(1.0)))
  state = tx.init(jnp.zeros(4))
  specs = jax.tree.map(lambda _: P(), state)
  step = jax.jit(jax.shard_map(lambda g, s: tx.update(g, s), mesh=mesh,
                               in_specs=(P("d"), specs), out_specs=(P("d"), specs)))
  shard = functools.partial(jax.device_put, device=NamedSharding(mesh, P("d")))
  updates, state = step(shard(jnp.full(4, 2.0**16)), state)
  np.testing.assert_array_equal(updates, -np.ones(4))
  updates, state = step(shard(jnp.array([1.0, jnp.nan, 1.0, 1.0])), state)
  assert bool(state[0].skipped) and np.all(np.signbit(updates)) and not np.any(updates)
