"""Dtype policies: which dtype parameters are stored, computed and output in."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_scaler.scaling._scaler import LossScaler, dynamic_scale, no_scale

T = TypeVar("T")

_FLOAT64 = np.dtype(jnp.float64)
_FLOAT32 = np.dtype(jnp.float32)
_FLOAT16 = np.dtype(jnp.float16)
_BFLOAT16 = np.dtype(jnp.bfloat16)

_NAMES = {
    "f64": _FLOAT64, "float64": _FLOAT64,
    "f32": _FLOAT32, "float32": _FLOAT32, "full": _FLOAT32,
    "f16": _FLOAT16, "float16": _FLOAT16,
    "bf16": _BFLOAT16, "bfloat16": _BFLOAT16,
}  # fmt: skip
_SHORT = {_FLOAT64: "f64", _FLOAT32: "f32", _FLOAT16: "f16", _BFLOAT16: "bf16"}
_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute",
         "o": "output", "output": "output"}  # fmt: skip


def _half_dtype() -> np.dtype:
  """jmp's ``half``: bfloat16 on TPU, float16 elsewhere (asks the device)."""
  return _BFLOAT16 if jax.default_backend() == "tpu" else _FLOAT16


def canonical_dtype(name: str, dtype: Any) -> np.dtype:
  """One of the four floating dtypes, from a dtype object or one of the policy names.

  Strings are read with the policy grammar's names (``"f16"`` is float16 here,
  where NumPy would read a 16-byte float); ``None`` is refused (NumPy reads
  it as float64).
  """
  expected = f"{name} must be a floating dtype (float16, bfloat16, float32 or float64, or "
  if isinstance(dtype, str):
    try:
      return _parse_dtype(dtype, f"{name}={dtype}")
    except ValueError as e:
      raise ValueError(f"{expected}one of {sorted([*_NAMES, 'half'])}), got {dtype!r}") from e
  if dtype is None:
    raise ValueError(f"{name} must be a floating dtype, got None")
  try:
    d = np.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{name} must be a floating dtype, got {dtype!r}") from e
  if d not in _SHORT:
    raise ValueError(f"{expected}a policy name), got {dtype!r}")
  return d


