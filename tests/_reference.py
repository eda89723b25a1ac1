"""A reference model of the scaling rule, transcribed from PyTorch.

``torch/csrc/.../AmpKernels``' ``_amp_update_scale_``: on overflow
``scale *= backoff`` and the tracker resets; otherwise the tracker counts and,
on reaching the interval, ``scale *= growth`` if the result is finite in
float32, and the tracker resets. The factors are doubles multiplied into a
float32 scale and rounded once, as in PyTorch. ``min_scale``, ``max_scale``
and ``hysteresis`` (Megatron-LM's rule) extend it; their defaults reduce it
to PyTorch's.
"""

import numpy as np

F32 = np.finfo(np.float32)


def reference_history(
    overflows,
    init_scale=2.0**16,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    min_scale=float(F32.tiny),
    max_scale=float(F32.max),
    hysteresis=1,
):
  """Returns the (scale, growth_tracker) after each step of ``overflows``."""
  scale = np.float32(init_scale)
  tracker = 0
  tolerance = hysteresis
  out = []
  for overflow in overflows:
    if overflow:
      tracker = 0
      tolerance = max(tolerance - 1, 0)
      if tolerance == 0:
        scale = max(np.float32(np.float64(scale) * backoff_factor), np.float32(min_scale))
    else:
      tracker += 1
      if tracker == growth_interval:
        grown = np.float32(np.float64(scale) * growth_factor)
        if np.isfinite(grown):
          scale = min(grown, np.float32(max_scale))
        tracker = 0
        tolerance = hysteresis
    out.append((float(scale), tracker))
  return out
