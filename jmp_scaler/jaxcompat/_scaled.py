"""The block-scaled matmul: ``jax.nn.scaled_matmul`` from jax 0.11, an exact emulation before.

``jax.nn.scaled_matmul(a, b, a_scales, b_scales)`` (``a`` ``[B, M, K]``, ``b`` ``[B, N, K]``,
one scale per block of the last axis) binds the ``scaled_matmul`` primitive
(``jax/_src/cudnn/scaled_matmul_stablehlo.py``). Its lowerings:

* CUDA (jax 0.10 and 0.12): the ``__op$block_scaled_dot`` custom call, which XLA:GPU's block
  scaling rewriter sends to cuDNN on Blackwell and otherwise (H100, H200) expands into a
  dequantisation and an ordinary dot;
* CPU: none in jax 0.10 ("MLIR translation rule for primitive 'scaled_matmul' not found for
  platform cpu"); from jax 0.11 (jax#38813) the operands and scales are cast to the result
  dtype, multiplied block by block and contracted by one ``dot_general``.

:func:`scaled_matmul` below asks for a float32 result, so on jax >= 0.11 every platform
computes ``sum_k (a * a_scale) * (b * b_scale)`` of exact float32 products; on jax 0.10 the
same expression is written out (dequantise in float32, one float32 ``dot_general``), the
same numerics on every backend. Either way the operands are exact values of their storage
dtypes (float8 E4M3/E5M2 or float4 E2M1, scales E8M0 or E4M3), held in float32 by the caller.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

#: The custom call the CUDA lowering of ``scaled_matmul`` emits (XLA:GPU's block-scaled dot).
BLOCK_SCALED_DOT = "__op$block_scaled_dot"

_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])
#: Whether ``jax.nn.scaled_matmul`` lowers on every platform (CPU from jax 0.11).
USES_SCALED_MATMUL = _VERSION >= (0, 11) and hasattr(jax.nn, "scaled_matmul")


def _dequantize(x: jax.Array, scales: jax.Array) -> jax.Array:
  b, r, k = x.shape
  kb = scales.shape[-1]
  return (x.reshape(b, r, kb, k // kb) * scales[..., None]).reshape(b, r, k)


def scaled_matmul(a: jax.Array, b: jax.Array, a_scales: jax.Array, b_scales: jax.Array,
                  a_dtype: np.dtype, b_dtype: np.dtype, scale_dtype: np.dtype) -> jax.Array:
  """``sum_k a[., m, k] * a_scales[., m, k // bs] * b[., n, k] * b_scales[., n, k // bs]``.

  ``a`` ``[B, M, K]`` and ``b`` ``[B, N, K]`` are float32 arrays holding values exact in
  ``a_dtype`` and ``b_dtype``, the scales float32 arrays exact in ``scale_dtype``; the
  result is float32 ``[B, M, N]``. On jax >= 0.11 it is ``jax.nn.scaled_matmul`` of the
  operands cast to their storage dtypes (exact casts); before, the same sum as a float32
  ``dot_general``.
  """
  if USES_SCALED_MATMUL:
    return jax.nn.scaled_matmul(
      a.astype(a_dtype), b.astype(b_dtype), a_scales.astype(scale_dtype),
      b_scales.astype(scale_dtype), preferred_element_type=jnp.float32)
  return lax.dot_general(_dequantize(a, a_scales), _dequantize(b, b_scales),
                         (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
