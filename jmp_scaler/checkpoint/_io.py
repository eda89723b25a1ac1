"""Checkpoint input and output (Orbax, ``flax.serialization``, NNX objects), checked.

Every restore goes through :func:`jmp_scaler.check_restored`
(``_restore_check.py``), which judges the scaler's state; this module moves
the bytes and refuses a checkpoint whose layout differs from the target's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
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


def _placed_like(restored: Any, target: Any) -> Any:
  """``restored`` uncommitted where ``target`` is, so a jitted step compiled
  for the target's placement is reused instead of compiled again."""
  if not isinstance(target, jax.Array) or target.committed:
    return restored
  if _is_key(restored):
    data = jnp.asarray(np.asarray(jax.random.key_data(restored)))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(restored))
  return jnp.asarray(np.asarray(restored))


def _layout(tree: Any, path: str = "") -> dict[str, tuple]:
  """Every leaf of a state dict by path: ``(shape, dtype)``, or the type of a non-array."""
  if isinstance(tree, Mapping):
    out = {}
    for key, value in tree.items():
      out.update(_layout(value, f"{path}/{key}"))
    return out or {path or "/": ("empty",)}
  if hasattr(tree, "dtype") and hasattr(tree, "shape"):
    return {path or "/": (tuple(tree.shape), np.dtype(tree.dtype).name)}
  return {path or "/": (type(tree).__name__,)}


def check_layout(saved: Any, target: Any, what: str) -> None:
  """Raises unless ``saved`` has ``target``'s paths, shapes and dtypes (state dicts)."""
  got, want = _layout(saved), _layout(target)
  missing = sorted(set(want) - set(got))
  extra = sorted(set(got) - set(want))
  differ = [p for p in sorted(set(got) & set(want)) if got[p] != want[p]]
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
    The restored pytree, or ``target`` (NNX) after its update. Leaves are
    placed like ``target``'s: sharded where it is sharded, uncommitted where
    it is uncommitted (so a step jitted for it is not compiled again).

  Raises:
    ValueError: as :func:`check_restored`; for a missing checkpoint; for a
      checkpoint whose layout differs from the target's (saying what to do).
  """
  check_mode(on_config_mismatch)
  path = os.path.abspath(directory)
  if not os.path.isdir(path):
    raise ValueError(f"no checkpoint at {path}")
  nnx_target = _is_nnx(target)
  tree = nnx.state(target) if nnx_target else target
  with ocp.StandardCheckpointer() as ckptr:
    try:
      restored = ckptr.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
    except (ValueError, KeyError, TypeError) as err:
      raise _orbax_error(path, err) from err
  restored = jax.tree.map(_placed_like, restored, tree)
  if nnx_target:
    return _adopt_nnx(target, restored, on_config_mismatch)
  return check_restored(restored, target, on_config_mismatch=on_config_mismatch)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _plain(state: Any) -> Any:
  """The state dict :func:`to_bytes` writes: NNX objects as pure dicts, keys as key data."""
  if _is_nnx(state):
    state = nnx.to_pure_dict(nnx.state(state))
  plain = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)
  return serialization.to_state_dict(plain)


def to_bytes(state: Any) -> bytes:
  """``flax.serialization`` bytes of a pytree or of NNX object(s).

  PRNG key arrays (NNX's ``Rngs``) are stored as their key data.
  """
  return serialization.msgpack_serialize(_plain(state))


def from_bytes(target: Any, data: bytes, *, on_config_mismatch: Mismatch = "raise") -> Any:
  """Restores :func:`to_bytes` output into the shape of ``target``, checked.

  The bytes must hold exactly the target's layout: the same paths, and at
  each path the same shape and dtype. Nothing is filled in from the target
  (a missing optimizer would otherwise restart with a fresh scale).

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
  check_layout(saved, want, "the checkpoint in data")
  if not _is_nnx(target):
    restored = serialization.from_state_dict(target, saved)
    restored = jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, restored)
    return check_restored(restored, target, on_config_mismatch=on_config_mismatch)

  def fill(var, value):
    old = var.get_value()
    if _is_key(old):
      return var.replace(jax.random.wrap_key_data(value, impl=jax.random.key_impl(old)))
    return var.replace(jnp.asarray(value, old.dtype))

  state = nnx.state(target)
  nnx.replace_by_pure_dict(state, saved, fill)
  return _adopt_nnx(target, state, on_config_mismatch)
