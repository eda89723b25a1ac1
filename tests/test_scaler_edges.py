"""The scaler at its edges (issue 9): eager calls with any state leaf, the top of the
scale range, complex gradients, partial layouts, bare use, and cond == select."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmp_scaler.diagnostics._nonfinite import nonfinite_report
from jmp_scaler.diagnostics._underflow import underflow_report
from jmp_scaler.precision._policy import get_policy
from jmp_scaler.scaling import _scaler
from jmp_scaler.scaling._accumulate import accumulate_gradients
from jmp_scaler.scaling._lookup import get_scale
from jmp_scaler.scaling._scaler import dynamic_scale, fixed_scale, no_scale, unscale
from jmp_scaler.scaling._skip import skip_nonfinite
from jmp_scaler.training._nnx_optimizer import NNXOptimizer
from jmp_scaler.training._train_state import TrainState


def _odd_state(value):
  """A transformation whose state is ``{"foo": value}`` (a Python number, None, ...)."""
  return optax.GradientTransformation(lambda p: {"foo": value}, lambda u, s, p=None: (u, s))


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# --- 9.1: any state leaf optax allows, eagerly and under jit ---------------------------


ODD = {
    "add_noise": lambda: optax.add_noise(0.01, 0.55, 0),  # a typed PRNG key in the state
    "python_int": lambda: _odd_state(1),
    "python_float": lambda: _odd_state(0.5),
    "none": lambda: _odd_state(None),
}


# Inputs put on the device from numpy: no eager program compiles to build them.
_PARAMS = lambda: {"w": jnp.asarray(np.ones(3, np.float32))}  # noqa: E731
_GOOD = lambda: {"w": jnp.asarray(np.full(3, 0.5, np.float32))}  # noqa: E731
_BAD = lambda: {"w": jnp.asarray(np.array([0.5, np.nan, 0.5], np.float32))}  # noqa: E731


def _wrapped(wrapper, odd):
  """The wrapper around ``chain(no_scale(), odd, sgd(1.0))``: its initial state and a
  function taking it through a good step then a bad one (the results after each)."""
  tx = optax.chain(no_scale(), ODD[odd](), optax.sgd(1.0))
  params, good, bad = _PARAMS(), _GOOD(), _BAD()
  if wrapper == "train_state":
    step = lambda s, g: s.apply_gradients(grads=g)
    return (TrainState.create(apply_fn=None, params=params, tx=tx),
            lambda s: (lambda s1: (s1, step(s1, bad)))(step(s, good)))
  t = skip_nonfinite(tx) if wrapper == "skip_nonfinite" else accumulate_gradients(tx, every_k=1)

  def two(state):
    first, state = t.update(good, state, params)
    return first, t.update(bad, state, params)

  return t.init(params), two


@functools.cache
def _jitted(wrapper):
  """Every odd state leaf's two steps under one wrapper, as one jitted program."""
  states, fns = zip(*(_wrapped(wrapper, odd) for odd in sorted(ODD)), strict=True)
  run = jax.jit(lambda states: [fn(s) for fn, s in zip(fns, states, strict=True)])
  return dict(zip(sorted(ODD), run(list(states)), strict=True))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("odd", sorted(ODD))
@pytest.mark.parametrize("wrapper", ["skip_nonfinite", "train_state", "accumulate"])
def test_wrappers_accept_any_state_leaf(wrapper, odd, jit):
  if jit:
    result = _jitted(wrapper)[odd]
  else:
    state, two = _wrapped(wrapper, odd)
    result = two(state)
  if wrapper == "train_state":
    state, after = result
    assert int(state.step) == 1 and float(np.asarray(state.params["w"])[0]) < 1.0
    kept = state.params
    state = after
    assert int(state.step) == 1 and _bits(state.params) == _bits(kept)
    return
  first, (updates, state) = result
  assert float(np.asarray(first["w"])[0]) < 0.0
  assert np.all(np.signbit(updates["w"])) and not np.any(updates["w"])
  assert int(get_scale(state)) == 1


