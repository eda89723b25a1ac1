"""jmp_scaler: mixed-precision training for JAX, with an exact loss scaler.

The scaler is an Optax gradient transformation whose state lives in
``opt_state``::

  tx = optax.chain(jmp_scaler.dynamic_scale(), optax.adam(1e-3))

Every public name is imported from here. The code lives in one wing per concept,
each importing only from wings on lower floors (``tools/house.py`` draws it and
``tests/test_house.py`` holds it):

* floor 0, the ground floor: ``_leaves`` (which leaves are touched, in which
  dtype) and ``_validation`` (argument checks); beside it ``jaxcompat``, the one
  place that reads JAX's internals (jaxpr types, the parameters of the
  higher-order primitives, source information, manual mesh axes);
* floor 1: ``scaling`` (the scaler, the exact skip, accumulation, several
  devices) and ``lowbit`` (stochastic rounding, Kahan summation, 16-bit Adam,
  fp8 matmuls);
* floor 2: ``precision`` (policies, autocast), ``training`` (``TrainState``,
  ``NNXOptimizer``) and ``checkpoint``;
* floor 3: ``diagnostics`` (reports and the monitor).
"""

# The loss scaler: an Optax transformation and its state.
from jmp_scaler.scaling._scaler import DEFAULT_MAX_SCALE as DEFAULT_MAX_SCALE
from jmp_scaler.scaling._scaler import DEFAULT_MIN_SCALE as DEFAULT_MIN_SCALE
from jmp_scaler.scaling._scaler import LossScaleState as LossScaleState
from jmp_scaler.scaling._scaler import LossScaler as LossScaler
from jmp_scaler.scaling._scaler import ScaleConfig as ScaleConfig
from jmp_scaler.scaling._scaler import all_finite as all_finite
from jmp_scaler.scaling._scaler import dynamic_scale as dynamic_scale
from jmp_scaler.scaling._scaler import fixed_scale as fixed_scale
from jmp_scaler.scaling._scaler import no_scale as no_scale
from jmp_scaler.scaling._scaler import unscale as unscale

# Exact skip around a chain: Flax TrainState, NNX, pure Optax; gradients of the scaled loss.
from jmp_scaler.training._train_state import TrainState as TrainState
from jmp_scaler.training._nnx_optimizer import NNXOptimizer as NNXOptimizer
from jmp_scaler.scaling._skip import skip_nonfinite as skip_nonfinite
from jmp_scaler.scaling._grad import value_and_grad as value_and_grad

# Reading the scaler's state.
from jmp_scaler.scaling._lookup import find_scale_state as find_scale_state
from jmp_scaler.scaling._lookup import get_scale as get_scale
from jmp_scaler.scaling._lookup import scale_metrics as scale_metrics

# Dtype policies.
from jmp_scaler.precision._policy import Policy as Policy
from jmp_scaler.precision._policy import default_policy as default_policy
from jmp_scaler.precision._policy import get_policy as get_policy

# Precision: autocast (function transformation) and per-module autocast.
from jmp_scaler.precision._autocast import DEFAULT_RULES as DEFAULT_RULES
from jmp_scaler.precision._autocast import autocast as autocast
from jmp_scaler.precision._autocast import full_precision as full_precision
from jmp_scaler.precision._linen import LINEN_FLOAT32_MODULES as LINEN_FLOAT32_MODULES
from jmp_scaler.precision._linen import autocast_linen as autocast_linen
from jmp_scaler.precision._nnx import NNX_FLOAT32_MODULES as NNX_FLOAT32_MODULES
from jmp_scaler.precision._nnx import autocast_nnx as autocast_nnx

# bfloat16 without float32 master weights.
from jmp_scaler.lowbit._stochastic import KahanState as KahanState
from jmp_scaler.lowbit._stochastic import StochasticRoundState as StochasticRoundState
from jmp_scaler.lowbit._stochastic import kahan_summation as kahan_summation
from jmp_scaler.lowbit._stochastic import stochastic_cast as stochastic_cast
from jmp_scaler.lowbit._stochastic import stochastic_round as stochastic_round
from jmp_scaler.lowbit._adam16 import ScaleByAdamState as ScaleByAdamState
from jmp_scaler.lowbit._adam16 import adam as adam
from jmp_scaler.lowbit._adam16 import adamw as adamw
from jmp_scaler.lowbit._adam16 import low_precision_optimizer as low_precision_optimizer
from jmp_scaler.lowbit._adam16 import scale_by_adam as scale_by_adam

