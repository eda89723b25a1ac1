"""Diagnostics: why training went NaN, or would underflow, and what the scale did.

Floor 3, the top: it reads the scaler's state (``scaling``) and the policy
grammar's dtypes (``precision``).

* ``_nonfinite``: the per-leaf non-finite report;
* ``_underflow``: the per-leaf underflow report for a half dtype;
* ``_monitor``: watching the scale from the host;
* ``_find``: the first operation that made an inf or a NaN (``find_nonfinite``), and
  ``_walk``, the compiled passes that find it in a jaxpr.

The public names are exported from :mod:`jmp_scaler`; import them from there.
"""
