"""Dtype policies: the string grammar, the casts, the platform default."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_scaler

f32, f16, bf16 = np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=float16,output=float32", (f32, f16, f32)),
        ("p=f32,c=bf16,o=f32", (f32, bf16, f32)),
        ("float32", (f32, f32, f32)),
        ("bf16", (bf16, bf16, bf16)),
        ("c=f16", (f32, f16, f16)),  # output follows compute
        ("p=f16", (f16, f16, f16)),  # compute follows params
        ("p=bf16,c=f32", (bf16, f32, f32)),
        ("o=bf16", (f32, f32, bf16)),
        (" P = Full , C = Float16 ", (f32, f16, f16)),
        ("c=half", (f32, f16, f16)),  # half is float16 off TPU
    ],
)
def test_grammar(spec, expected):
  p = jmp_scaler.get_policy(spec)
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("p=f32,q=f16", "'q'"),
        ("c=f8", "'f8'"),
        ("p=f32,params=f16", "'params' repeated"),
        ("c=f16,c=f16", "'compute' repeated"),
        ("p=f32,,c=f16", "malformed policy part ''"),
        ("p=", "malformed policy part 'p='"),
        ("=f16", "malformed policy part '=f16'"),
        ("c=f16=f32", "malformed"),
        ("", "non-empty"),
        (None, "non-empty"),
    ],
)
def test_bad_specs_name_the_offending_part(spec, fragment):
  with pytest.raises(ValueError) as err:
    jmp_scaler.get_policy(spec)
  assert fragment in str(err.value)


def test_policy_is_frozen_hashable_and_a_static_jit_argument():
  p = jmp_scaler.get_policy("p=f32,c=f16,o=f32")
  assert p == jmp_scaler.Policy(jnp.float32, "float16", np.float32)
  assert hash(p) == hash(jmp_scaler.Policy("float32", "float16", "float32"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.compute_dtype = f32

  f = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
  assert f(jnp.ones(2), p).dtype == f16
  assert f(jnp.ones(2), jmp_scaler.get_policy("c=bf16")).dtype == bf16
  assert str(p) == "p=f32,c=f16,o=f32"


def test_casts_touch_floating_leaves_only():
  p = jmp_scaler.get_policy("p=f32,c=bf16,o=f16")
  tree = {"w": jnp.ones(2), "h": jnp.ones(2, f16), "i": jnp.arange(2), "b": jnp.array([True]),
          "n": None, "py": 1.5, "np": np.ones(2, np.float64)}  # fmt: skip
  out = p.cast_to_compute(tree)
  assert out["w"].dtype == bf16 and out["h"].dtype == bf16 and out["np"].dtype == bf16
  assert out["i"].dtype == jnp.int32 and out["b"].dtype == jnp.bool_
  assert out["n"] is None and out["py"] == 1.5
  assert p.cast_to_param(tree)["h"].dtype == f32
  assert p.cast_to_output(tree)["w"].dtype == f16
  assert p.with_output_dtype(jnp.float32).output_dtype == f32


@pytest.mark.parametrize("dtype", ["int32", jnp.bool_, "not-a-dtype"])
def test_policy_rejects_non_floating_dtypes(dtype):
  with pytest.raises(ValueError, match="compute_dtype"):
    jmp_scaler.Policy(f32, dtype, f32)


@dataclasses.dataclass
class FakeDevice:
  platform: str
  compute_capability: str | None = None


@pytest.mark.parametrize(
    "device, compute",
    [
        (FakeDevice("tpu"), bf16),
        (FakeDevice("gpu", "9.0"), bf16),
        (FakeDevice("gpu", "8.0"), bf16),
        (FakeDevice("gpu", "7.5"), f16),
        (FakeDevice("gpu", "6.1"), f16),
        (FakeDevice("rocm"), bf16),
        (FakeDevice("cpu"), f32),
    ],
)
def test_default_policy_follows_the_device(device, compute):
  p = jmp_scaler.default_policy(device)
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (f32, compute, f32)


def test_default_policy_on_this_machine_is_float32():
  assert jmp_scaler.default_policy().compute_dtype == f32  # the tests run on CPU


def test_policy_recommends_its_loss_scaler():
  params = {"w": jnp.ones(2)}
  fp16 = jmp_scaler.get_policy("c=f16")
  assert fp16.needs_loss_scaling and jmp_scaler.get_policy("p=f16").needs_loss_scaling
  state = fp16.loss_scaler(init_scale=8.0).init(params)
  assert float(jmp_scaler.get_scale(state)) == 8.0
  f16_tree = jax.tree.structure(optax.chain(fp16.loss_scaler(), optax.sgd(1.0)).init(params))
  for spec in ("c=bf16", "f32"):
    p = jmp_scaler.get_policy(spec)
    assert not p.needs_loss_scaling
    tx = optax.chain(p.loss_scaler(init_scale=8.0), optax.sgd(1.0))
    state = tx.init(params)
    # A scaler that scales by 1 and still skips: same structure and metrics as float16.
    assert float(jmp_scaler.get_scale(state)) == 1.0
    assert jax.tree.structure(state) == f16_tree
    assert set(jmp_scaler.scale_metrics(state)) == set(jmp_scaler.scale_metrics(
        optax.chain(fp16.loss_scaler(), optax.sgd(1.0)).init(params)))
    _, state = jmp_scaler.skip_nonfinite(tx).update({"w": jnp.array([jnp.nan, 1.0])}, state)
    assert bool(state[0].skipped) and float(jmp_scaler.get_scale(state)) == 1.0
  with pytest.raises(ValueError, match="growth_factor"):
    jmp_scaler.get_policy("bf16").loss_scaler(growth_factor=0.5)  # validated anyway


@pytest.mark.parametrize("dtypes", [
    ("f32", "f16", "f32"), ("float32", "bf16", "float32"), ("full", "half", "f32"),
    (jnp.float32, "f16", np.float32), (np.dtype("float32"), jnp.bfloat16, "float32"),
])
def test_policy_constructor_reads_the_librarys_own_names(dtypes):
  p = jmp_scaler.Policy(*dtypes)
  assert p.compute_dtype in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
  assert p.param_dtype == f32 and p.output_dtype == f32


@pytest.mark.parametrize("bad, fragment", [
    ((None, None, None), "param_dtype must be a floating dtype, got None"),
    ((jnp.float32, "f128", jnp.float32), "compute_dtype must be a floating dtype"),
    ((jnp.float32, np.float128, jnp.float32), "compute_dtype must be a floating dtype"),
    ((jnp.float32, jnp.int32, jnp.float32), "compute_dtype must be a floating dtype"),
])
def test_policy_constructor_refuses_what_numpy_would_misread(bad, fragment):
  with pytest.raises(ValueError, match=re.escape(fragment)):
    jmp_scaler.Policy(*bad)


@pytest.mark.parametrize("spec", [
    "f32", "bf16", "f16", "f64", "float64", "p=f32,c=f16,o=f32", "p=f32,c=bf16",
    "p=bf16,c=bf16,o=f32", "p=f64,c=f32",
])
def test_str_round_trips_and_dtype_objects_are_accepted(spec):
  p = jmp_scaler.get_policy(spec)
  assert jmp_scaler.get_policy(str(p)) == p
  assert jmp_scaler.get_policy(p) is p
  assert jmp_scaler.get_policy(p.compute_dtype) == jmp_scaler.Policy(*[p.compute_dtype] * 3)


def test_get_policy_accepts_jnp_dtype_objects():
  assert jmp_scaler.get_policy(jnp.float16) == jmp_scaler.get_policy("f16")
  assert jmp_scaler.get_policy(jnp.bfloat16).compute_dtype == np.dtype(jnp.bfloat16)


def test_policy_optimizer_matches_its_param_dtype():
  params16 = {"w": jnp.ones(3, jnp.bfloat16)}
  low = jmp_scaler.get_policy("p=bf16,c=bf16,o=f32").optimizer(1e-3)
  names = [type(s).__name__ for s in low.init(params16)]
  assert names[0] == "LossScaleState" and names[-1] == "StochasticRoundState"
  master = jmp_scaler.get_policy("p=f32,c=f16,o=f32").optimizer(1e-3, init_scale=8.0)
  state = master.init({"w": jnp.ones(3)})
  assert float(jmp_scaler.get_scale(state)) == 8.0
  assert "StochasticRoundState" not in [type(s).__name__ for s in jax.tree.leaves(
      state, is_leaf=lambda x: hasattr(x, "_fields"))]
