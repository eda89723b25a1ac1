"""Loss scaling: the scaler and the exact skip of a non-finite step.

Floor 1, over the ground floor (``jmp_scaler._leaves``, ``jmp_scaler._validation``).

* ``_scaler``: the Optax transformation, its state, the scaling rule, the finiteness
  check, and :func:`decide` (the decision and the state a skip leaves);
* ``_lookup``: finding the scaler's state inside any ``opt_state``;
* ``_skip``: the skip around a whole chain (``skip_nonfinite``), which the training
  wing's ``TrainState`` and ``NNXOptimizer`` take too;
* ``_grad``: the scaled ``value_and_grad``;
* ``_distributed``: one decision on every device;
* ``_accumulate``: gradient accumulation with one scale per window.

The public names are exported from :mod:`jmp_scaler`; import them from there.
"""