# FP8 matmuls: per-tensor current scaling; MXFP8 and NVFP4 block scaling.
from jmp_scaler.lowbit._block import MxFp8Recipe as MxFp8Recipe
from jmp_scaler.lowbit._block import Nvfp4Recipe as Nvfp4Recipe
from jmp_scaler.lowbit._block import block_scaled_dot_general as block_scaled_dot_general
from jmp_scaler.lowbit._fp8 import Fp8Recipe as Fp8Recipe
from jmp_scaler.lowbit._fp8 import fp8_dot_general as fp8_dot_general

# Scale-out: gradient accumulation, several devices.
from jmp_scaler.scaling._accumulate import AccumulationState as AccumulationState
from jmp_scaler.scaling._accumulate import accumulate_gradients as accumulate_gradients
from jmp_scaler.scaling._distributed import check_axis_name as check_axis_name
from jmp_scaler.scaling._distributed import scale_in_sync as scale_in_sync

# Checkpoints.
from jmp_scaler.checkpoint._io import from_bytes as from_bytes
from jmp_scaler.checkpoint._io import restore_checkpoint as restore_checkpoint
from jmp_scaler.checkpoint._io import save_checkpoint as save_checkpoint
from jmp_scaler.checkpoint._io import to_bytes as to_bytes
from jmp_scaler.checkpoint._restore_check import check_restored as check_restored

# Diagnostics.
from jmp_scaler.diagnostics._nonfinite import NonFiniteReport as NonFiniteReport
from jmp_scaler.diagnostics._compare import LayerError as LayerError
from jmp_scaler.diagnostics._compare import PrecisionComparison as PrecisionComparison
from jmp_scaler.diagnostics._compare import compare_precision as compare_precision
from jmp_scaler.diagnostics._find import NonFiniteOp as NonFiniteOp
from jmp_scaler.diagnostics._find import find_nonfinite as find_nonfinite
from jmp_scaler.diagnostics._nonfinite import nonfinite_report as nonfinite_report
from jmp_scaler.diagnostics._parity import LogprobParity as LogprobParity
from jmp_scaler.diagnostics._parity import logprob_parity as logprob_parity
from jmp_scaler.diagnostics._underflow import UnderflowReport as UnderflowReport
from jmp_scaler.diagnostics._underflow import underflow_report as underflow_report
from jmp_scaler.diagnostics._monitor import ScaleMonitor as ScaleMonitor
from jmp_scaler.diagnostics._monitor import ScaleWarning as ScaleWarning
from jmp_scaler.diagnostics._monitor import to_scalars as to_scalars

__version__ = "0.1.0"

__all__ = (
    "AccumulationState",
    "DEFAULT_MAX_SCALE",
    "DEFAULT_MIN_SCALE",
    "DEFAULT_RULES",
    "Fp8Recipe",
    "KahanState",
    "LINEN_FLOAT32_MODULES",
    "LayerError",
    "LogprobParity",
    "LossScaleState",
    "LossScaler",
    "MxFp8Recipe",
    "NNXOptimizer",
    "NNX_FLOAT32_MODULES",
    "NonFiniteOp",
    "NonFiniteReport",
    "Nvfp4Recipe",
    "Policy",
    "PrecisionComparison",
    "ScaleByAdamState",
    "ScaleConfig",
    "ScaleMonitor",
    "ScaleWarning",
    "StochasticRoundState",
    "TrainState",
    "UnderflowReport",
    "accumulate_gradients",
    "adam",
    "adamw",
    "all_finite",
    "autocast",
    "autocast_linen",
    "autocast_nnx",
    "block_scaled_dot_general",
    "check_axis_name",
    "check_restored",
    "compare_precision",
    "default_policy",
    "dynamic_scale",
    "find_nonfinite",
    "find_scale_state",
    "fixed_scale",
    "fp8_dot_general",
    "from_bytes",
    "full_precision",
    "get_policy",
    "get_scale",
    "kahan_summation",
    "logprob_parity",
    "low_precision_optimizer",
    "no_scale",
    "nonfinite_report",
    "restore_checkpoint",
    "save_checkpoint",
    "scale_by_adam",
    "scale_in_sync",
    "scale_metrics",
    "skip_nonfinite",
    "stochastic_cast",
    "stochastic_round",
    "to_bytes",
    "to_scalars",
    "underflow_report",
    "unscale",
    "value_and_grad",
)
