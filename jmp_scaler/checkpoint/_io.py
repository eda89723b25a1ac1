"""Checkpoint input and output (Orbax, ``flax.serialization``, NNX objects), checked.

Every restore goes through :func:`jmp_scaler.check_restored`
(``_restore_check.py``), which judges the scaler's state; this module moves
the bytes and refuses a checkpoint whose layout differs from the target's.

Orbax is imported by the functions that use it, when first called: at import time it made
``import jmp_scaler`` cost +0.30 s over ``import jax, flax.linen, optax`` where it costs +0.18 s
without (``benchmarks/bench_import.py``), and :func:`to_bytes`/:func:`from_bytes` never need it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, serialization

from jmp_scaler.checkpoint._restore_check import Mismatch, check_mode, check_restored, reconcile
from jmp_scaler.scaling._lookup import is_scale_state


def _is_nnx(x: Any) -> bool:
  if isinstance(x, (tuple, list)):
    return bool(x) and all(isinstance(v, nnx.Pytree) for v in x)
  return isinstance(x, nnx.Pytree)


def _adopt_nnx(target: Any, restored_state: Any, mode: Mismatch) -> Any:
  """Checks ``restored_state`` against ``target`` and writes it into ``target``."""
  graphdef, _ = nnx.split(target)
  merged = nnx.merge(graphdef, restored_state)
  want = {p: n for p, n in nnx.iter_graph(target) if is_scale_state(n)}
  for path, node in nnx.iter_graph(merged):
    if is_scale_state(node):
      where = "/".join(map(str, path))
      for key, value in reconcile(node, want[path], mode, where).items():
        var = node.config if key[0] == "config" else node
        old = getattr(var, key[-1])
        old.set_value(jnp.asarray(value, old.get_value().dtype))
  nnx.update(target, nnx.state(merged))
  return target


def _from_scalar(restored: Any, target: Any) -> jax.Array:
  """The saved 0-d array restored where the target holds a Python scalar.

  Weakly typed when it has the dtype JAX gives that scalar: so are the outputs
  of a jitted step that started from it (flax's ``TrainState.step``), so the
  restored state does not make the step compile again.
  """
  saved = np.asarray(restored)
  return jnp.asarray(saved.item() if saved.dtype == jnp.asarray(target).dtype else saved)


def _placed_like(restored: Any, target: Any) -> Any:
  """``restored`` uncommitted where ``target`` is, so a jitted step compiled
  for the target's placement is reused instead of compiled again."""
  if isinstance(target, (bool, int, float)) and hasattr(restored, "dtype"):
    return _from_scalar(restored, target)
  if not isinstance(target, jax.Array) or target.committed:
    return restored
  if _is_key(restored):
    data = jnp.asarray(np.asarray(jax.random.key_data(restored)))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(restored))
  return jnp.asarray(np.asarray(restored))


_SCALARS: dict[str, Any] = {"bool": jnp.bool_, "int": jnp.integer, "float": jnp.floating}


def _entry(x: Any) -> tuple:
  """What the layout check compares at one leaf: ``(shape, dtype)`` of an array (a PRNG
  key as its key data), or the type of anything else (a Python scalar: ``('int',)``)."""
  if _is_key(x):
    x = jax.eval_shape(jax.random.key_data, x)
  if _is_scalar_metadata(x):  # a Python scalar saved by Orbax
    kind = next(k for k, t in _SCALARS.items() if jnp.issubdtype(x.dtype, t))
    return (kind,)
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return (tuple(x.shape), np.dtype(x.dtype).name)
  return (type(x).__name__,)


def _is_scalar_metadata(x: Any) -> bool:
  """Whether ``x`` is Orbax's metadata of a saved Python scalar: never where Orbax was not
  imported (:func:`from_bytes` checks its layout without it)."""
  ocp = sys.modules.get("orbax.checkpoint")
  return ocp is not None and isinstance(x, ocp.metadata.ScalarMetadata)


def _layout(tree: Any, path: str = "") -> dict[str, tuple]:
  """Every leaf of a state dict by path (see :func:`_entry`)."""
  if isinstance(tree, Mapping):
    out = {}
    for key, value in tree.items():
      out.update(_layout(value, f"{path}/{key}"))
    return out or {path or "/": ("empty",)}
  return {path or "/": _entry(tree)}


def _flat_layout(flat: dict[tuple, Any]) -> dict[str, tuple]:
  """Every leaf of an ``ocp.tree.to_flat_dict`` (of a pytree or Orbax's metadata) by path."""
  return {"/" + "/".join(k): _entry(v) for k, v in flat.items()}


