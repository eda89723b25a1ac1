"""Per-module precision for Flax NNX: an existing model set up in place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jmp_scaler.precision._modules import as_policy, override_table, policy_for_type
from jmp_scaler.precision._policy import Policy

#: Module types computed in float32 by default (their outputs go back to the
#: compute dtype): the normalisation layers.
NNX_FLOAT32_MODULES: tuple[type, ...] = (
    nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm, nnx.InstanceNorm,
)  # fmt: skip

_POLICY_ATTR = "jmp_autocast_policy"
_BASE_ATTR = "_jmp_autocast_base"
_CAST_CLASSES: dict[type, type] = {}


def _base(cls: type) -> type:
  return cls.__dict__.get(_BASE_ATTR, cls)


def _cast_class(cls: type) -> type:
  """``cls`` with a ``__call__`` that casts at the policy boundary (cached, so
  a module's graph definition, hence ``nnx.jit``'s cache key, is stable)."""
  base = _base(cls)
  if base not in _CAST_CLASSES:

    def __call__(self, *args, **kwargs):
      policy = getattr(self, _POLICY_ATTR)
      args, kwargs = policy.cast_to_compute((args, kwargs))
      return policy.cast_to_output(base.__call__(self, *args, **kwargs))

    _CAST_CLASSES[base] = type(
        base.__name__, (base,), {"__call__": __call__, _BASE_ATTR: base, "__module__": __name__}
    )
  return _CAST_CLASSES[base]


def _owner(path: tuple, modules: Mapping[tuple, Any]) -> tuple:
  """The longest proper prefix of ``path`` that is a module path."""
  for i in range(len(path) - 1, -1, -1):
    if path[:i] in modules:
      return path[:i]
  raise ValueError(f"no module owns {path!r}")  # unreachable: () is the root


def autocast_nnx(
    model: nnx.Module,
    policy: Policy | str,
    overrides: Mapping[type, Policy | str] | None = None,
    *,
    float32_norms: bool = True,
) -> nnx.Module:
  """Sets up an existing NNX model, in place, to run under ``policy``.

  The NNX counterpart of :func:`jmp_scaler.autocast_linen`, with the same
  rules (Haiku's ``hk.mixed_precision.set_policy``)::

    model = jmp_scaler.autocast_nnx(MyModel(rngs=nnx.Rngs(0)), "p=f32,c=f16,o=f32")
    logits = model(x)        # matmuls in float16, norms in float32, logits f32

  * Every module gets ``dtype = compute_dtype`` and ``param_dtype`` of the
    policy it runs under (the Flax convention honoured by ``Linear``,
    ``Conv``, ``Embed``, attention and the normalisation layers), and its
    ``nnx.Param`` values are cast to that ``param_dtype`` (the master
    weights). ``nnx.BatchStat`` and other variables keep their dtype.
  * ``model`` enters ``policy``, and each module whose type (or a base class
    of it) is a key of ``overrides`` enters its own policy, with all the
    modules inside it: its ``__call__`` casts the floating inputs to the
    policy's ``compute_dtype`` and the floating outputs to its
    ``output_dtype``. By default the normalisation layers
    (:data:`NNX_FLOAT32_MODULES`) compute in float32 and output in
    ``policy.compute_dtype``.

  The casting ``__call__`` comes from a subclass of the module's class,
  created once per class and named like it, so ``isinstance`` checks, state
  paths, ``nnx.state``/``nnx.split`` and checkpoints are unchanged. Calling
  ``autocast_nnx`` again re-applies a new policy. Other methods than
  ``__call__`` run under the dtypes set but do not cast at the boundary.

  Attention: ``nnx.dot_product_attention`` computes the softmax in float32
  when it can hand over to ``jax.nn.dot_product_attention`` (no attention
  dropout, weights not sown), and in ``compute_dtype`` otherwise; to keep
  an attention module entirely in float32, override its type.

  Args:
    model: the NNX module, changed in place.
    policy: the main :class:`jmp_scaler.Policy` or a policy string.
    overrides: module type -> policy (or string) for modules of that type
      and everything inside them; merged over the float32 defaults.
    float32_norms: whether the normalisation layers default to float32.

  Returns:
    ``model``.

  Raises:
    ValueError: naming the argument, for a bad model, policy or override.
  """
  if not isinstance(model, nnx.Module):
    raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}")
  policy = as_policy("policy", policy)
  defaults = NNX_FLOAT32_MODULES if float32_norms else ()
  table = override_table(policy, overrides, defaults, nnx.Module)
  modules = dict(nnx.iter_modules(model))
  active: dict[tuple, Policy] = {}
  for path in sorted(modules, key=len):
    module = modules[path]
    own = policy_for_type(table, _base(type(module)))
    parent = active[_owner(path, modules)] if path else policy
    active[path] = own or parent
    if own is not None or not path:
      module.__class__ = _cast_class(type(module))
      setattr(module, _POLICY_ATTR, active[path])
    elif _BASE_ATTR in type(module).__dict__:
      module.__class__ = _base(type(module))  # no longer at a boundary
    if hasattr(module, "dtype"):
      module.dtype = active[path].compute_dtype
    if hasattr(module, "param_dtype"):
      module.param_dtype = active[path].param_dtype
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param) and jnp.issubdtype(node.get_value().dtype, jnp.floating):
      dtype = active[_owner(path, modules)].param_dtype
      node.set_value(node.get_value().astype(dtype))
  return model
