"""Precision: which dtype each value is stored, computed and returned in.

Floor 2: a policy recommends a scaler (``scaling``) and an optimizer (``lowbit``).

* ``_policy``: dtype policies and their string grammar;
* ``_autocast``: ``autocast``, mixed precision as a function transformation;
* ``_rules``: autocast's op table, and the one place that knows JAX's internals;
* ``_casts``: what the casts a traced function already holds mean under autocast;
* ``_modules``: what per-module autocast shares; ``_linen`` and ``_nnx`` apply it to
  Flax linen and NNX models.

The public names are exported from :mod:`jmp_scaler`; import them from there.
"""
