"""Checkpoints that resume exactly, and the check of a restored scaler.

Floor 2, over ``scaling``.

* ``_io``: saving and restoring (Orbax, ``flax.serialization``, NNX objects);
* ``_restore_check``: judging a restored scaler state against the run's own.

The public names are exported from :mod:`jmp_scaler`; import them from there.
"""