# --- 9.3: every scale unscales correctly --------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_top_of_the_scale_range_unscales_exactly(jit):
  exponents = np.arange(-126, 128, 9).tolist() + [126, 127]
  true = jnp.array([1.5, -1.25, 1.0], jnp.float32)  # normal at every scale
  fn = jax.jit(unscale) if jit else unscale
  for e in exponents:
    scale = jnp.asarray(2.0**e, jnp.float32)
    got = fn(true * scale, scale)
    np.testing.assert_array_equal(got, true, err_msg=f"scale 2^{e}")


@pytest.mark.parametrize("wrapper", ["train_state", "accumulate", "bare"])
def test_a_step_at_scale_2_to_127_applies_the_true_gradient(wrapper):
  true = {"w": np.array([0.5, -0.25], np.float32)}
  params = {"w": jnp.asarray(np.zeros(2, np.float32))}
  tx = optax.chain(dynamic_scale(2.0**127, bare=True), optax.sgd(1.0))
  scaled = {"w": jnp.asarray(true["w"] * np.float32(2.0**127))}  # exact: a power of two
  if wrapper == "train_state":
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, scaled).params
  else:
    t = accumulate_gradients(tx, every_k=1) if wrapper == "accumulate" else tx
    updates, _ = jax.jit(t.update)(scaled, t.init(params), params)
    new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["w"], -true["w"])


def test_the_checks_one_factor_decides_as_the_two_factor_unscaling_at_every_scale():
  # all_finite multiplies by pre * inv (the float32 1/scale, flushed to zero above 2**126);
  # the unscaling by pre, then inv. Every scale's decision is the unscaled value's finiteness.
  scales = [2.0**-126, 2.0**-20, 0.5, 1.0, 3.0, 2.0**63, 2.0**64 * 1.5, 2.0**126, 2.0**127,
            float(np.finfo(np.float32).max)]
  f32max, f16max = np.finfo(np.float32).max, np.finfo(np.float16).max
  values = {"float32": [f32max, -f32max, 1.0, 1e-40, np.inf, -np.inf, np.nan],
            "float16": [f16max, -f16max, 1.0, 6e-8, np.inf, -np.inf, np.nan]}
  cases = [(s, np.asarray([v], d)) for s in scales for d, vs in values.items() for v in vs]

  @jax.jit
  def both(scales, grads):
    out = []
    for scale, g in zip(scales, grads, strict=True):
      state = dynamic_scale(bare=True).init(None)._replace(scale=scale)
      out.append((_scaler.all_finite({"g": g}, state), jnp.all(jnp.isfinite(unscale(g, scale)))))
    return out

  got = both([jnp.float32(s) for s, _ in cases], [g for _, g in cases])
  flips = [(s, g) for (s, g), (a, b) in zip(cases, got, strict=True) if bool(a) != bool(b)]
  assert flips == []
  # Both answers occur, the overflow of the unscaling among them (65504 under a scale of 0.5).
  assert {bool(a) for a, _ in got} == {True, False}
  i = next(i for i, (s, g) in enumerate(cases) if s == 0.5 and g[0] == f16max)
  assert not bool(got[i][0])


# --- 9.4: complex gradients -------------------------------------------------------------


