"""Gradients that were never scaled are caught at the first (traced) step; keyword arguments
reach the loss on every path of ``jmp_scaler.value_and_grad``.

Each case is a user's path: the bare chain in a plain ``nnx.Optimizer`` (what any framework
that owns its train step holds, tunix's ``actor_optimizer`` among them), ``NNXOptimizer`` and
``TrainState`` (jmp_scaler's and flax's own) after ``jax.grad`` / ``nnx.value_and_grad`` by
hand, ``skip_nonfinite`` and ``accumulate_gradients``; and the documented ways that must not
raise (``value_and_grad``, ``loss * get_scale(...)``, ``no_scale()``, made-up gradients,
gradients from another jitted function, ``optax.MultiSteps``, an eager step).
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jmp_scaler
from jmp_scaler.jaxcompat._tracing import reaches

X = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)), jnp.float32)
UNSCALED = "gradients of the unscaled loss"


def loss_of(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))


# ------------------------------------------------------------------ the jaxpr walk


def test_the_walk_reads_a_traced_gradient_on_this_jax():
  """The internals the check reads hold on this JAX (both ends of the range run this)."""
  seen = {}

  @jax.jit
  def f(w, scale, x):
    g_scaled = jax.grad(lambda w: loss_of(w, x) * scale)(w)
    g_plain = jax.grad(lambda w: loss_of(w, x))(w)
    seen["scaled"] = reaches([g_scaled], scale, [w])
    seen["plain"] = reaches([g_plain], scale, [w])
    seen["input"] = reaches([x], scale, [w])  # an input: computed from nothing
    return g_scaled

  f(jnp.ones((4, 2)), jnp.float32(8.0), X)
  assert seen["scaled"].known and seen["scaled"].target
  assert seen["plain"] == (True, False, True)
  assert seen["input"] == (True, False, False)
  assert not reaches([jnp.ones(2)], None).known  # a concrete array: nothing can be said


# ------------------------------------------------------------------ caught


def _nnx_step(optimizer_cls, grads_of, tx):
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  optimizer = optimizer_cls(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    loss_fn = lambda m: jnp.mean(jnp.tanh(m(x)) ** 2)
    grads = grads_of(loss_fn, model, optimizer)
    optimizer.update(model, grads)

  step(model, optimizer, X)
  return model, optimizer


def _nnx_unscaled(loss_fn, model, optimizer):
  del optimizer
  return nnx.value_and_grad(loss_fn)(model)[1]


def _nnx_scaled(loss_fn, model, optimizer):
  return jmp_scaler.value_and_grad(loss_fn, optimizer)(model)[1]


def _nnx_by_hand(loss_fn, model, optimizer):
  scale = optimizer.loss_scale
  return nnx.grad(lambda m: loss_fn(m) * scale)(model)


def test_a_plain_nnx_optimizer_with_nnx_value_and_grad_raises_at_the_first_step():
  tx = optax.chain(jmp_scaler.dynamic_scale(bare=True), optax.sgd(0.1))
  with pytest.raises(ValueError, match=UNSCALED) as info:
    _nnx_step(nnx.Optimizer, _nnx_unscaled, tx)
  message = str(info.value)  # it says how to get scaled gradients
  assert "jmp_scaler.value_and_grad(loss_fn, state)" in message
  assert "jmp_scaler.get_scale(opt_state)" in message and "check_scaled=False" in message


def test_a_plain_nnx_optimizer_with_scaled_gradients_updates_by_the_true_gradient():
  tx = optax.chain(jmp_scaler.dynamic_scale(bare=True), optax.sgd(0.1))
  model, _ = _nnx_step(nnx.Optimizer, _nnx_scaled, tx)
  start = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  want = jax.grad(lambda k: jnp.mean(jnp.tanh(X @ k + start.bias[...]) ** 2))(start.kernel[...])
  np.testing.assert_allclose(model.kernel[...], start.kernel[...] - 0.1 * want, rtol=1e-5)


@pytest.mark.parametrize("skip_mode", ["select", "cond"])
def test_nnx_optimizer_after_nnx_value_and_grad_by_hand_raises(skip_mode):
  tx = optax.chain(jmp_scaler.dynamic_scale(skip_mode=skip_mode), optax.adam(1e-3))
  with pytest.raises(ValueError, match=UNSCALED):
    _nnx_step(jmp_scaler.NNXOptimizer, _nnx_unscaled, tx)
  _nnx_step(jmp_scaler.NNXOptimizer, _nnx_scaled, tx)  # the two documented ways pass
  _nnx_step(jmp_scaler.NNXOptimizer, _nnx_by_hand, tx)


def _linen_step(state, grads_of):
  @jax.jit
  def step(state, x):
    loss_fn = lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2)
    return state.apply_gradients(grads=grads_of(loss_fn, state))

  return step(state, X)


def _linen_state(cls, tx):
  params = MLP().init(jax.random.key(0), X)["params"]
  return cls.create(apply_fn=MLP().apply, params=params, tx=tx)


@pytest.mark.parametrize("skip_mode", ["select", "cond"])
def test_train_state_after_jax_grad_by_hand_raises(skip_mode):
  tx = optax.chain(jmp_scaler.dynamic_scale(skip_mode=skip_mode), optax.adam(1e-3))
  state = _linen_state(jmp_scaler.TrainState, tx)
  with pytest.raises(ValueError, match=UNSCALED):
    _linen_step(state, lambda loss_fn, s: jax.grad(loss_fn)(s.params))
  _linen_step(state, lambda loss_fn, s: jmp_scaler.value_and_grad(loss_fn, s)(s.params)[1])
  _linen_step(state, lambda loss_fn, s: jax.grad(lambda p: loss_fn(p) * s.loss_scale)(s.params))


def test_flax_own_train_state_holding_the_bare_chain_raises():
  """flax's TrainState (no exact skip: the scaler is bare in its tx) with float16 params."""
  tx = optax.chain(jmp_scaler.dynamic_scale(bare=True), optax.sgd(0.1))
  params = jax.tree.map(lambda p: p.astype(jnp.float16),
                        MLP().init(jax.random.key(0), X)["params"])
  state = train_state.TrainState.create(apply_fn=MLP().apply, params=params, tx=tx)
  with pytest.raises(ValueError, match=UNSCALED):
    _linen_step(state, lambda loss_fn, s: jax.grad(loss_fn)(s.params))
  scale = lambda s: jmp_scaler.get_scale(s.opt_state)
  _linen_step(state, lambda loss_fn, s: jax.grad(lambda p: loss_fn(p) * scale(s))(s.params))


