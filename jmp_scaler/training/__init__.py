"""Flax's train-state holders with the exact skip (named after ``flax.training``).

Floor 2, over ``scaling``.

* ``_train_state``: ``TrainState``, flax's linen ``TrainState`` whose
  ``apply_gradients`` skips a non-finite step exactly;
* ``_nnx_optimizer``: ``NNXOptimizer``, the same for ``nnx.Optimizer``.

The public names are exported from :mod:`jmp_scaler`; import them from there.
"""
