"""Checking a restored loss-scaler state against the one a run is built with.

The scaler's whole state, its configuration included, is made of array
leaves, so any checkpointer saves it. What a checkpointer cannot do is judge
it: restoring a run into a differently configured scaler, or a scale that
was corrupted on disk, would otherwise go unnoticed (the scale resets or the
run turns to NaN).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_scaler.scaling._lookup import CONFIG_LEAVES, is_scale_state
from jmp_scaler.scaling._scaler import LossScaleState

Mismatch = Literal["raise", "saved", "target"]
MODES = ("raise", "saved", "target")
# Derived from the types: a new field is checked without anyone editing a list.
_CONFIG_FIELDS = tuple(sorted(CONFIG_LEAVES))
_COUNTERS = tuple(f for f in LossScaleState._fields if f not in ("scale", "skipped", "config"))


def _host(x: Any) -> np.ndarray:
  return np.asarray(x.get_value() if isinstance(x, nnx.Variable) else x)


def reconcile(saved, target, mode: Mismatch, where: str) -> dict[tuple[str, ...], Any]:
  """Checks one restored scaler state against the target's; returns the
  leaves to write (possibly none)."""
  scale = _host(saved.scale)
  if not (np.isfinite(scale) and scale > 0):
    raise ValueError(
        f"the restored loss scale at {where} is {scale}: it must be positive and "
        "finite; the checkpoint is corrupted (restoring it would train on NaN)"
    )
  for name in _COUNTERS:
    if _host(getattr(saved, name)) < 0:
      raise ValueError(f"the restored {name} at {where} is negative: the checkpoint is corrupted")
  got = {f: _host(getattr(saved.config, f)) for f in _CONFIG_FIELDS}
  want = {f: _host(getattr(target.config, f)) for f in _CONFIG_FIELDS}
  diff = [f for f in _CONFIG_FIELDS if not np.array_equal(got[f], want[f])]
  if diff and mode == "raise":
    listed = "; ".join(f"{f}: saved {got[f]}, target {want[f]}" for f in diff)
    raise ValueError(
        f"the loss scaler restored at {where} was configured differently from the "
        f"target's ({listed}). Pass on_config_mismatch='saved' to continue with the "
        "saved configuration, or 'target' to apply the target's"
    )
  if diff and mode == "target":
    low, high = want["min_scale"], want["max_scale"]
    tracker = np.minimum(_host(saved.hysteresis_tracker), want["hysteresis"])
    return {
        **{("config", f): want[f] for f in _CONFIG_FIELDS},
        ("scale",): np.clip(scale, low, high).astype(np.float32),
        ("hysteresis_tracker",): tracker.astype(np.int32),
    }
  sane = (
      np.isfinite(got["growth_factor"]) and got["growth_factor"] >= 1
      and 0 < got["backoff_factor"] <= 1 and got["growth_interval"] >= 1
      and 0 < got["min_scale"] <= got["max_scale"] < np.inf and got["hysteresis"] >= 1
  )  # fmt: skip
  if not sane:
    listed = ", ".join(f"{f}={got[f]}" for f in _CONFIG_FIELDS)
    raise ValueError(f"the restored scaler configuration at {where} is invalid ({listed}): "
                     "the checkpoint is corrupted")  # fmt: skip
  if not got["min_scale"] <= scale <= got["max_scale"]:
    raise ValueError(
        f"the restored loss scale at {where} is {scale}, outside its configured bounds "
        f"[{got['min_scale']}, {got['max_scale']}]: the checkpoint is corrupted"
    )
  return {}


def _write(lss: LossScaleState, changes: dict[tuple[str, ...], Any]) -> LossScaleState:
  """``lss`` (pure arrays) with ``changes`` applied, dtypes kept."""
  config = lss.config.replace(**{
      k[1]: jnp.asarray(v, getattr(lss.config, k[1]).dtype)
      for k, v in changes.items() if k[0] == "config"
  })  # fmt: skip
  top = {k[0]: jnp.asarray(v, getattr(lss, k[0]).dtype) for k, v in changes.items() if len(k) == 1}
  return lss._replace(config=config, **top)


def check_mode(on_config_mismatch: Any) -> None:
  if on_config_mismatch not in MODES:
    raise ValueError(f"on_config_mismatch must be one of {MODES}, got {on_config_mismatch!r}")


def check_restored(restored: Any, target: Any, *, on_config_mismatch: Mismatch = "raise") -> Any:
  """Checks every loss-scaler state in ``restored`` against ``target``.

  Use it after any restore (Orbax, ``flax.serialization``, your own): it
  pairs the :class:`jmp_scaler.LossScaleState` of ``restored`` with those of
  ``target`` (a freshly initialised state with the configuration you mean to
  run with) and compares the recorded :class:`jmp_scaler.ScaleConfig`.

  Args:
    restored: the restored pytree (``jmp_scaler.TrainState``, an
      ``opt_state``, a dict holding them, ...).
    target: a pytree of the same structure, built with the current scaler.
    on_config_mismatch: what a configuration that differs from the target's
      does: ``"raise"`` (default) a ``ValueError`` listing the differences;
      ``"saved"`` keeps the saved configuration (the run continues as it was
      configured); ``"target"`` applies the target's configuration, clipping
      the saved scale into its bounds and the hysteresis tracker to its
      hysteresis, and keeping the saved scale and counters otherwise.

  Returns:
    ``restored``, with the target's configuration applied under ``"target"``.

  Raises:
    ValueError: for a mismatch under ``"raise"``, a structure mismatch, and a
      corrupted state (a scale <= 0, inf or NaN, or outside its bounds, a
      negative counter, an invalid saved configuration kept under
      ``"saved"``), whatever ``on_config_mismatch`` says.

  Examples:
    >>> import jax.numpy as jnp, optax, jmp_scaler
    >>> make = lambda n: optax.chain(jmp_scaler.dynamic_scale(growth_interval=n),
    ...                              optax.sgd(0.1)).init({"w": jnp.ones(2)})
    >>> try:
    ...   jmp_scaler.check_restored(make(100), make(2000))
    ... except ValueError as err:
    ...   print(str(err).split("(")[1].split(")")[0])
    growth_interval: saved 100, target 2000
    >>> applied = jmp_scaler.check_restored(make(100), make(2000), on_config_mismatch="target")
    >>> int(jmp_scaler.find_scale_state(applied).config.growth_interval)
    2000
  """
  check_mode(on_config_mismatch)
  got, treedef = jax.tree_util.tree_flatten_with_path(restored, is_leaf=is_scale_state)
  want = [x for x in jax.tree.leaves(target, is_leaf=is_scale_state) if is_scale_state(x)]
  found = [(p, x) for p, x in got if is_scale_state(x)]
  if len(found) != len(want):
    raise ValueError(
        f"restored holds {len(found)} loss-scaler states but target holds {len(want)}"
    )
  it = iter(want)
  leaves = []
  for path, x in got:
    if is_scale_state(x):
      x = _write(x, reconcile(x, next(it), on_config_mismatch, jax.tree_util.keystr(path) or "."))
    leaves.append(x)
  return jax.tree.unflatten(treedef, leaves)