def scalar_takes(saved: tuple, target: tuple) -> bool:
  """Whether a Python-scalar target leaf takes a saved 0-d array of its kind (flax's
  ``TrainState.create`` sets ``step=0``; a state saved after a jitted step holds int32)."""
  kind = _SCALARS.get(target[0]) if len(target) == 1 else None
  if kind is None or len(saved) != 2 or saved[0] != ():
    return False
  if kind is not jnp.bool_ and jnp.issubdtype(saved[1], jnp.bool_):
    return False  # numpy counts bool as an integer; a bool is not a step count
  return jnp.issubdtype(saved[1], kind)


def check_layout(got: dict[str, tuple], want: dict[str, tuple], what: str) -> None:
  """Raises unless the saved layout ``got`` has the target's paths, shapes and dtypes."""
  missing = sorted(set(want) - set(got))
  extra = sorted(set(got) - set(want))
  differ = [p for p in sorted(set(got) & set(want))
            if got[p] != want[p] and not scalar_takes(got[p], want[p])]  # fmt: skip
  if not (missing or extra or differ):
    return
  lines = [f"missing {p}" for p in missing[:5]] + [f"unexpected {p}" for p in extra[:5]]
  lines += [f"{p}: saved {got[p]}, target {want[p]}" for p in differ[:5]]
  total = len(missing) + len(extra) + len(differ)
  more = f" (and {total - len(lines)} more)" if total > len(lines) else ""
  raise ValueError(
      f"{what} does not match the target's layout: {'; '.join(lines)}{more}. Build the "
      "target exactly as the run that saved it was built (same model, same optimizer "
      "chain, same (model, optimizer) grouping)"
  )


def _orbax_error(directory: str, err: Exception) -> ValueError:
  return ValueError(
      f"cannot restore the checkpoint at {directory} into this target ({type(err).__name__}: "
      f"{str(err).strip().splitlines()[0] if str(err).strip() else err!r}). The target must be "
      "built as the saving run was: same model, same optimizer chain (every "
      "jmp_scaler.Policy's loss_scaler() holds a scaler, so moving between float16, "
      "bfloat16 and float32 keeps the layout; restore with on_config_mismatch='target')"
  )


