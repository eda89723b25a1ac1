"""Low-bit arithmetic: 16-bit parameters without float32 master weights.

Floor 1, over the ground floor; it knows nothing of the scaler.

* ``_stochastic``: stochastic rounding and Kahan summation of updates;
* ``_adam16``: Adam with 16-bit moments, and the optimizer a dtype policy calls for.

The public names are exported from :mod:`jmp_scaler`; import them from there.
"""