def test_complex_gradients_are_unscaled_and_checked():
  tx = skip_nonfinite(optax.chain(dynamic_scale(1024.0), optax.sgd(1.0)))
  params = {"w": jnp.zeros(2, jnp.complex64)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  updates, state = step({"w": jnp.array([1024 + 0j, 2048j], jnp.complex64)}, state, params)
  np.testing.assert_array_equal(updates["w"], np.array([-1 + 0j, -2j], np.complex64))
  for bad in (complex(0, np.nan), complex(np.inf, 0)):
    updates, state = step({"w": jnp.array([1024 + 0j, bad], jnp.complex64)}, state, params)
    assert bool(state[0].skipped), bad
    assert not np.any(updates["w"])


def test_accumulation_unscales_and_drops_complex_micro_batches():
  tx = accumulate_gradients(optax.chain(fixed_scale(4.0), optax.sgd(1.0)), every_k=2)
  params = jnp.zeros(1, jnp.complex64)

  @jax.jit  # both micro-batches as one program
  def two(state):
    _, state = tx.update(jnp.array([4 + 8j], jnp.complex64), state, params)
    return tx.update(jnp.array([complex(1, np.nan)], jnp.complex64), state, params)

  updates, state = two(tx.init(params))
  np.testing.assert_array_equal(updates, np.array([-1 - 2j], np.complex64))  # mean of one
  assert int(state.dropped) == 1


def test_reports_see_both_parts_of_complex_leaves():
  grads = {"c": jnp.array([1 + 1j, complex(1, np.nan), complex(np.inf, 1)], jnp.complex64)}
  report = nonfinite_report(grads)
  assert report.culprits()[0].nan == 1 and report.culprits()[0].inf == 1
  tiny = {"c": jnp.array([1e-9j, 1.0 + 0j], jnp.complex64)}  # 1e-9 flushes in float16
  u = underflow_report(tiny, scale=1.0)
  assert int(u.zero[0]) == 1 and int(u.nonzero[0]) == 2
  assert float(u.max_abs[0]) == 1.0


# --- 9.6: a scaler that sees only part of the gradients ----------------------------------


def _split_chain(scaler_inside: bool):
  labels = {"a": "scaled", "b": "plain"}
  branch = optax.chain(dynamic_scale(), optax.sgd(0.1)) if scaler_inside else optax.sgd(0.1)
  inner = optax.multi_transform({"scaled": branch, "plain": optax.sgd(0.1)}, labels)
  return inner if scaler_inside else optax.chain(dynamic_scale(), inner)


@pytest.mark.parametrize("wrapper", ["bare", "skip_nonfinite", "train_state"])
def test_a_scaler_in_one_branch_of_multi_transform_is_refused(wrapper):
  tx = _split_chain(scaler_inside=True)
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  grads = {"a": jnp.full(2, 2.0**16), "b": jnp.full(2, 2.0**16)}
  with pytest.raises(ValueError, match="head of the whole chain"):
    if wrapper == "train_state":
      TrainState.create(apply_fn=None, params=params, tx=tx).apply_gradients(grads=grads)
    else:
      t = skip_nonfinite(tx) if wrapper == "skip_nonfinite" else tx
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.update(grads, t.init(params), params)


def test_masked_scaler_is_refused_and_the_head_of_the_chain_is_not():
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  grads = {"a": jnp.full(2, 2.0**16), "b": jnp.full(2, 2.0**16)}
  masked = optax.masked(dynamic_scale(bare=True), {"a": True, "b": False})
  with pytest.raises(ValueError, match="optax.masked"):
    masked.update(grads, masked.init(params), params)
  tx = skip_nonfinite(_split_chain(scaler_inside=False))
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["a"], -0.1 * np.ones(2))
  np.testing.assert_allclose(updates["b"], -0.1 * np.ones(2))


# --- 9.7: bare use warns once, unless said to be intended --------------------------------


def _bare_warnings(fn, monkeypatch):
  monkeypatch.setattr(_scaler, "_BARE_WARNED", [])  # the warning is given once per process
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn()
  return [w for w in caught if "used bare" in str(w.message)]


def test_bare_chain_warns_once_naming_the_wrappers(monkeypatch):
  tx = optax.chain(dynamic_scale(), optax.adam(1e-3))
  params = jnp.ones(2)
  state = tx.init(params)
  step = jax.jit(tx.update)
  caught = _bare_warnings(lambda: step(jnp.ones(2), state, params), monkeypatch)
  assert len(caught) == 1
  message = str(caught[0].message)
  for name in ("NNXOptimizer", "TrainState", "skip_nonfinite", "bare=True"):
    assert name in message
  with warnings.catch_warnings(record=True) as again:
    warnings.simplefilter("always")
    other = optax.chain(dynamic_scale(), optax.adam(1e-3))  # another bare scaler
    other.update(jnp.ones(2), other.init(params), params)
  assert not [w for w in again if "used bare" in str(w.message)]  # once per process


