"""Training with 16-bit parameters and no float32 master copy.

Round-to-nearest loses every update smaller than half a unit in the last place
(``1.0 + 1e-3`` is ``1.0`` in bfloat16). Two fixes, each an Optax
transformation placed *last* in the chain (it reads ``params``):

* :func:`stochastic_round`: ``p + u`` is computed in float32 and rounded to
  the parameter dtype up or down, with the probability of rounding up equal
  to the fractional distance, so the rounding is unbiased;
* :func:`kahan_summation`: a compensation buffer in the parameter dtype
  carries the low bits that rounding dropped into the next step.

Both return ``updates = new_p - p`` in float32: ``optax.apply_updates`` adds
them in float32 and casts back, which gives ``new_p`` bit for bit (see
:func:`stochastic_round`). The random bits are a counter-based hash of
``(seed, stream, step count, leaf, global element index)``, so they do not
depend on the devices or the sharding, and a resumed run is bit-identical.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_scaler._leaves import is_real_floating

_U32 = jnp.uint32
_STREAM_PARAMS = 0  # the moments of jmp_scaler.adam use streams 1 and 2
_GOLDEN = 0x9E3779B9


def _mix(x: jax.Array) -> jax.Array:
  """Chris Wellons' ``lowbias32``: a bijective, well-avalanching uint32 hash."""
  x = x ^ (x >> 16)
  x = x * _U32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * _U32(0x846CA68B)
  return x ^ (x >> 16)


def _combine(a: jax.Array, b: Any) -> jax.Array:
  return _mix(a ^ _mix(jnp.asarray(b).astype(_U32) + _U32(_GOLDEN)))


