"""Watching the loss scale from the host: warnings, a summary, loggable scalars."""

from __future__ import annotations

import collections
import math
import warnings
from array import array
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_scaler import _validation as validation
from jmp_scaler.scaling._lookup import find_scale_state
from jmp_scaler.scaling._scaler import DEFAULT_MAX_SCALE, DEFAULT_MIN_SCALE

_F32_MAX = float(np.finfo(np.float32).max)


class ScaleWarning(UserWarning):
  """Issued by :class:`ScaleMonitor` when the loss scale misbehaves."""


def to_scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float | int]:
  """Host-side Python numbers from a metrics dict, for any metric writer.

  One device-to-host transfer for the whole dict. Scalars become ``int``
  (booleans and integers) or ``float``; nested dicts are flattened with
  ``/``; :class:`jmp_scaler.NonFiniteReport` and
  :class:`jmp_scaler.UnderflowReport` values contribute their ``to_dict()``.
  The result goes straight to ``clu.metric_writers``'s
  ``writer.write_scalars(step, scalars)``, or to TensorBoard with
  ``for k, v in scalars.items(): writer.add_scalar(k, v, step)``.

  Args:
    metrics: e.g. ``{**jmp_scaler.scale_metrics(opt_state), "loss": loss}``.
    prefix: prepended to every key, e.g. ``"train/"``.

  Returns:
    A flat ``dict[str, int | float]``.

  Raises:
    ValueError: naming the key, for a value that is not a scalar.
  """
  out: dict[str, float | int] = {}
  for key, value in jax.device_get(metrics).items():
    name = f"{prefix}{key}"
    if hasattr(value, "to_dict"):
      out.update(value.to_dict(name))
    elif isinstance(value, Mapping):
      out.update(to_scalars(value, f"{name}/"))
    else:
      v = np.asarray(value)
      # jnp.issubdtype knows bfloat16 (a bf16 loss is normal under a bf16 policy).
      numeric = jnp.issubdtype(v.dtype, jnp.number) or v.dtype == np.bool_
      if v.size != 1 or not numeric or jnp.issubdtype(v.dtype, jnp.complexfloating):
        raise ValueError(f"metric {name!r} must be a scalar (real, integer or bool), got {value!r}")
      out[name] = float(v.item()) if jnp.issubdtype(v.dtype, jnp.floating) else int(v.item())
  return out


