"""A scaled ``value_and_grad``: the loss is multiplied by the scale, the value is not."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_scaler import _validation as validation
from jmp_scaler._leaves import is_inexact_array
from jmp_scaler.scaling._lookup import get_scale


def _scale_of(source: Any) -> jax.Array:
  """The scale held by a ``TrainState``, an NNX optimizer or an ``opt_state``."""
  if isinstance(source, nnx.Optimizer):
    source = nnx.as_pure(source.opt_state)
  elif hasattr(source, "opt_state") and hasattr(source, "apply_gradients"):
    source = source.opt_state
  return get_scale(source)


class _Partition:
  """One argument split into its inexact array leaves and the rest, held as they are."""

  def __init__(self, tree: Any):
    leaves, self.treedef = jax.tree.flatten(tree)
    self.mask = [is_inexact_array(x) for x in leaves]
    self.static = leaves
    self.diff = [x for x, m in zip(leaves, self.mask, strict=True) if m]

  def combine(self, diff: list[Any]) -> Any:
    """The argument with its inexact leaves replaced by ``diff`` (tracers, when differentiated)."""
    it = iter(diff)
    return jax.tree.unflatten(
        self.treedef, [next(it) if m else x for x, m in zip(self.static, self.mask, strict=True)])

  def grads(self, diff_grads: list[Any]) -> Any:
    """The gradient tree: ``diff_grads`` at the inexact leaves, ``None`` elsewhere."""
    it = iter(diff_grads)
    return jax.tree.unflatten(self.treedef, [next(it) if m else None for m in self.mask])


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
  (inside ``jax.jit``, ``nnx.jit``, ``eqx.filter_jit`` or ``shard_map``: no
  host sync). Without a scaler in it the call raises a ``ValueError`` (put
  ``jmp_scaler.no_scale()`` at the head of the chain for a scale of 1).

  Only the inexact (floating and complex) array leaves of the differentiated
  arguments are differentiated, as ``eqx.filter_value_and_grad`` does: every
  other leaf (a Python number, a string, a function, an integer array, a PRNG
  key) is passed to ``fun`` as it is and gets ``None`` in the gradient tree.
  So an equinox module, which holds ``hidden_size: int``, ``axis_name="batch"``
  and activation functions, is differentiated as it is, and the gradients fit
  ``eqx.apply_updates`` and an optimizer initialised on
  ``eqx.filter(model, eqx.is_inexact_array)``; a tree of floating arrays (Flax
  ``params``) gets ``jax.value_and_grad``'s gradients. When the differentiated
  argument is an NNX module, ``nnx.value_and_grad`` is used, with the
  optimizer's ``wrt`` filter when ``scale_from`` is an NNX optimizer.

  Args:
    fun: returns a scalar loss, or ``(loss, aux)`` with ``has_aux=True``.
    scale_from: a :class:`jmp_scaler.TrainState`, a
      :class:`jmp_scaler.NNXOptimizer` (or ``nnx.Optimizer``), or an
      ``opt_state`` holding the scaler.
    argnums: as in ``jax.value_and_grad``, each argument once (an integer for
      NNX modules).
    has_aux: as in ``jax.value_and_grad``; ``aux`` (an ``eqx.nn.State``, Flax's
      ``batch_stats``) is returned untouched.

  Returns:
    A function with ``fun``'s arguments (keyword arguments pass to ``fun`` as
    they are, on every path: ``loss_fn(model, **inputs)`` as tunix calls it;
    the differentiated ones are positional, as in JAX) returning ``(loss, grads)`` or
    ``((loss, aux), grads)``; ``grads`` has the differentiated argument's
    structure (a tuple of them for a tuple ``argnums``), ``None`` at the
    leaves that are not inexact arrays.

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
  nums = (argnums,) if isinstance(argnums, int) else argnums
  if len(set(nums)) != len(nums):
    raise ValueError(f"argnums must name each argument once, got {argnums!r}")

  def scaled(scale, /, *args, **kwargs):  # positional-only: `fun` may take a `scale=` of its own
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
    if max(nums) >= len(args):
      by_name = f" and keyword arguments {', '.join(kwargs)}" if kwargs else ""
      raise ValueError(
          f"argnums={argnums!r} names a positional argument, but fun was called with "
          f"{len(args)} positional arguments{by_name}: pass the differentiated argument(s) "
          "by position, as jax.value_and_grad requires")
    if isinstance(args[first], nnx.Module):
      if not isinstance(argnums, int):
        raise ValueError(f"argnums must be one integer for an NNX module, got {argnums!r}")
      wrt = getattr(scale_from, "wrt", nnx.Param)
      shifted = nnx.DiffState(argnums + 1, wrt)

      # nnx.value_and_grad resolves keyword arguments to positions by the signature of the
      # function it is given; ``scaled`` has none, so they are bound here (tunix calls its
      # loss as ``loss_fn(model, **inputs)``). They are not differentiated, as in JAX.
      def positional(scale, /, *args):
        return scaled(scale, *args, **kwargs)

      grad_fn = nnx.value_and_grad(positional, argnums=shifted, has_aux=True)
      (_, (loss, aux)), grads = grad_fn(scale, *args)
      return ((loss, aux) if has_aux else loss), grads
    # Differentiate the inexact array leaves of each argument; every other leaf (a Python
    # number, a string, a function, an integer array) is held as it is, as equinox does.
    parts = [_Partition(args[i]) for i in nums]

    def on_leaves(scale, diffs):
      full = list(args)
      for i, part, diff in zip(nums, parts, diffs, strict=True):
        full[i] = part.combine(diff)
      return scaled(scale, *full, **kwargs)

    grad_fn = jax.value_and_grad(on_leaves, argnums=1, has_aux=True)
    (_, (loss, aux)), diff_grads = grad_fn(scale, [part.diff for part in parts])
    grads = [part.grads(g) for part, g in zip(parts, diff_grads, strict=True)]
    return ((loss, aux) if has_aux else loss), (grads[0] if isinstance(argnums, int)
                                                else tuple(grads))

  return wrapped
