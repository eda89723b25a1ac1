"""The block-scaled matmul, ``jax.nn.scaled_matmul``, and its CPU lowering on jax 0.10.

``jax.nn.scaled_matmul(a, b, a_scales, b_scales)`` (``a`` ``[B, M, K]``, ``b`` ``[B, N, K]``,
one scale per block of the last axis) binds the ``scaled_matmul`` primitive
(``jax/_src/cudnn/scaled_matmul_stablehlo.py``). Its lowerings:

* CUDA (jax 0.10 and 0.12): the ``__op$block_scaled_dot`` custom call, which XLA:GPU's block
  scaling rewriter sends to cuDNN on Blackwell and otherwise (H100, H200) expands into a
  dequantisation and an ordinary dot;
* CPU: from jax 0.11 (jax#38813) the operands and scales are cast to the result dtype,
  multiplied block by block and contracted by one ``dot_general``; jax 0.10 has none ("MLIR
  translation rule for primitive 'scaled_matmul' not found for platform cpu").

On jax 0.10 :func:`scaled_matmul` registers that same CPU lowering (the emulation:
dequantise, one ``dot_general``) for the primitive, once, at its first call: the same
primitive and the same numerics at both ends of the supported range, and a jaxpr in which
``autocast`` meets a ``scaled_matmul`` of 8-bit operands, never a float32 dot it would narrow.
The primitive's place (``_scaled_matmul_p``) and ``mlir.register_lowering`` are the
internals read; a JAX without them raises :class:`~._errors.JaxInternalsError`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_scaler.jaxcompat._errors import missing

#: The custom call the CUDA lowering of ``scaled_matmul`` emits (XLA:GPU's block-scaled dot).
BLOCK_SCALED_DOT = "__op$block_scaled_dot"

_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])
#: Whether this jax lowers ``scaled_matmul`` on CPU itself (jax >= 0.11).
HAS_CPU_LOWERING = _VERSION >= (0, 11)


def _cpu_lowering(a, b, a_scales, b_scales, *, preferred_element_type):
  """jax 0.11's CPU lowering of ``scaled_matmul``, as it is written there."""
  a, b = a.astype(preferred_element_type), b.astype(preferred_element_type)
  sa, sb = a_scales.astype(preferred_element_type), b_scales.astype(preferred_element_type)
  bsz, m, k = a.shape
  n, ka, kb = b.shape[1], sa.shape[-1], sb.shape[-1]
  a = (a.reshape(bsz, m, ka, k // ka) * sa[..., None]).reshape(bsz, m, k)
  b = (b.reshape(bsz, n, kb, k // kb) * sb[..., None]).reshape(bsz, n, k)
  return lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))),
                         preferred_element_type=preferred_element_type)


@functools.cache
def _ensure_cpu_lowering() -> None:
  """Registers :func:`_cpu_lowering` for the primitive on jax 0.10 (once)."""
  if HAS_CPU_LOWERING:
    return
  try:
    from jax._src.cudnn import scaled_matmul_stablehlo as sm
    from jax._src.interpreters import mlir
    prim = sm._scaled_matmul_p
  except (ImportError, AttributeError):
    raise missing("_scaled_matmul_p", "jax._src.cudnn.scaled_matmul_stablehlo") from None
  mlir.register_lowering(prim, mlir.lower_fun(_cpu_lowering, multiple_results=False),
                         platform="cpu")


def scaled_matmul(a: jax.Array, b: jax.Array, a_scales: jax.Array, b_scales: jax.Array,
                  a_dtype: np.dtype, b_dtype: np.dtype, scale_dtype: np.dtype) -> jax.Array:
  """``sum_k a[., m, k] * a_scales[., m, k // bs] * b[., n, k] * b_scales[., n, k // bs]``.

  ``a`` ``[B, M, K]`` and ``b`` ``[B, N, K]`` are float32 arrays holding values exact in
  ``a_dtype`` and ``b_dtype``, the scales float32 arrays exact in ``scale_dtype``; the
  result is float32 ``[B, M, N]``: ``jax.nn.scaled_matmul`` of the operands cast to their
  storage dtypes (exact casts), on every platform and both ends of the supported range.
  """
  _ensure_cpu_lowering()
  return jax.nn.scaled_matmul(
    a.astype(a_dtype), b.astype(b_dtype), a_scales.astype(scale_dtype),
    b_scales.astype(scale_dtype), preferred_element_type=jnp.float32)