class ScaleMonitor:
  """Consumes :func:`jmp_scaler.scale_metrics` over time, on the host.

  Warns once per kind (a :class:`ScaleWarning`, also recorded in
  ``warnings_seen``) when the scale

  * collapses: falls by ``collapse_factor`` or more within ``window`` steps;
  * sits at ``min_scale`` (it cannot back off any further);
  * skips more than ``max_skip_rate`` of the updates over ``window`` steps;
  * is pinned at ``max_scale`` (or can no longer grow in float32) for
    ``window`` steps (the scale only grows when gradients vanish).

  The skips before the first applied update are the scaler's calibration
  (finding a scale from ``init_scale``), not a collapse: they are counted
  apart and the rate and collapse checks start after them (or after
  ``window`` steps, if no update is ever applied). Feed it every
  step or every N steps (it reads the ``steps`` and ``total_skips``
  counters, so sparse logging loses nothing); values may also be stacked
  along a leading axis (metrics of a ``lax.scan``). Each :meth:`update`
  costs one device-to-host transfer: call it as often as you log.

  Args:
    window: steps over which collapse, skip rate and pinning are judged.
    collapse_factor: a fall by this factor within ``window`` is a collapse.
    max_skip_rate: the highest acceptable fraction of skipped updates.
    min_scale, max_scale, growth_factor: the scaler's settings (read them
      from the state with :meth:`for_state`).

  Examples:
    >>> import optax, jax.numpy as jnp, jmp_scaler
    >>> tx = optax.chain(jmp_scaler.dynamic_scale(), optax.sgd(0.1))
    >>> opt_state = tx.init({"w": jnp.ones(2)})
    >>> monitor = jmp_scaler.ScaleMonitor.for_state(opt_state)
    >>> for _ in range(3):
    ...   _, opt_state = tx.update({"w": jnp.ones(2)}, opt_state)
    ...   _ = monitor.update(jmp_scaler.scale_metrics(opt_state))
    >>> print(monitor.format_summary())
    3 steps, 0 skipped (0%); scale final 65536, lowest 65536, highest 65536; no warnings
  """

  def __init__(
      self,
      *,
      window: int = 200,
      collapse_factor: float = 256.0,
      max_skip_rate: float = 0.05,
      min_scale: float = DEFAULT_MIN_SCALE,
      max_scale: float = DEFAULT_MAX_SCALE,
      growth_factor: float = 2.0,
  ):
    window = validation.integer("window", window, 1)
    collapse_factor = validation.real("collapse_factor", collapse_factor)
    if not 1 < collapse_factor < math.inf:
      raise ValueError(f"collapse_factor must be finite and > 1, got {collapse_factor!r}")
    max_skip_rate = validation.real("max_skip_rate", max_skip_rate)
    if not 0 <= max_skip_rate < 1:
      raise ValueError(f"max_skip_rate must lie in [0, 1), got {max_skip_rate!r}")
    min_scale = validation.positive_f32("min_scale", min_scale)
    max_scale = validation.positive_f32("max_scale", max_scale)
    if min_scale > max_scale:
      raise ValueError(f"need 0 < min_scale <= max_scale, got {min_scale!r}, {max_scale!r}")
    growth_factor = validation.real("growth_factor", growth_factor)
    if not 1 <= growth_factor < math.inf:
      raise ValueError(f"growth_factor must be finite and >= 1, got {growth_factor!r}")
    self.window, self.collapse_factor = window, collapse_factor
    self.max_skip_rate = max_skip_rate
    self.min_scale, self.max_scale = min_scale, max_scale
    self.growth_factor = growth_factor
    self.warnings_seen: list[tuple[str, int, str]] = []  # (kind, step, message)
    self.calibration_skips = 0
    self._calibrating = True
    self._steps, self._scales, self._skipped = array("q"), array("d"), array("b")
    self._total = 0
    # (step, scale, total_skips); the anchor before the first step has no scale.
    self._recent: collections.deque = collections.deque([(0, math.nan, 0)])
    self._pinned_since: int | None = None

  @classmethod
  def for_state(cls, opt_state: Any, **kwargs: Any) -> ScaleMonitor:
    """A monitor with the bounds and growth factor of the scaler in ``opt_state``."""
    state = find_scale_state(opt_state)
    if state is None:
      raise ValueError("opt_state holds no loss-scaler state (jmp_scaler.dynamic_scale)")
    c = jax.device_get(state.config)
    return cls(min_scale=float(c.min_scale), max_scale=float(c.max_scale),
               growth_factor=float(c.growth_factor), **kwargs)

  def update(self, metrics: dict[str, Any]) -> list[str]:
    """Records one (or a stack of) ``scale_metrics`` and checks them.

    Returns:
      The messages of the warnings issued by this call (usually none).
    """
    if "scale" not in metrics:
      raise ValueError(f"metrics must hold 'scale' (jmp_scaler.scale_metrics), got {list(metrics)}")
    keys = [k for k in ("scale", "skipped", "steps", "total_skips") if k in metrics]
    host = {k: np.atleast_1d(v) for k, v in jax.device_get({k: metrics[k] for k in keys}).items()}
    issued = []
    for i in range(len(host["scale"])):
      skipped = bool(host["skipped"][i]) if "skipped" in host else False
      step = int(host["steps"][i]) if "steps" in host else len(self._steps) + 1
      total = int(host["total_skips"][i]) if "total_skips" in host else self._total + skipped
      issued += self._observe(step, float(host["scale"][i]), skipped, total)
    return issued

  def _observe(self, step: int, scale: float, skipped: bool, total: int) -> list[str]:
    self._steps.append(step)
    self._scales.append(scale)
    self._skipped.append(skipped)
    self._total = total
    bounded = self.min_scale < self.max_scale  # not a fixed_scale
    found = []
    if bounded and scale <= self.min_scale:
      found.append(("min_scale", f"loss scale at min_scale={self.min_scale:g} at step {step}: "
                    "it cannot back off further, so every overflowing step is skipped. The "
                    "overflow is likely not a matter of scale: find the operation that makes the "
                    "first inf/NaN, forward or backward, with jmp_scaler.find_nonfinite(loss_fn, "
                    "*args, scale=...), or train in bfloat16. To "
                    "recover, fix the cause and restore the last checkpoint taken before the "
                    "collapse: from the default min_scale a float16 model needs about 107 "
                    "growths (x growth_interval steps) before its gradients are non-zero "
                    "again, steps that count as applied with all-zero float16 gradients."))
    if self._calibrating and total < step:  # an update was applied: calibration is over
      self._calibrating, self.calibration_skips = False, total
      self._recent.clear()
    elif self._calibrating and step >= self.window:  # no update applied in `window` steps
      self._calibrating = False
    self._recent.append((step, scale, total))
    if not self._calibrating:
      found += self._windowed(step, scale, total)
    pinned = scale >= self.max_scale or scale * self.growth_factor > _F32_MAX  # cannot grow
    self._pinned_since = (self._pinned_since or step) if (bounded and pinned) else None
    if self._pinned_since is not None and step - self._pinned_since >= self.window:
      found.append(("max_scale", f"loss scale pinned at its maximum {scale:g} since step "
                    f"{self._pinned_since} ({step - self._pinned_since} steps): the gradients "
                    "never overflow, so it only wants to grow. Harmless if you chose max_scale; "
                    "if gradients vanish (dead layers, frozen parameters), see "
                    "jmp_scaler.underflow_report."))
    issued = []
    for kind, message in found:
      if kind not in {k for k, _, _ in self.warnings_seen}:
        self.warnings_seen.append((kind, step, message))
        warnings.warn(message, ScaleWarning, stacklevel=3)
        issued.append(message)
    return issued

  def _windowed(self, step: int, scale: float, total: int) -> list[tuple[str, str]]:
    recent = self._recent
    while len(recent) > 1 and recent[1][0] <= step - self.window:
      recent.popleft()
    found = []
    inside = [(s, v) for s, v, _ in recent if s >= step - self.window and v == v]
    peak_step, peak = max(inside, key=lambda sv: (sv[1], sv[0]))  # the latest peak
    if peak / scale >= self.collapse_factor:
      found.append(("collapse", f"loss scale collapsed from {peak:g} to {scale:g} "
                    f"({peak / scale:g}x) within {step - peak_step} steps (step {peak_step} to "
                    f"{step}): gradients overflow step after step. On one batch of a skipped step, "
                    "jmp_scaler.find_nonfinite(loss_fn, *args, scale=...) names the operation "
                    "and the line that made the first inf/NaN (a forward cast included); "
                    "jmp_scaler.nonfinite_report(grads) names the overflowing leaves."))
    first_step, _, first_total = recent[0]
    if step - first_step >= self.window:
      rate = (total - first_total) / (step - first_step)
      if rate > self.max_skip_rate:
        found.append(("skip_rate", f"{rate:.1%} of the updates from step {first_step} to "
                      f"{step} were skipped (more than {self.max_skip_rate:.1%}): the model "
                      "barely trains. Find the operation that overflows with "
                      "jmp_scaler.find_nonfinite (the leaves: jmp_scaler.nonfinite_report); if "
                      "the skips follow each growth, raise "
                      "growth_interval."))
    return found

  def state_dict(self) -> dict[str, Any]:
    """What the monitor has seen, as JSON-serialisable Python values.

    Save it with each checkpoint (``json.dump(monitor.state_dict(), f)``) and
    :meth:`load_state_dict` it into the monitor of the resumed run: its
    warnings, calibration count, lowest and highest scale and summary then
    continue as in the uninterrupted run (a fresh monitor would start over
    from the restored scale). Settings (``window``, bounds) are not included:
    build the monitor with :meth:`for_state` as before.
    """
    return {
        "warnings_seen": [list(w) for w in self.warnings_seen],
        "calibration_skips": self.calibration_skips,
        "calibrating": self._calibrating,
        "steps": self._steps.tolist(),
        "scales": self._scales.tolist(),
        "skipped": self._skipped.tolist(),
        "total": self._total,
        "recent": [list(r) for r in self._recent],
        "pinned_since": self._pinned_since,
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> ScaleMonitor:
    """Continues from a :meth:`state_dict` (after a resume); returns ``self``.

    Raises:
      ValueError: if ``state`` is not a :meth:`state_dict`, naming the missing keys.
    """
    missing = sorted(set(self.state_dict()) - set(state))
    if missing:
      raise ValueError(f"state is not a ScaleMonitor.state_dict(): missing {missing}")
    self.warnings_seen = [(str(k), int(s), str(m)) for k, s, m in state["warnings_seen"]]
    self.calibration_skips = int(state["calibration_skips"])
    self._calibrating = bool(state["calibrating"])
    self._steps = array("q", [int(x) for x in state["steps"]])
    self._scales = array("d", [float(x) for x in state["scales"]])
    self._skipped = array("b", [int(bool(x)) for x in state["skipped"]])
    self._total = int(state["total"])
    self._recent = collections.deque(
        (int(s), float(v), int(t)) for s, v, t in state["recent"])
    self._pinned_since = None if state["pinned_since"] is None else int(state["pinned_since"])
    return self

  @property
  def history(self) -> dict[str, np.ndarray]:
    """Every observation: ``steps`` (int), ``scale`` (float), ``skipped`` (bool)."""
    return {"steps": np.asarray(self._steps, np.int64),
            "scale": np.asarray(self._scales, np.float64),
            "skipped": np.asarray(self._skipped, np.int8).astype(bool)}

  def summary(self) -> dict[str, Any]:
    """The run so far: steps, skips, skip rate, final/lowest/highest scale, warnings."""
    steps = self._steps[-1] if self._steps else 0
    scales = self._scales or [math.nan]  # an array of doubles
    return {
        "steps": steps,
        "skips": self._total,
        "skip_rate": self._total / steps if steps else 0.0,
        "calibration_skips": self._total if self._calibrating else self.calibration_skips,
        "final_scale": scales[-1],
        "lowest_scale": min(scales),
        "highest_scale": max(scales),
        "warnings": tuple(k for k, _, _ in self.warnings_seen),
    }

  def format_summary(self) -> str:
    """:meth:`summary` in one line, for the end of a run."""
    s = self.summary()
    cal = f", {s['calibration_skips']} calibrating" if s["calibration_skips"] else ""
    warned = "warned: " + ", ".join(s["warnings"]) if s["warnings"] else "no warnings"
    return (f"{s['steps']} steps, {s['skips']} skipped ({100 * s['skip_rate']:.3g}%{cal}); "
            f"scale final {s['final_scale']:g}, lowest {s['lowest_scale']:g}, highest "
            f"{s['highest_scale']:g}; {warned}")
