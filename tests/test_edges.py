"""Edges where a call used to fail silently: NNX states, arguments, metrics, restores.

Each test here failed before its fix (issue 9): the call returned a plausible
default or a wrong result instead of raising or doing what the user meant.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_scaler
from jmp_scaler import _validation as validation

# --------------------------------------------------------------------------
# The scaler is found in every form NNX hands out.


def _nnx_optimizer(cls=jmp_scaler.NNXOptimizer):
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  tx = optax.chain(jmp_scaler.dynamic_scale(512.0), optax.adam(1e-3))
  return model, cls(model, tx, wrt=nnx.Param)


@pytest.mark.parametrize("cls", [jmp_scaler.NNXOptimizer, nnx.Optimizer])
def test_the_scaler_is_found_in_every_nnx_form(cls):
  model, opt = _nnx_optimizer(cls)
  _, split_state = nnx.split((model, opt))
  forms = {
      "live optimizer": opt,
      "live (model, optimizer)": (model, opt),
      "opt.opt_state": opt.opt_state,
      "nnx.state(optimizer)": nnx.state(opt),
      "nnx.split((model, optimizer))": split_state,
      "nnx.to_pure_dict(nnx.state(optimizer))": nnx.to_pure_dict(nnx.state(opt)),
      "nnx.to_pure_dict of the split": nnx.to_pure_dict(split_state),
  }
  for name, form in forms.items():
    assert float(jmp_scaler.get_scale(form)) == 512.0, name
    metrics = jmp_scaler.scale_metrics(form)
    assert float(metrics["scale"]) == 512.0 and int(metrics["steps"]) == 0, name
    found = jmp_scaler.find_scale_state(form)
    assert isinstance(found, jmp_scaler.LossScaleState), name
    assert not isinstance(found.scale, nnx.Variable), name
    monitor = jmp_scaler.ScaleMonitor.for_state(form)
    assert monitor.growth_factor == 2.0, name


def test_get_scale_under_nnx_jit_on_a_split_state():
  model, opt = _nnx_optimizer()
  graphdef, state = nnx.split((model, opt))
  scale = jax.jit(lambda s: jmp_scaler.get_scale(s))(state)
  assert float(scale) == 512.0


@pytest.mark.parametrize("name, value", [
    ("a model without optimizer", nnx.Linear(2, 2, rngs=nnx.Rngs(0))),
    ("nnx.state(model)", nnx.state(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))),
    ("an array", jnp.ones(3)),
    ("a number", 1.0),
    ("None", None),
])
def test_values_that_cannot_hold_a_scaler_raise(name, value):
  with pytest.raises(ValueError, match="cannot hold a loss scaler"):
    jmp_scaler.get_scale(value)


def test_a_graphdef_alone_raises():
  graphdef, _ = nnx.split(_nnx_optimizer()[1])
  with pytest.raises(ValueError, match="GraphDef"):
    jmp_scaler.get_scale(graphdef)


def test_an_optimizer_state_without_a_scaler_has_no_scale_and_no_metrics():
  state = optax.adam(1.0).init(jnp.ones(2))
  for read in (jmp_scaler.get_scale, jmp_scaler.scale_metrics):
    with pytest.raises(ValueError, match="no_scale"):
      read(state)
    with pytest.raises(ValueError, match="no_scale"):
      read(optax.identity().init(jnp.ones(2)))
  assert jmp_scaler.find_scale_state(state) is None


# --------------------------------------------------------------------------
# Arguments: the value that is stored is the value that is checked.


@pytest.mark.parametrize("kwargs, fragment", [
    ({"growth_factor": 1e39}, "growth_factor must be finite and > 1 in float32"),
    ({"growth_factor": 1 + 1e-9}, "stored as 1.0"),
    ({"backoff_factor": 1e-46}, "stored as 0.0"),
    ({"backoff_factor": 1 - 1e-9}, "stored as 1.0"),
    ({"backoff_factor": 1e-40}, "normal float32"),
    ({"init_scale": jnp.ones(2)}, "init_scale must be a scalar"),
    ({"growth_interval": jnp.asarray(2.5)}, "growth_interval must be an integer"),
    ({"init_scale": jnp.asarray(True)}, "init_scale must be a real number"),
])
def test_factors_that_round_away_and_bad_arrays_are_refused(kwargs, fragment):
  with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
    jmp_scaler.dynamic_scale(**kwargs)


def test_zero_d_array_arguments_are_accepted_like_numbers():
  tx = jmp_scaler.dynamic_scale(
      jnp.asarray(2.0**15), growth_factor=np.float32(4.0), growth_interval=np.int64(3),
      backoff_factor=jnp.asarray(0.25), hysteresis=jnp.asarray(2),
  )
  state = tx.init(None)
  assert float(state.scale) == 2.0**15 and int(state.config.growth_interval) == 3
  assert float(state.config.growth_factor) == 4.0 and int(state.config.hysteresis) == 2
  assert float(jmp_scaler.fixed_scale(np.float16(8.0)).init(None).scale) == 8.0
  # bfloat16 and fp8 scalars (ml_dtypes: not numbers.Real) are numbers too.
  assert float(jmp_scaler.dynamic_scale(jnp.bfloat16(2.0**15)).init(None).scale) == 2.0**15
  assert float(jmp_scaler.fixed_scale(jnp.float8_e4m3fn(8.0)).init(None).scale) == 8.0


def test_a_traced_argument_is_refused_with_a_clear_error():
  def build(s):
    jmp_scaler.dynamic_scale(s)
    return s

  with pytest.raises(ValueError, match="init_scale must be a concrete number"):
    jax.jit(build)(jnp.float32(4.0))


@pytest.mark.parametrize("flags, on", [
    ("--xla_cpu_enable_fast_math=true", True),
    ("--xla_cpu_enable_fast_math", True),
    ("--xla_cpu_enable_fast_math=1", True),
    ("--xla_cpu_enable_fast_math=True --foo=1", True),
    ("--xla_gpu_enable_fast_min_max", True),
    ("--xla_cpu_fast_math_honor_nans=true", False),
    ("--xla_cpu_enable_fast_math=false", False),
    ("--xla_cpu_enable_fast_math=0", False),
    ("--xla_force_host_platform_device_count=8", False),
    ("", False),
])
def test_every_spelling_of_fast_math_is_recognised(flags, on):
  assert bool(validation.fast_math_flags(flags)) == on


def test_fast_math_warns_at_construction(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math")
  with pytest.warns(UserWarning, match="fast math"):
    jmp_scaler.dynamic_scale()


# --------------------------------------------------------------------------
# Metrics.


def test_to_scalars_takes_a_bfloat16_loss():
  out = jmp_scaler.to_scalars({"loss": jnp.asarray(1.5, jnp.bfloat16), "n": jnp.int32(3)})
  assert out == {"loss": 1.5, "n": 3} and isinstance(out["n"], int)
  with pytest.raises(ValueError, match="'z' must be a scalar"):
    jmp_scaler.to_scalars({"z": jnp.asarray(1 + 2j)})
