"""Per-module precision for Flax linen, through ``nn.intercept_methods``."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn

from jmp_scaler.precision._modules import as_policy, is_half, override_table, policy_for_type
from jmp_scaler.precision._policy import Policy

#: Module types computed in float32 by default (their outputs go back to the
#: compute dtype): the normalisation layers.
LINEN_FLOAT32_MODULES: tuple[type, ...] = (
    nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm,
)  # fmt: skip


def _set_fields(module: nn.Module, policy: Policy) -> dict[str, Any]:
  """Sets the module's dtype fields to ``policy``; returns the old values."""
  names = {f.name for f in dataclasses.fields(module)}
  wanted: dict[str, Any] = {"dtype": policy.compute_dtype, "param_dtype": policy.param_dtype}
  if is_half(policy.compute_dtype):
    wanted["force_fp32_for_softmax"] = True  # attention: softmax in float32
  old = {}
  for name, value in wanted.items():
    if name in names:
      old[name] = getattr(module, name)
      object.__setattr__(module, name, value)
  return old


def _restore(module: nn.Module, old: dict[str, Any]) -> None:
  for name, value in old.items():
    object.__setattr__(module, name, value)


@contextlib.contextmanager
def autocast_linen(
    policy: Policy | str,
    overrides: Mapping[type, Policy | str] | None = None,
    *,
    float32_norms: bool = True,
) -> Iterator[None]:
  """Runs every linen module called inside the block under ``policy``.

  JAX has no autocast; this is one for linen, in the manner of Haiku's
  ``hk.mixed_precision.set_policy``, for an existing model whose code is not
  changed::

    policy = jmp_scaler.get_policy("p=f32,c=f16,o=f32")
    with jmp_scaler.autocast_linen(policy):
      variables = model.init(key, x)          # parameters in float32
      logits = model.apply(variables, x)      # matmuls in float16, logits f32

  The outermost module called enters ``policy``: its floating inputs are
  cast to ``compute_dtype`` and its floating outputs to ``output_dtype``.
  Every module inside it computes in ``compute_dtype``: its ``dtype`` field
  (the Flax convention for the computation dtype, honoured by ``Dense``,
  ``Conv``, ``Embed``, attention and the normalisation layers) is set to it
  for the duration of the call, so parameters stored in ``param_dtype`` (its
  ``param_dtype`` field) are cast where used and their gradients come back in
  ``param_dtype``. Attention modules compute their softmax in float32
  (``force_fp32_for_softmax``) when ``compute_dtype`` is half.

  A module whose type (or a base class of it) is a key of ``overrides``
  enters that policy instead, with everything inside it. By default the
  normalisation layers (:data:`LINEN_FLOAT32_MODULES`) compute in float32
  and output in ``policy.compute_dtype``. The context is read while tracing:
  put it inside the jitted function, around ``apply``.

  Modules that compute with their parameters without honouring a ``dtype``
  field (a custom ``x * self.param(...)``) see their inputs in the compute
  dtype but their parameters in ``param_dtype``, and JAX's promotion picks
  the wider of the two.

  Args:
    policy: the main :class:`jmp_scaler.Policy` or a policy string.
    overrides: module type -> policy (or string) for modules of that type
      and everything inside them; merged over the float32 defaults.
    float32_norms: whether the normalisation layers default to float32.

  Returns:
    A context manager.

  Raises:
    ValueError: naming the argument, for a bad policy or override.
  """
  policy = as_policy("policy", policy)
  defaults = LINEN_FLOAT32_MODULES if float32_norms else ()
  table = override_table(policy, overrides, defaults, nn.Module)
  local = threading.local()
  traced: list[bool] = []

  def interceptor(next_fun, args, kwargs, context):
    if not traced:
      traced.append(True)
    if context.method_name == "setup":
      return next_fun(*args, **kwargs)
    stack = local.__dict__.setdefault("stack", [])
    module = context.module
    own = policy_for_type(table, type(module))
    enters = own is not None or not stack
    active = own or (stack[-1] if stack else policy)
    old = _set_fields(module, active)
    stack.append(active)
    try:
      if enters:
        args, kwargs = active.cast_to_compute((args, kwargs))
      out = next_fun(*args, **kwargs)
    finally:
      stack.pop()
      _restore(module, old)
    return active.cast_to_output(out) if enters else out

  with nn.intercept_methods(interceptor):
    yield
  if not traced:
    warnings.warn(
        "jmp_scaler.autocast_linen: no linen module was traced inside the block, so it had no "
        "effect. The policy applies while a function is traced: a function jitted inside the "
        "block but first called after it runs without the policy (in float32), and a cached "
        "jitted call keeps the dtypes of its first trace. Put the block inside the traced "
        "function, decorate the function with @jmp_scaler.autocast_linen(policy), or use "
        "jmp_scaler.autocast(fn, policy), which holds wherever the function is jitted.",
        UserWarning,
        stacklevel=3,
    )