def _grads(params, opt_state, x, scaled):
  """The gradients of ``loss_of``: of the scaled loss, or (``scaled=False``) by hand."""
  loss_fn = lambda p: loss_of(p["w"], x)
  if scaled:
    return jmp_scaler.value_and_grad(loss_fn, opt_state)(params)[1]
  return jax.grad(loss_fn)(params)


def _optax_step(tx, scaled):
  params = {"w": jnp.ones((4, 2))}

  @jax.jit
  def step(params, opt_state, x):
    return tx.update(_grads(params, opt_state, x, scaled), opt_state, params)

  return step(params, tx.init(params), X)


@pytest.mark.parametrize("wrap", [
    jmp_scaler.skip_nonfinite,
    lambda chain: jmp_scaler.accumulate_gradients(chain, every_k=2),
    lambda chain: jmp_scaler.skip_nonfinite(jmp_scaler.accumulate_gradients(chain, every_k=1)),
], ids=["skip_nonfinite", "accumulate", "skip_nonfinite(accumulate)"])
def test_the_pure_optax_wrappers_check_the_gradients_they_are_handed(wrap):
  tx = wrap(optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3)))
  with pytest.raises(ValueError, match=UNSCALED):
    _optax_step(tx, scaled=False)
  _optax_step(tx, scaled=True)


def test_equinox_and_shard_map_steps_are_checked_too():
  mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(1))
  tx = jmp_scaler.skip_nonfinite(optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3)))
  opt_state = tx.init(eqx.filter(mlp, eqx.is_inexact_array))
  loss_fn = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)

  @eqx.filter_jit
  def eqx_step(model, opt_state, x):
    grads = eqx.filter_grad(loss_fn)(model, x)
    return tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))

  with pytest.raises(ValueError, match=UNSCALED):
    eqx_step(mlp, opt_state, X)
  # shard_map, the scaler told its axis, the whole step inside the body
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  tx = optax.chain(jmp_scaler.dynamic_scale(axis_name="data", bare=True), optax.sgd(0.1))
  params = {"w": jnp.ones((4, 2))}
  spec = jax.sharding.PartitionSpec

  def body(scaled):
    def step(params, opt_state, x):
      grads = _grads(params, opt_state, x, scaled)
      return tx.update(jax.lax.pmean(grads, "data"), opt_state, params)
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec(), spec(), spec("data")),
                                 out_specs=spec()))

  with pytest.raises(ValueError, match=UNSCALED):
    body(False)(params, tx.init(params), X)
  body(True)(params, tx.init(params), X)


# ------------------------------------------------------------------ not caught, rightly


def test_no_scale_and_a_unit_fixed_scale_take_unscaled_gradients():
  for scaler in (jmp_scaler.no_scale(), jmp_scaler.fixed_scale(1.0),
                 jmp_scaler.get_policy("p=f32,c=bf16,o=f32").loss_scaler()):
    _optax_step(jmp_scaler.skip_nonfinite(optax.chain(scaler, optax.sgd(0.1))), scaled=False)


def test_check_scaled_false_turns_the_check_off_and_shows_in_the_repr():
  scaler = jmp_scaler.dynamic_scale(check_scaled=False)
  assert "check_scaled=False" in repr(scaler)
  _optax_step(jmp_scaler.skip_nonfinite(optax.chain(scaler, optax.sgd(0.1))), scaled=False)
  with pytest.raises(ValueError, match="check_scaled must be True or False, got 'no'"):
    jmp_scaler.fixed_scale(8.0, check_scaled="no")


