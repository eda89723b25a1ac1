"""Low-bit arithmetic: 16-bit parameters without float32 master weights, fp8 matmuls.

Floor 1, over the ground floor; it knows nothing of the scaler.

* ``_stochastic``: stochastic rounding and Kahan summation of updates;
* ``_adam16``: Adam with 16-bit moments, and the optimizer a dtype policy calls for;
* ``_fp8``: fp8 matmuls with per-tensor current scaling (``fp8_dot_general``), in the
  form XLA:GPU runs as an fp8 GEMM.
* ``_block``: block-scaled matmuls, MXFP8 and NVFP4 (``block_scaled_dot_general``), their
  quantisers and recipes.

The public names are exported from :mod:`jmp_scaler`; import them from there.
"""
