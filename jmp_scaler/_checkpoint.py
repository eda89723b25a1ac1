"""Checkpoints that resume the loss scaler exactly, and check what they restore.

The scaler's whole state, its configuration included, is made of array
leaves, so any checkpointer saves it. What a checkpointer cannot do is judge
it: restoring a run into a differently configured scaler, or a scale that
was corrupted on disk, would otherwise go unnoticed (the scale resets or the
run turns to NaN: metaseq#3, accelerate#4289, fairseq2#1346).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx, serialization

from jmp_scaler._scaler import LossScaleState

Mismatch = Literal["raise", "saved", "target"]
_MODES = ("raise", "saved", "target")
_CONFIG_FIELDS = (
    "growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale", "hysteresis",
)  # fmt: skip
_COUNTERS = ("growth_tracker", "hysteresis_tracker", "consecutive_skips", "total_skips", "steps")


def _is_lss(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def _host(x: Any) -> np.ndarray:
  return np.asarray(x.get_value() if isinstance(x, nnx.Variable) else x)


def _reconcile(saved, target, mode: Mismatch, where: str) -> dict[str, Any]:
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


def _write(lss: LossScaleState, changes: dict[tuple, Any]) -> LossScaleState:
  """``lss`` (pure arrays) with ``changes`` applied, dtypes kept."""
  config = lss.config.replace(**{
      k[1]: jnp.asarray(v, getattr(lss.config, k[1]).dtype)
      for k, v in changes.items() if k[0] == "config"
  })  # fmt: skip
  top = {k[0]: jnp.asarray(v, getattr(lss, k[0]).dtype) for k, v in changes.items() if len(k) == 1}
  return lss._replace(config=config, **top)


def _check_mode(on_config_mismatch: Any) -> None:
  if on_config_mismatch not in _MODES:
    raise ValueError(f"on_config_mismatch must be one of {_MODES}, got {on_config_mismatch!r}")


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
  _check_mode(on_config_mismatch)
  got, treedef = jax.tree_util.tree_flatten_with_path(restored, is_leaf=_is_lss)
  want = [x for x in jax.tree.leaves(target, is_leaf=_is_lss) if _is_lss(x)]
  found = [(p, x) for p, x in got if _is_lss(x)]
  if len(found) != len(want):
    raise ValueError(
        f"restored holds {len(found)} loss-scaler states but target holds {len(want)}"
    )
  it = iter(want)
  leaves = []
  for path, x in got:
    if _is_lss(x):
      x = _write(x, _reconcile(x, next(it), on_config_mismatch, jax.tree_util.keystr(path) or "."))
    leaves.append(x)
  return jax.tree.unflatten(treedef, leaves)


def _is_nnx(x: Any) -> bool:
  if isinstance(x, (tuple, list)):
    return bool(x) and all(isinstance(v, nnx.Pytree) for v in x)
  return isinstance(x, nnx.Pytree)


def _adopt_nnx(target: Any, restored_state: Any, mode: Mismatch) -> Any:
  """Checks ``restored_state`` against ``target`` and writes it into ``target``."""
  graphdef, _ = nnx.split(target)
  merged = nnx.merge(graphdef, restored_state)
  want = {p: n for p, n in nnx.iter_graph(target) if _is_lss(n)}
  for path, node in nnx.iter_graph(merged):
    if _is_lss(node):
      where = "/".join(map(str, path))
      for key, value in _reconcile(node, want[path], mode, where).items():
        var = node.config if key[0] == "config" else node
        old = getattr(var, key[-1])
        old.set_value(jnp.asarray(value, old.get_value().dtype))
  nnx.update(target, nnx.state(merged))
  return target


def _placed_like(restored: Any, target: Any) -> Any:
  """``restored`` uncommitted where ``target`` is, so a jitted step compiled
  for the target's placement is reused instead of compiled again."""
  if not isinstance(target, jax.Array) or target.committed:
    return restored
  if _is_key(restored):
    data = jnp.asarray(np.asarray(jax.random.key_data(restored)))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(restored))
  return jnp.asarray(np.asarray(restored))


def save_checkpoint(directory: str | os.PathLike, state: Any, *, force: bool = False) -> None:
  """Saves ``state`` with ``orbax.checkpoint.StandardCheckpointer``, and waits.

  Args:
    directory: path of the checkpoint folder (made absolute; created; must
      not exist unless ``force``).
    state: a pytree (``jmp_scaler.TrainState``, ...) or NNX object(s): a
      module, an optimizer, or a tuple/list of them (their ``nnx.state``).
    force: overwrite an existing checkpoint.
  """
  tree = nnx.state(state) if _is_nnx(state) else state
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(directory), tree, force=force)
    ckptr.wait_until_finished()


def restore_checkpoint(
    directory: str | os.PathLike, target: Any, *, on_config_mismatch: Mismatch = "raise"
) -> Any:
  """Restores a :func:`save_checkpoint` into the shape of ``target``, checked.

  Args:
    directory: the checkpoint's path.
    target: a freshly initialised pytree with the current scaler, or NNX
      object(s), which are updated in place.
    on_config_mismatch: as in :func:`check_restored`.

  Returns:
    The restored pytree, or ``target`` (NNX) after its update. Leaves are
    placed like ``target``'s: sharded where it is sharded, uncommitted where
    it is uncommitted (so a step jitted for it is not compiled again).

  Raises:
    ValueError: as :func:`check_restored`.
  """
  _check_mode(on_config_mismatch)
  nnx_target = _is_nnx(target)
  tree = nnx.state(target) if nnx_target else target
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(
        os.path.abspath(directory), jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    )
  restored = jax.tree.map(_placed_like, restored, tree)
  if nnx_target:
    return _adopt_nnx(target, restored, on_config_mismatch)
  return check_restored(restored, target, on_config_mismatch=on_config_mismatch)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_bytes(state: Any) -> bytes:
  """``flax.serialization`` bytes of a pytree or of NNX object(s).

  PRNG key arrays (NNX's ``Rngs``) are stored as their key data.
  """
  if _is_nnx(state):
    state = nnx.to_pure_dict(nnx.state(state))
  plain = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)
  return serialization.to_bytes(plain)


def from_bytes(target: Any, data: bytes, *, on_config_mismatch: Mismatch = "raise") -> Any:
  """Restores :func:`to_bytes` output into the shape of ``target``, checked.

  Args:
    target: as in :func:`restore_checkpoint` (NNX objects are updated in
      place).
    data: the bytes.
    on_config_mismatch: as in :func:`check_restored`.

  Returns:
    The restored pytree, or ``target`` (NNX) after its update.
  """
  _check_mode(on_config_mismatch)
  if not _is_nnx(target):
    restored = serialization.from_bytes(target, data)
    restored = jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, restored)
    return check_restored(restored, target, on_config_mismatch=on_config_mismatch)

  def fill(var, value):
    old = var.get_value()
    if _is_key(old):
      return var.replace(jax.random.wrap_key_data(value, impl=jax.random.key_impl(old)))
    return var.replace(jnp.asarray(value, old.dtype))

  state = nnx.state(target)
  nnx.replace_by_pure_dict(state, serialization.msgpack_restore(data), fill)
  return _adopt_nnx(target, state, on_config_mismatch)
