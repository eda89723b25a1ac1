"""Diagnostics: why training went NaN, or would underflow, and what the scale did.

Floor 3, the top: it reads the scaler's state (``scaling``) and the policy
grammar's dtypes (``precision``).

* ``_nonfinite``: the per-leaf non-finite report;
* ``_underflow``: the per-leaf underflow report for a half dtype;
* ``_monitor``: watching the scale from the host;
* ``_find``: the first operation that made an inf or a NaN (``find_nonfinite``),
  ``_walk``, the compiled passes that find it in a jaxpr (and evaluate one widened to
  float32), and ``_upstream``, the same function in float32 and the upstream rounding;
* ``_compare``: the float32 baseline layer by layer (``compare_precision``);
* ``_call``: ``fn(*args)`` as a function of its array leaves, shared by the last two.

The public names are exported from :mod:`jmp_scaler`; import them from there.
"""
