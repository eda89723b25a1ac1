"""Activation functions that :func:`autocast` decides as one op, as ``torch.autocast`` does.

torch.autocast runs ``gelu``, ``silu``, ``relu``, ``elu``, ``mish``, ... as single ops in
their input's dtype: a float16 activation gives a float16 result, computed by a kernel that
does its arithmetic in float32, and the backward pass recomputes from the saved input. In a
jaxpr they are compositions of primitives (``jax.nn.gelu`` is ``integer_pow``, ``mul``,
``add``, ``tanh``), and ``integer_pow`` or ``logistic`` is on the float32 list: decided
primitive by primitive, the hidden activation of an MLP would be widened to float32 right
after its matmul and saved for the backward pass five times in float32.

A composite is recognised in the jaxpr

* as a ``jit`` equation with its name (``jax.nn.silu``, ``elu``, ``mish``, ... are jitted
  functions; a ``custom_jvp`` whose body is one such ``jit``, as ``jax.nn.relu``);
* as the run of consecutive equations traced inside one call of the function (``jax.nn.gelu``
  and ``jax.nn.sigmoid`` are inlined: their equations carry the function's frame in their
  source information).

Under the ``"activation"`` rule the composite runs as one op: its floating inputs keep the
dtype autocast gave them (the widest of them is the result's dtype), its body is evaluated at
the dtypes it was traced with (float32 for float32 code: the kernel's float32 arithmetic)
under ``jax.checkpoint``, so the backward pass saves the half-precision input only and
recomputes the rest (open to CSE on TPU, behind the barrier elsewhere: the platform the program
is lowered for decides, :func:`._autocast._recomputed`), and its floating results are rounded
to that dtype. Flax's and equinox's activations are ``jax.nn``'s. A function of your own gets
the rule by name:
``rules={"my_act": "activation"}`` (its ``__name__``; jitted, or called from your code).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import weakref
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _primitives as P
from jmp_scaler.jaxcompat import _source as S

ACTIVATION = "activation"
#: The rules a composite's name may be given: one op in its input's dtype, one op in
#: float32, or decided primitive by primitive.
COMPOSITE_RULES = (ACTIVATION, "float32", "primitives")

#: The ops torch.autocast runs whole that JAX, Flax and equinox write as several primitives:
#: jax.nn's activations (flax.linen's and equinox's are these functions), in their input's
#: dtype; the softmaxes and the layer, RMS and group norms of Flax (linen and NNX) and
#: equinox (their ``__call__``), in float32 as torch's float32 list has them; batch norm in
#: its input's dtype (torch lists it nowhere: cuDNN's kernel returns its input's dtype).
#: ``sigmoid``, ``softplus`` and ``log_sigmoid`` are not here: torch lists softplus as
#: float32, and ``logistic`` is float32 here (docs/autocast.md); each runs as it is. Nor are
#: the piecewise-linear ``relu``, ``relu6`` and ``hard_tanh``: decided primitive by primitive
#: (``max``, ``min``, ``select_n``) they stay in their input's dtype and round at most once,
#: as one op would (``leaky_relu``'s slope would be rounded), and XLA fuses them into the
#: matmul or convolution before them (under ``jax.checkpoint`` it could not: a ResNet's step
#: compiled for TPU v5e needed 222 MiB of temp memory with them as composites, 157 without).
DEFAULT_COMPOSITES: dict[str, str] = {
  **dict.fromkeys((
    "gelu", "silu", "elu", "celu", "selu", "leaky_relu", "mish", "glu",
    "hard_sigmoid", "hard_silu", "squareplus", "sparse_plus", "soft_sign",
    "BatchNorm.__call__",
  ), ACTIVATION),
  **dict.fromkeys((
    "softmax", "log_softmax",
    "LayerNorm.__call__", "RMSNorm.__call__", "GroupNorm.__call__",
  ), "float32"),
}  # fmt: skip


def _package_dir(name: str) -> str | None:
  spec = importlib.util.find_spec(name)
  origin = spec.origin if spec is not None else None
  return os.path.dirname(os.path.abspath(origin)) + os.sep if origin else None


#: Where the default composites live: a function of the same name elsewhere is yours.
_HOMES = tuple(d for d in map(_package_dir, ("jax", "flax", "equinox")) if d)


@dataclasses.dataclass(frozen=True)
class Group:
  """Equations ``members`` (indices, consecutive) that form one call of composite ``name``."""

  name: str
  rule: str
  members: tuple[int, ...]
  inputs: tuple[Any, ...]  #: the variables it reads from outside
  outputs: tuple[Any, ...]  #: the variables it defines that are used outside (or returned)
  #: equal for groups of the same equations (the 48 gelus of 48 layers): one body serves all,
  #: so JAX traces, differentiates and transposes it once (its caches key on the jaxpr)
  key: Hashable = None


def _hashable(x: Any) -> Hashable:
  if isinstance(x, np.ndarray):
    return ("array", x.dtype.str, x.shape, x.tobytes())
  try:
    hash(x)
    return x
  except TypeError:
    return repr(x)


def structure(eqns: list, inputs: tuple, outputs: tuple) -> tuple:
  """The equations with their variables numbered from the inputs on: a key for equal bodies."""
  index = {v: i for i, v in enumerate(inputs)}
  parts: list[Any] = []
  for eqn in eqns:
    ins = tuple(("literal", v.aval, _hashable(v.val)) if J.is_literal(v) else index[v]
                for v in eqn.invars)  # fmt: skip
    for v in eqn.outvars:
      index[v] = len(index)
    params = tuple((k, _hashable(v)) for k, v in eqn.params.items())
    parts.append((eqn.primitive, ins, tuple(v.aval for v in eqn.outvars), params))
  return (tuple(parts), tuple(index[v] for v in outputs))


class Finder:
  """Finds the composites of jaxprs under a table ``name -> rule`` (cached per jaxpr).

  ``own`` are the names the user gave a rule: recognised in any file; the defaults only in
  JAX's, Flax's and equinox's code, so a function of yours that happens to be named
  ``relu`` is decided by its primitives unless you name it in ``rules``.
  """

  def __init__(self, table: Mapping[str, str], own: frozenset[str] = frozenset()):
    self.table = {k: v for k, v in table.items() if v in (ACTIVATION, "float32")}
    self.own = own
    self.matched: set[str] = set()  #: the names found so far (a name never found is a typo?)
    self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  def jit_composite(self, eqn: Any) -> str | None:
    """The composite a single ``jit`` (or ``custom_jvp`` around one) equation is, if any."""
    name = eqn.primitive.name
    if name in P.JIT_NAMES:
      jit = P.jit_name(eqn)
      return jit if jit in self.table else None
    if name == "custom_jvp_call":
      body = P.call_body(eqn)
      if len(body.eqns) == 1 and body.eqns[0].primitive.name in P.JIT_NAMES:
        inner = P.jit_name(body.eqns[0])
        return inner if inner in self.table else None
    return None

  def _traced_in(self, eqn: Any) -> tuple | None:
    """(name, caller's file and line) of the innermost composite whose call traced ``eqn``."""
    found = S.raw_frames(eqn)
    for k, frame in enumerate(found):
      name = frame.function_name
      if name in self.table and (name in self.own or frame.file_name.startswith(_HOMES)):
        caller = found[k + 1] if k + 1 < len(found) else frame
        return name, caller.file_name, caller.line_num
    return None

  def groups(self, jaxpr: Any) -> dict[int, Group]:
    """First member's index -> its :class:`Group`, for every composite call in ``jaxpr``."""
    if not self.table:
      return {}
    if jaxpr not in self._cache:
      self._cache[jaxpr] = self._find(jaxpr)
    return self._cache[jaxpr]

  def _find(self, jaxpr: Any) -> dict[int, Group]:
    # (name, where it was called, members): the call site keeps the user's line of each call
    # in the equations of a shared body (find_nonfinite names it).
    runs: list[tuple[str, tuple, list[int]]] = []
    last_key = None
    for i, eqn in enumerate(jaxpr.eqns):
      single = self.jit_composite(eqn)
      if single is not None:
        runs.append((single, S.summary_location(eqn), [i]))
        last_key = None
        continue
      key = self._traced_in(eqn)
      if key is not None and key == last_key:
        runs[-1][2].append(i)
      elif key is not None:
        runs.append((key[0], key[1:], [i]))
      last_key = key
    if not runs:
      return {}
    uses: dict[Any, set[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.invars:
        if not J.is_literal(v):
          uses.setdefault(v, set()).add(i)
    returned = {v for v in jaxpr.outvars if not J.is_literal(v)}
    found = {}
    for name, site, members in runs:
      inside = set(members)
      defined = [v for i in members for v in jaxpr.eqns[i].outvars]
      mine = set(defined)
      inputs: list[Any] = []
      for i in members:
        for v in jaxpr.eqns[i].invars:
          if not J.is_literal(v) and v not in mine and v not in inputs:
            inputs.append(v)
      outputs = tuple(v for v in defined if v in returned or uses.get(v, set()) - inside)
      eqns = [jaxpr.eqns[i] for i in members]
      key = (site, structure(eqns, tuple(inputs), outputs))
      found[members[0]] = Group(name, self.table[name], tuple(members), tuple(inputs), outputs,
                                key)  # fmt: skip
      self.matched.add(name)
    return found