def _cast_floating(tree: T, dtype: np.dtype) -> T:
  def cast(x):
    if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(
        x.dtype, jnp.floating
    ):
      return x.astype(dtype)
    return x

  return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtypes parameters are stored in, computed in and output in.

  Frozen and hashable, so it can be a static argument of ``jax.jit``. The
  casts touch floating arrays only: integers, booleans, Python numbers and
  ``None`` pass through unchanged.

  Attributes:
    param_dtype: dtype of the stored (master) parameters.
    compute_dtype: dtype the forward and backward passes compute in.
    output_dtype: dtype of the outputs (the loss is best kept in float32).

  Examples:
    >>> import jax.numpy as jnp, jmp_scaler
    >>> policy = jmp_scaler.get_policy("p=f32,c=f16,o=f32")
    >>> policy.cast_to_compute({"w": jnp.ones(2), "step": jnp.int32(3)})["w"].dtype
    dtype('float16')
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, field, canonical_dtype(field, getattr(self, field)))

  def cast_to_param(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``param_dtype``."""
    return _cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
    return _cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``output_dtype``."""
    return _cast_floating(tree, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> Policy:
    """A copy of this policy with another ``output_dtype``."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  @property
  def needs_loss_scaling(self) -> bool:
    """True when float16 is involved (bfloat16 has float32's range)."""
    return _FLOAT16 in (self.param_dtype, self.compute_dtype)

  def loss_scaler(self, **kwargs: Any) -> LossScaler:
    """The loss scaler this policy needs, to put at the head of the chain.

    ``jmp_scaler.dynamic_scale(**kwargs)`` when float16 is involved;
    ``jmp_scaler.no_scale()`` for bfloat16 and float32: bfloat16 has
    float32's range and needs no scaling (a dynamic scale there is pure
    overhead), but it overflows to inf too, so
    non-finite steps are still skipped exactly rather than poisoning Adam's
    moments. Every policy therefore gives the same ``opt_state`` structure
    and the same :func:`jmp_scaler.scale_metrics` keys, and a run can move
    between float16, bfloat16 and float32 across a checkpoint
    (``restore_checkpoint(..., on_config_mismatch="target")``).

    Args:
      **kwargs: :func:`jmp_scaler.dynamic_scale`'s arguments. They are
        validated under every policy; without float16 only ``axis_name``,
        ``skip_mode`` and ``bare`` apply (the others configure a dynamic scale).

    Returns:
      The scaler, an ``optax.GradientTransformationExtraArgs``.
    """
    scaler = dynamic_scale(**kwargs)  # validates kwargs under every policy
    if self.needs_loss_scaling:
      return scaler
    shared = {k: kwargs[k] for k in ("axis_name", "skip_mode", "bare") if k in kwargs}
    return no_scale(**shared)

  def optimizer(self, learning_rate: Any, **kwargs: Any) -> optax.GradientTransformation:
    """The AdamW chain this policy calls for, scaler included.

    :func:`jmp_scaler.low_precision_optimizer` (``self``, ``learning_rate``,
    ``**kwargs``): float32 master weights get ``optax.adamw`` after
    :meth:`loss_scaler`; 16-bit parameters (``"p=bf16,c=bf16,o=f32"``) get
    16-bit Adam moments and a stochastically rounded update (8 bytes per
    parameter instead of 16; ``docs/bf16.md``).
    """
    from jmp_scaler.lowbit._adam16 import low_precision_optimizer  # _adam16 builds on this module

    return low_precision_optimizer(self, learning_rate, **kwargs)

  def __str__(self) -> str:
    dtypes = (self.param_dtype, self.compute_dtype, self.output_dtype)
    return ",".join(f"{k}={_SHORT.get(d, d.name)}" for k, d in zip("pco", dtypes, strict=True))


def _parse_dtype(text: str, part: str) -> np.dtype:
  value = text.strip().lower()
  if value == "half":
    return _half_dtype()
  if value not in _NAMES:
    raise ValueError(
        f"unknown dtype {text!r} in policy part {part!r}; expected one of "
        f"{sorted([*_NAMES, 'half'])}"
    )
  return _NAMES[value]


def get_policy(spec: str | Any) -> Policy:
  """Parses a policy string, in jmp's grammar.

  ``"params=float32,compute=float16,output=float32"``, the short
  ``"p=f32,c=bf16,o=f32"``, or a bare dtype such as ``"float32"`` or
  ``"bf16"`` (all three dtypes). Keys: ``p``/``params``, ``c``/``compute``,
  ``o``/``output``. Dtypes: ``f32``/``float32``/``full``,
  ``f16``/``float16``, ``bf16``/``bfloat16`` and ``half`` (bfloat16 on TPU,
  float16 elsewhere). Params default to float32, compute follows params,
  output follows compute.

  ``spec`` may also be a :class:`Policy` (returned as is) or a dtype object
  (``jnp.float16``: all three dtypes). ``get_policy(str(policy)) == policy``
  for every policy.

  Raises:
    ValueError: naming the offending part, for unknown keys or dtypes,
      repeated keys and malformed strings.
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str) and spec is not None:
    d = canonical_dtype("policy", spec)
    return Policy(d, d, d)
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"policy must be a non-empty string, got {spec!r}")
  if "=" not in spec:
    d = _parse_dtype(spec, spec)
    return Policy(d, d, d)
  chosen: dict[str, np.dtype] = {}
  for part in spec.split(","):
    key, sep, value = part.partition("=")
    key = key.strip().lower()
    if not sep or not key or not value.strip() or "=" in value:
      raise ValueError(f"malformed policy part {part!r} in {spec!r}; expected key=dtype")
    if key not in _KEYS:
      raise ValueError(
          f"unknown policy key {key!r} in part {part!r}; expected one of {sorted(_KEYS)}"
      )
    if _KEYS[key] in chosen:
      raise ValueError(f"policy key {_KEYS[key]!r} repeated at part {part!r} in {spec!r}")
    chosen[_KEYS[key]] = _parse_dtype(value, part)
  params = chosen.get("params", _FLOAT32)
  compute = chosen.get("compute", params)
  output = chosen.get("output", compute)
  return Policy(params, compute, output)


def default_policy(device: Any = None) -> Policy:
  """The mixed-precision policy for ``device`` (default: ``jax.devices()[0]``).

  Parameters and outputs in float32; compute in bfloat16 on TPU and on GPUs
  with fast bfloat16 (CUDA compute capability 8.0 and newer, and ROCm), in
  float16 on older GPUs, in float32 on CPU (half-precision matmuls are slow
  there). Asks the device only when called, never at import.
  """
  if device is None:
    device = jax.devices()[0]
  platform = str(getattr(device, "platform", "cpu")).lower()
  if platform == "tpu":
    compute = _BFLOAT16
  elif platform in ("gpu", "cuda", "rocm"):
    cc = getattr(device, "compute_capability", None)
    if platform == "rocm" or cc is None:
      compute = _BFLOAT16 if platform == "rocm" else _FLOAT16
    else:
      compute = _BFLOAT16 if float(cc) >= 8.0 else _FLOAT16
  else:
    compute = _FLOAT32
  return Policy(_FLOAT32, compute, _FLOAT32)
