"""A scaled ``value_and_grad``: the loss is multiplied by the scale, the value is not."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_scaler import _validation as validation
from jmp_scaler.scaling._lookup import get_scale


def _scale_of(source: Any) -> jax.Array:
  """The scale held by a ``TrainState``, an NNX optimizer or an ``opt_state``."""
  if isinstance(source, nnx.Optimizer):
    source = nnx.as_pure(source.opt_state)
  elif hasattr(source, "opt_state") and hasattr(source, "apply_gradients"):
    source = source.opt_state
  return get_scale(source)


def value_and_grad(
    fun: Callable[..., Any],
    scale_from: Any,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of ``fun`` with the loss scaled by the current scale.

  The gradients are those of ``fun(...) * scale``, computed in float32
  whatever the loss's dtype, ready for ``TrainState.apply_gradients``,
  ``NNXOptimizer.update`` or a chain headed by the scaler (which unscales
  them); the value returned is the *unscaled* loss (in float32), so it can
  be logged as it is::

    loss, grads = jmp_scaler.value_and_grad(loss_fn, state)(state.params, x, y)
    state = state.apply_gradients(grads=grads)

  The scale is read from ``scale_from`` when the returned function is called
  (inside ``jax.jit``, ``nnx.jit`` or ``shard_map``: no host sync). Without
  a scaler in it the scale is 1 and this is ``jax.value_and_grad``. When the
  differentiated argument is an NNX module, ``nnx.value_and_grad`` is used,
  with the optimizer's ``wrt`` filter when ``scale_from`` is an NNX optimizer.

  Args:
    fun: returns a scalar loss, or ``(loss, aux)`` with ``has_aux=True``.
    scale_from: a :class:`jmp_scaler.TrainState`, a
      :class:`jmp_scaler.NNXOptimizer` (or ``nnx.Optimizer``), or an
      ``opt_state`` holding the scaler.
    argnums: as in ``jax.value_and_grad`` (an integer for NNX modules).
    has_aux: as in ``jax.value_and_grad``; ``aux`` is returned untouched.

  Returns:
    A function with ``fun``'s arguments returning ``(loss, grads)`` or
    ``((loss, aux), grads)``.

  Raises:
    ValueError: for an invalid ``argnums`` or ``has_aux``, when built.

  Examples:
    >>> import jax.numpy as jnp, optax, jmp_scaler
    >>> tx = optax.chain(jmp_scaler.dynamic_scale(1024.0), optax.sgd(0.1))
    >>> opt_state = tx.init(jnp.ones(2))
    >>> loss_fn = lambda w: jnp.sum(w ** 2)
    >>> loss, grads = jmp_scaler.value_and_grad(loss_fn, opt_state)(jnp.ones(2))
    >>> float(loss), grads.tolist()                       # loss unscaled, grads scaled
    (2.0, [2048.0, 2048.0])
  """
  if not isinstance(has_aux, bool):
    raise ValueError(f"has_aux must be a bool, got {has_aux!r}")
  if isinstance(argnums, Sequence):
    argnums = tuple(validation.integer("argnums", a, 0) for a in argnums)
    if not argnums:
      raise ValueError("argnums must name at least one argument, got ()")
  else:
    argnums = validation.integer("argnums", argnums, 0)

  def scaled(scale, *args, **kwargs):
    out = fun(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    if not (hasattr(loss, "shape") and jnp.shape(loss) == ()) and not isinstance(loss, float):
      raise ValueError(
          f"fun must return a scalar loss{' as the first of (loss, aux)' if has_aux else ''}, "
          f"got {type(loss).__name__} of shape {jnp.shape(loss)}"
      )
    loss = jnp.asarray(loss).astype(jnp.float32)
    return loss * scale, (loss, aux)

  def wrapped(*args, **kwargs):
    scale = _scale_of(scale_from)  # read once, outside the differentiated function
    first = argnums if isinstance(argnums, int) else argnums[0]
    if first >= len(args):
      raise ValueError(f"argnums={argnums!r} but fun was called with {len(args)} arguments")
    if isinstance(args[first], nnx.Module):
      if not isinstance(argnums, int):
        raise ValueError(f"argnums must be one integer for an NNX module, got {argnums!r}")
      wrt = getattr(scale_from, "wrt", nnx.Param)
      shifted = nnx.DiffState(argnums + 1, wrt)
      grad_fn = nnx.value_and_grad(scaled, argnums=shifted, has_aux=True)
    else:
      shifted = argnums + 1 if isinstance(argnums, int) else tuple(a + 1 for a in argnums)
      grad_fn = jax.value_and_grad(scaled, argnums=shifted, has_aux=True)
    (_, (loss, aux)), grads = grad_fn(scale, *args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return wrapped