def test_gradients_it_cannot_trace_back_pass_without_a_word():
  """Made up (not computed from the parameters), computed by another jitted function, inside
  optax.MultiSteps' lax.cond (an average read back from its state), or eager: unknown."""
  tx = jmp_scaler.skip_nonfinite(optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(0.1)))
  params = {"w": jnp.ones((4, 2))}
  opt_state = tx.init(params)
  made_up = {"w": jnp.full((4, 2), jnp.inf)}
  _, after = jax.jit(lambda s, p: tx.update(made_up, s, p))(opt_state, params)
  assert bool(jmp_scaler.scale_metrics(after)["skipped"])
  # Another jitted function computed them (scaled there); this one averages them: unknown.
  loss_fn = lambda q: loss_of(q["w"], X)
  grads = jax.jit(lambda p: jmp_scaler.value_and_grad(loss_fn, opt_state)(p)[1])(params)
  halve = lambda g, s, p: tx.update(jax.tree.map(lambda a: a / 2, g), s, p)
  jax.jit(halve)(grads, opt_state, params)
  multi = optax.MultiSteps(optax.chain(jmp_scaler.dynamic_scale(bare=True), optax.sgd(0.1)), 2)
  _optax_step(multi, scaled=False)  # the inner chain runs in a branch, on an average
  # Eager: concrete arrays carry no record of how they were made.
  tx.update(jax.grad(lambda p: loss_of(p["w"], X))(params), opt_state, params)


# ------------------------------------------------------------------ keyword arguments


def _tunix_loss(model, input_tokens, targets, scale=1.0):
  """tunix's convention: the trainer calls ``loss_fn(model, **inputs)``."""
  loss = jnp.mean((model(input_tokens) - targets) ** 2) * scale
  return loss, {"n": input_tokens.shape[0]}


def test_value_and_grad_takes_keyword_arguments_on_nnx_as_tunix_calls_its_loss():
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  tx = optax.chain(jmp_scaler.dynamic_scale(init_scale=8.0), optax.sgd(0.1))
  optimizer = jmp_scaler.NNXOptimizer(model, tx, wrt=nnx.Param)
  inputs = {"input_tokens": X, "targets": jnp.zeros((3, 2))}

  @nnx.jit
  def step(model, optimizer, inputs):
    grad_fn = jmp_scaler.value_and_grad(_tunix_loss, optimizer, has_aux=True)
    (loss, aux), grads = grad_fn(model, **inputs, scale=2.0)
    optimizer.update(model, grads)
    return loss, aux, grads

  plain = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  (want, _), want_grads = nnx.value_and_grad(_tunix_loss, has_aux=True)(plain, X, inputs["targets"],
                                                                       2.0)
  loss, aux, grads = step(model, optimizer, inputs)
  assert aux == {"n": 3}
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(grads.kernel[...], 8.0 * want_grads.kernel[...], rtol=1e-5)


def test_value_and_grad_takes_keyword_arguments_on_every_other_path():
  opt_state = optax.chain(jmp_scaler.dynamic_scale(init_scale=4.0), optax.sgd(0.1)).init(None)
  w = jnp.ones((4, 2))
  want = jax.grad(lambda w, x: loss_of(w, x))(w, X) * 4.0
  # plain JAX, argnums=(0, 1) with a keyword argument beside them
  f = lambda w, b, *, x: loss_of(w, x) + jnp.sum(b)
  _, (gw, gb) = jmp_scaler.value_and_grad(f, opt_state, argnums=(0, 1))(w, jnp.ones(2), x=X)
  np.testing.assert_allclose(gw, want, rtol=1e-5)
  np.testing.assert_allclose(gb, jnp.full(2, 4.0))
  # linen: apply with a keyword input
  params = MLP().init(jax.random.key(0), X)["params"]
  lf = lambda p, *, x: jnp.mean(MLP().apply({"params": p}, x) ** 2)
  _, g = jmp_scaler.value_and_grad(lf, opt_state)(params, x=X)
  want_g = jax.grad(lf)(params, x=X)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 4.0 * b, rtol=1e-5), g, want_g)
  # equinox: a module with ints and a function, keyword inputs
  mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(1))
  ef = lambda m, *, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)
  _, eg = jmp_scaler.value_and_grad(ef, opt_state)(mlp, x=X, y=jnp.zeros((3, 2)))
  want_e = eqx.filter_grad(lambda m: ef(m, x=X, y=jnp.zeros((3, 2))))(mlp)
  for a, b in zip(jax.tree.leaves(eg), jax.tree.leaves(want_e), strict=True):
    np.testing.assert_allclose(a, 4.0 * b, rtol=1e-5)


def test_a_differentiated_argument_given_by_keyword_is_named_in_the_error():
  opt_state = optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(0.1)).init(None)
  with pytest.raises(ValueError, match="0 positional arguments and keyword arguments w, x"):
    jmp_scaler.value_and_grad(lambda w, x: loss_of(w, x), opt_state)(w=jnp.ones((4, 2)), x=X)
