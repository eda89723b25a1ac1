"""Several autocast-wrapped functions in one process, on pytrees whose metadata holds arrays.

google-tunix's sampling state keeps ``num_input_tokens`` as a ``jnp.array`` in a static
(``pytree_node=False``) field. JAX compares such metadata with ``==`` in its caches; inside
an enclosing trace (tunix's ``jax.jit`` of the sampler, or autocast's own ``jit``) that
comparison is traced and cannot be made a bool. Before the fix the first autocast-wrapped
sampler ran and the second (another policy, or the same) failed with
``TracerBoolConversionError`` / "arrays cannot be passed as metadata fields" (issue 46).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_scaler
from tests import _xla

F16, BF16 = "p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32"
fast_jit = functools.partial(jax.jit, compiler_options=_xla.compile_options())
_RNG = np.random.default_rng(0)
W = jnp.asarray(_RNG.normal(size=(8, 8)) / np.sqrt(8), jnp.float32)
X = jnp.asarray(_RNG.normal(size=(2, 8)), jnp.float32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "step"],
                   meta_fields=["n"])  # fmt: skip
@dataclasses.dataclass
class State:
  """A decoding state as tunix's: ``n`` is metadata, and it is an array."""

  x: jax.Array
  step: jax.Array
  n: jax.Array  # metadata holding a (0-d, concrete) array


def fresh_state() -> State:  # a new metadata array each time, as each tunix call makes one
  return State(x=jnp.array(X), step=jnp.zeros((), jnp.int32), n=jnp.array(3, jnp.int32))


def step(w, s: State) -> State:
  return State(x=jnp.tanh(s.x @ w), step=s.step + 1, n=s.n)


def decode(w, s: State) -> State:  # tunix's _decode_fn: a while_loop over the state
  return jax.lax.while_loop(lambda s: s.step < s.n, lambda s: step(w, s), s)


def reference(w, x, n=3):
  for _ in range(n):
    x = jnp.tanh(x @ w)
  return x


def close(out, policy):
  tol = 2e-2 if "bf16" in policy else 2e-3
  np.testing.assert_allclose(np.asarray(out.x), np.asarray(reference(W, X)), atol=tol)


@pytest.mark.parametrize("outer", ["jit", "eager"])
def test_several_autocasts_of_functions_whose_metadata_holds_arrays(outer):
  # Another policy, then the first policy again: each a new autocast, as a new sampler makes.
  for policy in (F16, BF16, F16):
    f = jmp_scaler.autocast(decode, policy)
    f = fast_jit(f) if outer == "jit" else f
    out = f(W, fresh_state())
    assert isinstance(out, State) and int(out.n) == 3 and int(out.step) == 3
    assert out.x.dtype == jnp.float32
    close(out, policy)


def test_one_autocast_under_several_enclosing_jits():
  f = jmp_scaler.autocast(step, F16)  # its statics are compared inside each enclosing trace
  for outer in (fast_jit(f), fast_jit(lambda w, s: f(w, s)), fast_jit(lambda w, s: f(w, s))):
    out = outer(W, fresh_state())
    np.testing.assert_allclose(np.asarray(out.x), np.asarray(jnp.tanh(X @ W)), atol=2e-3)
  assert int(f(W, fresh_state()).step) == 1  # and eagerly, after them


def test_nested_autocast_and_full_precision_regions_of_such_states():
  inner = jmp_scaler.full_precision(step)
  outer = jmp_scaler.autocast(lambda w, s: inner(w, step(w, s)), BF16)
  for f in (outer, jmp_scaler.autocast(outer, F16), fast_jit(outer), fast_jit(outer)):
    out = f(W, fresh_state())
    assert int(out.step) == 2
    np.testing.assert_allclose(np.asarray(out.x), np.asarray(reference(W, X, 2)), atol=2e-2)


class Tiny(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.dense(x))


def test_samplers_of_nnx_modules_as_tunix_builds_them():
  # tunix's Sampler: the module split into graphdef and state, merged inside a jitted
  # prefill/decode that takes the state and a sampling state with array metadata.
  outs = []
  for seed, policy in ((0, F16), (1, BF16), (0, BF16), (0, F16)):
    graphdef, state = nnx.split(Tiny(nnx.Rngs(seed)))

    def decode_fn(params, s, graphdef=graphdef):
      model = nnx.merge(graphdef, params)
      body = lambda s: State(x=model(s.x), step=s.step + 1, n=s.n)
      return jax.lax.while_loop(lambda s: s.step < s.n, body, s)

    out = fast_jit(jmp_scaler.autocast(decode_fn, policy), donate_argnums=(1,))(
      state, fresh_state())  # fmt: skip
    want = fresh_state().x
    model = nnx.merge(graphdef, state)
    for _ in range(3):
      want = model(want)
    np.testing.assert_allclose(np.asarray(out.x), np.asarray(want), atol=2e-2)
    outs.append(out.x)
  np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[3]))  # same model and policy


def test_results_whose_structure_follows_the_shapes():
  f = jmp_scaler.autocast(lambda x: tuple(x), F16)  # a tuple as long as the first axis
  for n in (2, 3, 2):
    out = f(jnp.ones((n, 4)))
    assert isinstance(out, tuple) and len(out) == n
    assert all(o.shape == (4,) and o.dtype == jnp.float32 for o in out)