@pytest.mark.parametrize("use", ["bare=True", "skip_nonfinite", "train_state", "accumulate"])
def test_no_bare_warning_when_intended_or_wrapped(use, monkeypatch):
  scaler = dynamic_scale(bare=True) if use == "bare=True" else dynamic_scale()
  tx = optax.chain(scaler, optax.adam(1e-3))
  params = jnp.ones(2)

  def run():
    if use == "train_state":
      TrainState.create(apply_fn=None, params=params, tx=tx).apply_gradients(grads=params)
      return
    t = {"skip_nonfinite": skip_nonfinite, "accumulate": lambda x: accumulate_gradients(x, 1)}
    t = t.get(use, lambda x: x)(tx)
    t.update(params, t.init(params), params)

  assert not _bare_warnings(run, monkeypatch)


def test_plain_nnx_optimizer_warns_and_nnx_optimizer_does_not(monkeypatch):
  # The warning is given in Python as the update is traced: one jitted program per class
  # (building, differentiating and updating the model) instead of some fifty eager ones.
  def update(cls):
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = cls(model, optax.chain(dynamic_scale(), optax.adam(1e-3)), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model)
    opt.update(model, grads)
    return nnx.state(model, nnx.Param)

  assert len(_bare_warnings(lambda: jax.jit(update, static_argnums=0)(nnx.Optimizer),
                            monkeypatch)) == 1
  assert not _bare_warnings(lambda: jax.jit(update, static_argnums=0)(NNXOptimizer), monkeypatch)


def test_bare_must_be_a_bool():
  with pytest.raises(ValueError, match="bare must be True or False, got 'yes'"):
    dynamic_scale(bare="yes")
  with pytest.raises(ValueError, match="bare"):
    no_scale(bare=1)


# --- what cond and select share bit for bit, and what they do not -------------------------


def test_cond_and_select_skip_alike_and_agree_to_rounding_with_adam_and_apply_updates():
  key = jax.random.key(0)
  params = {f"l{i}": jax.random.normal(jax.random.fold_in(key, i), (33, 17)) for i in range(3)}

  def run(mode):
    tx = optax.chain(dynamic_scale(2.0**10, growth_interval=2, skip_mode=mode), optax.adam(3e-3))
    state = TrainState.create(apply_fn=None, params=params, tx=tx)

    @jax.jit
    def step(s, i):
      grads = jax.tree.map(lambda p: jnp.sin(p * (i + 1.0)) * s.loss_scale, s.params)
      grads["l1"] = jnp.where(i % 4 == 3, grads["l1"].at[0, 0].set(jnp.inf), grads["l1"])
      return s.apply_gradients(grads=grads)

    history = []
    for i in range(8):
      before = state
      state = step(state, i)
      skipped = bool(state.opt_state[0].skipped)
      if skipped:  # a skipped step keeps everything but the scaler, bit for bit
        assert _bits((state.params, state.opt_state[1], state.step)) == _bits(
            (before.params, before.opt_state[1], before.step))
      history.append((skipped, _bits(state.opt_state[0])))
    return state, history

  (cond, cond_history), (select, select_history) = run("cond"), run("select")
  assert cond_history == select_history  # same skips, scaler state bit for bit
  assert [s for s, _ in cond_history] == [False, False, False, True] * 2
  # Applied steps agree to rounding: XLA:CPU contracts multiply-adds into FMAs as it
  # fuses, and a conditional's branch fuses differently from a select.
  for a, b in zip(jax.tree.leaves(cond.params), jax.tree.leaves(select.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", ["p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32", "f32"])
def test_policy_loss_scaler_keeps_bare_under_every_policy(spec, monkeypatch):
  # bf16 and f32 policies give no_scale(): it takes bare=True too, or the warning the
  # argument exists to silence fires anyway.
  policy = get_policy(spec)
  params = jnp.ones(2)
  for bare, expected in ((True, 0), (False, 1)):
    tx = optax.chain(policy.loss_scaler(bare=bare), optax.sgd(1.0))
    state = tx.init(params)
    caught = _bare_warnings(lambda t=tx, s=state: t.update(jnp.ones(2), s, params), monkeypatch)
    assert len(caught) == expected, (spec, bare)
