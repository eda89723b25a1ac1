"""jmp's API, on jmp_scaler: switch with one line, ``from jmp_scaler import jmp``.

Every public name of jmp 0.0.4 (``Policy``, ``get_policy``, ``half_dtype``,
``cast_to_full``, ``cast_to_half``, ``LossScale``, ``NoOpLossScale``,
``StaticLossScale``, ``DynamicLossScale``, ``all_finite``, ``select_tree``),
with jmp's behaviour where jmp is right and its bugs fixed (docs/migration.md,
"From jmp"): a policy here is a :class:`jmp_scaler.Policy`, so it also drives
``jmp_scaler.autocast``, ``autocast_linen``, ``autocast_nnx`` and
``policy.loss_scaler()``; ``DynamicLossScale`` keeps its scale in float32 and its
``min_loss_scale`` under ``jit``, and traces once.
"""

from jmp_scaler.jmp._loss_scale import DynamicLossScale as DynamicLossScale
from jmp_scaler.jmp._loss_scale import LossScale as LossScale
from jmp_scaler.jmp._loss_scale import NoOpLossScale as NoOpLossScale
from jmp_scaler.jmp._loss_scale import StaticLossScale as StaticLossScale
from jmp_scaler.jmp._loss_scale import all_finite as all_finite
from jmp_scaler.jmp._loss_scale import select_tree as select_tree
from jmp_scaler.jmp._policy import Policy as Policy
from jmp_scaler.jmp._policy import cast_to_full as cast_to_full
from jmp_scaler.jmp._policy import cast_to_half as cast_to_half
from jmp_scaler.jmp._policy import dtype_to_names as dtype_to_names
from jmp_scaler.jmp._policy import get_policy as get_policy
from jmp_scaler.jmp._policy import half_dtype as half_dtype

__version__ = "0.0.4"  # the jmp release whose API this is

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "select_tree",
)