def save_checkpoint(directory: str | os.PathLike, state: Any, *, force: bool = False) -> None:
  """Saves ``state`` with ``orbax.checkpoint.StandardCheckpointer``, and waits.

  To keep the last N checkpoints, use ``orbax.checkpoint.CheckpointManager``
  and :func:`jmp_scaler.check_restored` on what it restores (``docs/flax.md``).

  Args:
    directory: path of the checkpoint folder (made absolute; created).
    state: a pytree (``jmp_scaler.TrainState``, ...) or NNX object(s): a
      module, an optimizer, or a tuple/list of them (their ``nnx.state``).
    force: replace a checkpoint already at ``directory``.

  Raises:
    ValueError: if ``directory`` exists and ``force`` is false.
  """
  import orbax.checkpoint as ocp  # here, not at import time: see the module's docstring

  path = os.path.abspath(directory)
  if os.path.exists(path) and not force:
    raise ValueError(
        f"a checkpoint already exists at {path}: pass force=True to replace it, save each "
        "step to its own folder (e.g. f'{root}/step_{step}'), or keep the last N with "
        "orbax.checkpoint.CheckpointManager (docs/flax.md)"
    )
  tree = nnx.state(state) if _is_nnx(state) else state
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, tree, force=force)
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
    The restored pytree, or ``target`` (NNX) after its update. The layout is
    checked first, as in :func:`from_bytes` (Python-scalar leaves included),
    so Orbax casts nothing. Leaves are placed like ``target``'s: sharded
    where it is sharded, uncommitted where it is uncommitted (so a step
    jitted for it is not compiled again).

  Raises:
    ValueError: as :func:`check_restored`; for a missing checkpoint; for a
      checkpoint whose layout differs from the target's (saying what to do).
  """
  import orbax.checkpoint as ocp  # here, not at import time: see the module's docstring

  check_mode(on_config_mismatch)
  path = os.path.abspath(directory)
  if not os.path.isdir(path):
    raise ValueError(f"no checkpoint at {path}")
  nnx_target = _is_nnx(target)
  tree = nnx.state(target) if nnx_target else target
  with ocp.StandardCheckpointer() as ckptr:
    try:
      metadata = ckptr.metadata(path)
    except (ValueError, KeyError, TypeError) as err:
      raise _orbax_error(path, err) from err
    metadata = getattr(metadata, "item_metadata", metadata)  # a StepMetadata from orbax 0.12
    saved = ocp.tree.to_flat_dict(getattr(metadata, "tree", metadata))
    # Orbax casts to the target's dtype: the layout is checked first, so nothing is cast.
    want = ocp.tree.to_flat_dict(tree)
    check_layout(_flat_layout(saved), _flat_layout(want), f"the checkpoint at {path}")
    try:
      restored = ckptr.restore(path, _abstract(want, saved, tree))
    except (ValueError, KeyError, TypeError) as err:
      raise _orbax_error(path, err) from err
  restored = jax.tree.map(_placed_like, restored, tree)
  if nnx_target:
    return _adopt_nnx(target, restored, on_config_mismatch)
  return check_restored(restored, target, on_config_mismatch=on_config_mismatch)


def _abstract(want: dict[tuple, Any], saved: dict[tuple, Any], tree: Any) -> Any:
  """What Orbax restores into (flat dicts of the target and of the saved metadata): the
  target's shapes and dtypes, and the saved array's where the target holds a Python
  scalar (so the array is restored, not a scalar)."""
  import orbax.checkpoint as ocp  # imported already by restore_checkpoint, its caller

  def one(key, x):
    scalar_saved = isinstance(saved[key], ocp.metadata.ScalarMetadata)
    if isinstance(x, (bool, int, float)) and not scalar_saved:
      return jax.ShapeDtypeStruct(tuple(saved[key].shape), saved[key].dtype)
    return ocp.utils.to_shape_dtype_struct(x)

  return ocp.tree.from_flat_dict({k: one(k, x) for k, x in want.items()}, target=tree)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _plain(state: Any) -> Any:
  """The state dict :func:`to_bytes` writes: NNX objects as pure dicts, keys as key data."""
  if _is_nnx(state):
    state = nnx.to_pure_dict(nnx.state(state))
  plain = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)
  return serialization.to_state_dict(plain)


def _from_bytes_leaf(restored: Any, target: Any) -> Any:
  if not isinstance(restored, np.ndarray):
    return restored
  if isinstance(target, (bool, int, float)):
    return _from_scalar(restored, target)
  return jnp.asarray(restored)


def to_bytes(state: Any) -> bytes:
  """``flax.serialization`` bytes of a pytree or of NNX object(s).

  PRNG key arrays (NNX's ``Rngs``) are stored as their key data.
  """
  return serialization.msgpack_serialize(_plain(state))


def from_bytes(target: Any, data: bytes, *, on_config_mismatch: Mismatch = "raise") -> Any:
  """Restores :func:`to_bytes` output into the shape of ``target``, checked.

  The bytes must hold exactly the target's layout: the same paths, and at
  each path the same shape and dtype. Nothing is filled in from the target
  (a missing optimizer would otherwise restart with a fresh scale). A target
  leaf that is a Python scalar (flax's ``TrainState.create`` sets
  ``step=0``) takes a saved 0-d array of its kind (bool, integer, floating),
  and the array is restored.

  Args:
    target: as in :func:`restore_checkpoint` (NNX objects are updated in
      place).
    data: the bytes.
    on_config_mismatch: as in :func:`check_restored`.

  Returns:
    The restored pytree, or ``target`` (NNX) after its update.

  Raises:
    ValueError: as :func:`check_restored`; for bytes that are not a
      :func:`to_bytes` checkpoint; for a layout that differs from the
      target's, naming the paths and what differs.
  """
  check_mode(on_config_mismatch)
  try:
    saved = serialization.msgpack_restore(data)
  except Exception as err:  # msgpack raises many types on garbage
    raise ValueError(
        f"data is not a jmp_scaler.to_bytes checkpoint ({type(err).__name__}: {err})"
    ) from err
  want = _plain(target)
  if isinstance(want, Mapping) and not isinstance(saved, Mapping):
    raise ValueError(
        f"data is not a jmp_scaler.to_bytes checkpoint (it decodes to a "
        f"{type(saved).__name__}, not a state dict)"
    )
  check_layout(_layout(saved), _layout(want), "the checkpoint in data")
  if not _is_nnx(target):
    restored = serialization.from_state_dict(target, saved)
    restored = jax.tree.map(_from_bytes_leaf, restored, target)
    return check_restored(restored, target, on_config_mismatch=on_config_mismatch)

  def fill(var, value):
    old = var.get_value()
    if _is_key(old):
      return var.replace(jax.random.wrap_key_data(value, impl=jax.random.key_impl(old)))
    if isinstance(old, (bool, int, float)):
      return var.replace(_from_scalar(value, old))
    return var.replace(jnp.asarray(value, old.dtype))

  state = nnx.state(target)
  nnx.replace_by_pure_dict(state, saved, fill)
  return _adopt_nnx(target, state, on_config_mismatch)