def check_seed(seed: Any) -> int:
  """``seed`` as a Python int in [0, 2**32), or ``ValueError`` naming it."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
  if not 0 <= int(seed) < 2**32:
    raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
  return int(seed)


def step_key(seed: int, stream: int, count: jax.Array) -> jax.Array:
  """The uint32 key of one step: a hash of the seed, the stream and the count."""
  return _combine(_combine(jnp.asarray(seed, _U32), stream), count)


def _global_index(shape: tuple[int, ...], spec: Any) -> jax.Array:
  """The row-major index of every element in the *global* array (uint32, wraps).

  ``spec`` (a ``PartitionSpec`` or ``None``) says which mesh axes shard each
  dimension inside ``shard_map``: the local block's offset is then the axis
  index times the local size, so the index, and hence the bits, do not depend
  on how many devices hold the array.
  """
  entries = tuple(spec) if spec is not None else ()
  entries = entries + (None,) * (len(shape) - len(entries))
  global_shape: list[int] = []
  offsets: list[Any] = []
  for size, axes in zip(shape, entries, strict=True):
    if axes is None:
      global_shape.append(size)
      offsets.append(None)
    else:
      n = jax.lax.axis_size(axes)
      global_shape.append(size * n)
      offsets.append(jax.lax.axis_index(axes).astype(_U32) * _U32(size))
  index = jnp.zeros(shape, _U32)
  stride = 1
  for d in reversed(range(len(shape))):
    i = jax.lax.broadcasted_iota(_U32, shape, d)
    if offsets[d] is not None:
      i = i + offsets[d]
    index = index + i * _U32(stride % 2**32)
    stride *= global_shape[d]
  return index


def random_bits(key: jax.Array, leaf: int, shape: tuple[int, ...], spec: Any = None) -> jax.Array:
  """Uniform uint32 bits for every element of a leaf, from the global index."""
  k = _combine(key, leaf)
  k2 = _mix(k ^ _U32(0x85EBCA6B))  # not _mix(k): index 0 would always draw _mix(0) == 0
  return _mix(_mix(_global_index(shape, spec) + k) ^ k2)


def stochastic_cast(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  """Rounds ``x`` to ``dtype`` stochastically, using uniform uint32 ``bits``.

  ``x`` (computed in float32) becomes one of its two neighbours in ``dtype``:
  the upper one with probability equal to the fractional distance, so
  ``E[result] == x``. Representable values (zeros, infinities) are returned
  exactly, NaN stays NaN. Finite values beyond ``dtype``'s largest finite
  number saturate at it, on both sides (``-65519.`` becomes ``-65504.`` in
  float16, never ``-inf``); only an infinite ``x`` gives an infinity.
  bfloat16: the 16 low bits of ``x`` are the fractional distance, exactly,
  and adding 16 random bits before truncating rounds up with exactly that
  probability. float16: the neighbours come from ``nextafter`` and the
  probability from 24 random bits. Other dtypes: a plain cast.

  Args:
    x: a floating array (any float dtype up to float32).
    dtype: the target dtype.
    bits: uint32 array of ``x``'s shape (see :func:`random_bits`).

  Returns:
    ``x`` rounded to ``dtype``.

  Examples:
    >>> import jax.numpy as jnp
    >>> x = jnp.full(4, 1.0 + 2.0**-9, jnp.float32)   # a quarter of a bf16 ulp
    >>> bits = jnp.asarray([0, 2**30, 3 * 2**30, 2**32 - 1], jnp.uint32)
    >>> stochastic_cast(x, jnp.bfloat16, bits).astype(jnp.float32).tolist()
    [1.0, 1.0, 1.0078125, 1.0078125]
  """
  dtype = np.dtype(dtype)
  x = jnp.asarray(x)
  if jnp.finfo(dtype).bits >= 32 or not jnp.issubdtype(dtype, jnp.floating):
    return x.astype(dtype)
  x32 = x.astype(jnp.float32)
  # Saturate finite values beyond the top (exact in float32) with a select, not clip: clip's
  # arithmetic would flush subnormals to zero on XLA:CPU, the select passes their bits through.
  top = jnp.float32(jnp.finfo(dtype).max)
  beyond = jnp.isfinite(x32) & (jnp.abs(x32) > top)
  x32 = jnp.where(beyond, jnp.copysign(top, x32), x32)
  if dtype == np.dtype(jnp.bfloat16):
    raw = jax.lax.bitcast_convert_type(x32, _U32)
    up = (raw + (bits >> 16)) & _U32(0xFFFF0000)
    y = jax.lax.bitcast_convert_type(up, jnp.float32).astype(dtype)  # exact: low bits are 0
    return jnp.where(jnp.isnan(x32), x32.astype(dtype), y)
  near = x32.astype(dtype)
  near32 = near.astype(jnp.float32)
  below = near32 > x32
  other = jnp.nextafter(near, jnp.where(below, -jnp.inf, jnp.inf).astype(dtype))
  lo = jnp.where(below, other, near)
  hi = jnp.where(below, near, other)
  lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
  frac = (x32 - lo32) / (hi32 - lo32)
  uniform = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
  y = jnp.where(uniform < frac, hi, lo)
  return jnp.where((near32 == x32) | jnp.isnan(x32), near, y)


def is_low_precision(x: Any) -> bool:
  """Whether ``x`` is a floating array narrower than float32."""
  return (
      hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32
  )


def applied_update(p: jax.Array, new_p: jax.Array) -> jax.Array:
  """The float32 update that ``optax.apply_updates(p, .)`` turns into ``new_p``.

  ``new_p - p`` in float32 is exact when the two are within a factor 2^15 of
  each other; when ``new_p`` is far smaller, ``p + u`` was a cancellation and
  ``new_p`` is the exact float32 sum (see the tests), and when it is far
  larger the float32 sum lands within a float32 ulp of ``new_p``, which the
  cast rounds to it. Zeros: an unchanged value gets ``-0.0`` (``p + -0.0``
  keeps every bit, ``-0.0`` included), and a new zero is made ``+0.0``,
  which is what ``p + (-p)`` gives.
  """
  new_p = jnp.where(new_p == 0, jnp.zeros_like(new_p), new_p)
  p32, n32 = p.astype(jnp.float32), new_p.astype(jnp.float32)
  return jnp.where(n32 == p32, jnp.float32(-0.0), n32 - p32)


def _check_params(params: Any, name: str) -> None:
  if params is None:
    raise ValueError(
        f"{name} needs the parameters: call tx.update(updates, state, params) "
        "(TrainState, NNXOptimizer and skip_nonfinite pass them)"
    )


def leaf_specs(param_specs: Any, params: Any) -> list:
  """One ``PartitionSpec`` (or ``None``) per leaf of ``params``."""
  from jax.sharding import PartitionSpec

  n = len(jax.tree.leaves(params))
  if param_specs is None:
    return [None] * n
  specs = jax.tree.leaves(
      param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None
  )
  if len(specs) != n:
    raise ValueError(
        f"param_specs must hold one PartitionSpec per parameter leaf ({n}), got {len(specs)}"
    )
  return specs


class StochasticRoundState(NamedTuple):
  """State of :func:`stochastic_round`.

  Attributes:
    count: int32, the number of updates rounded so far (saturating); with the
      seed, it picks the random bits of the next update.
  """

  count: jax.Array  # type: ignore[assignment]  # optax's field name, over tuple.count


def stochastic_round(seed: int = 0, *, param_specs: Any = None) -> optax.GradientTransformation:
  """Stochastic rounding of ``params + updates`` to the parameters' dtype.

  Put it **last** in the chain; it needs ``params``::

    tx = optax.chain(jmp_scaler.adamw(1e-3, state_dtype=jnp.bfloat16),
                     jmp_scaler.stochastic_round(seed=0))

  For every bfloat16 or float16 parameter leaf::

    x      = float32(p) + float32(u)
    new_p  = x rounded up with probability (x - lo) / (hi - lo), else down
    u_out  = float32(new_p) - float32(p)          # exact: apply_updates gives new_p

  ``optax.apply_updates`` (and so ``TrainState``, ``NNXOptimizer``,
  flax's ``TrainState``) computes ``p + u_out`` in float32 and casts back:
  the result is ``new_p`` bit for bit. The updates of float32 (and wider)
  leaves pass through unchanged. The bits come from a hash of ``seed``, the
  ``count`` in the state and each element's index in the global array: a
  run is reproducible, a resumed run is bit-identical, and the result does
  not depend on the number of devices or the sharding under ``jax.jit``.
  A skipped step (``TrainState``, ``skip_nonfinite``) does not run the chain,
  so ``count`` stays too.

  Args:
    seed: integer in [0, 2**32); runs with different seeds draw different bits.
    param_specs: only inside ``shard_map`` with parameters sharded over mesh
      axes: their ``PartitionSpec``s (a tree like the parameters, as given to
      ``shard_map``), so that each shard draws the bits of its own block of the
      global array. Leave ``None`` under ``jax.jit`` (global arrays, any
      sharding) and for replicated parameters.

  Returns:
    An ``optax.GradientTransformation`` with :class:`StochasticRoundState`.

  References:
    Zamirai et al., 2020, Revisiting BFloat16 Training (arXiv:2010.06192).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(optax.sgd(1e-3), stochastic_round(seed=0))
    >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": -jnp.ones(4, jnp.bfloat16)}, state, params)
    >>> optax.apply_updates(params, updates)["w"].dtype
    dtype(bfloat16)
  """
  seed = check_seed(seed)

  def init_fn(params):
    del params
    return StochasticRoundState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    _check_params(params, "stochastic_round")
    key = step_key(seed, _STREAM_PARAMS, state.count)
    u_leaves, treedef = jax.tree.flatten(updates)
    p_leaves = treedef.flatten_up_to(params)
    specs = leaf_specs(param_specs, params)
    out = []
    for i, (u, p, spec) in enumerate(zip(u_leaves, p_leaves, specs, strict=True)):
      if u is None or not is_low_precision(p):
        out.append(u)
        continue
      x = p.astype(jnp.float32) + u.astype(jnp.float32)
      new_p = stochastic_cast(x, p.dtype, random_bits(key, i, p.shape, spec))
      out.append(applied_update(p, new_p))
    count = optax.safe_increment(state.count)
    return treedef.unflatten(out), StochasticRoundState(count=count)

  return optax.GradientTransformation(init_fn, update_fn)


class KahanState(NamedTuple):
  """State of :func:`kahan_summation`.

  Attributes:
    compensation: like the parameters, in their dtypes: the part of the
      previous updates that rounding dropped (``p + compensation`` is the
      effective parameter). Non-floating leaves hold an empty array.
  """

  compensation: Any


def kahan_summation() -> optax.GradientTransformation:
  """Kahan-compensated updates: the low bits that rounding drops are kept.

  Put it **last** in the chain; it needs ``params``::

    tx = optax.chain(jmp_scaler.adamw(1e-3, state_dtype=jnp.bfloat16),
                     jmp_scaler.kahan_summation())

  For every floating parameter leaf, with ``c`` the compensation buffer
  (same dtype as ``p``, zero at init)::

    y      = float32(u) + float32(c)
    new_p  = round_to_nearest(float32(p) + y)
    c      = round_to_nearest(y - (float32(new_p) - float32(p)))
    u_out  = float32(new_p) - float32(p)          # apply_updates gives new_p

  Deterministic (no random bits); costs one parameter-sized buffer in the
  parameter dtype (2 bytes per bfloat16 parameter). On a skipped step
  (``TrainState``, ``skip_nonfinite``) the chain does not run and the buffer
  stays bit-identical.

  Returns:
    An ``optax.GradientTransformation`` with :class:`KahanState`.

  References:
    Zamirai et al., 2020, Revisiting BFloat16 Training (arXiv:2010.06192);
    Kahan, 1965, Further remarks on reducing truncation errors.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(optax.sgd(1e-3), kahan_summation())
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> state[1].compensation["w"].dtype
    dtype(bfloat16)
  """

  def init_fn(params):
    def zeros(p):
      return jnp.zeros_like(p) if is_real_floating(p) else jnp.zeros((0,), jnp.float32)

    return KahanState(compensation=jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    _check_params(params, "kahan_summation")
    u_leaves, treedef = jax.tree.flatten(updates)
    p_leaves = treedef.flatten_up_to(params)
    c_leaves = treedef.flatten_up_to(state.compensation)
    out, comp = [], []
    for u, p, c in zip(u_leaves, p_leaves, c_leaves, strict=True):
      if u is None or not is_real_floating(p):
        out.append(u)
        comp.append(c)
        continue
      math = jnp.promote_types(p.dtype, jnp.float32)
      p32 = p.astype(math)
      y = u.astype(math) + c.astype(math)
      new_p = (p32 + y).astype(p.dtype)
      if is_low_precision(p):
        step = applied_update(p, new_p)
      else:
        step = new_p.astype(math) - p32
      comp.append((y - step).astype(p.dtype))
      out.append(step)
    return treedef.unflatten(out), KahanState(compensation=treedef.unflatten(comp))

  return optax.GradientTransformation(init_fn, update_fn)
