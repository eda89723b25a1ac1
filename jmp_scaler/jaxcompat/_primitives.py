"""The parameters of JAX's higher-order primitives, read in one place.

Each reader takes an equation and returns a named tuple of what jmp_scaler's interpreters
need, whatever the JAX release calls it. A parameter a release does not have raises
:class:`~jmp_scaler.jaxcompat._errors.JaxInternalsError` naming it.

Version notes:

* ``scan``: jax 0.10 counts its inputs with ``num_consts`` and ``num_carry``; jax 0.12 gives
  their structure as ``ft_in`` (a ``FlatTree`` of ``(consts, carry, xs)``) and ``ft_out``
  (``(carry, ys)``), and its body is a ``Jaxpr`` carrying its constants.
* ``while``, ``cond``, ``custom_jvp_call``, ``custom_vjp_call``, ``jit``: the same names in
  both; the bodies are ``ClosedJaxpr`` in 0.10 and constant-carrying ``Jaxpr`` in 0.12
  (:func:`~jmp_scaler.jaxcompat._jaxpr.closed` makes either closed).
* ``jit`` is bound as ``jit`` (jax 0.10 and 0.12; ``pjit`` before); ``remat`` as ``remat2``
  (``checkpoint`` before).
* ``custom_vjp_call``: ``out_trees()`` gives ``(out_tree, res_tree, input_fwds)``, where
  ``input_fwds[i]`` is the index, among the equation's inputs (its constants included), of
  the input residual ``i`` is, or None when the forward rule computed it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jmp_scaler.jaxcompat._errors import missing
from jmp_scaler.jaxcompat._jaxpr import closed

#: The names of the primitive ``jax.jit`` binds (its body is the ``jaxpr`` parameter).
JIT_NAMES = ("jit", "pjit")
#: The names of the primitive ``jax.checkpoint`` binds.
REMAT_NAMES = ("remat2", "checkpoint")
#: The names of the custom-derivative call primitives (their body is ``call_jaxpr``).
CUSTOM_NAMES = ("custom_jvp_call", "custom_vjp_call")


def _get(eqn: Any, name: str) -> Any:
  try:
    return eqn.params[name]
  except KeyError:
    raise missing(f"the parameter {name!r}", f"the {eqn.primitive.name} equation") from None


# ----------------------------------------------------------------- loops and branches


class Scan(NamedTuple):
  body: Any  #: closed jaxpr: (*consts, *carry, *x) -> (*carry, *y)
  num_consts: int
  num_carry: int
  length: int
  reverse: bool
  unroll: Any


def scan(eqn: Any) -> Scan:
  p = eqn.params
  if "num_consts" in p:  # jax 0.10
    nconsts, ncarry = p["num_consts"], p["num_carry"]
  elif "ft_in" in p:  # jax 0.12
    try:
      consts, carry, _ = p["ft_in"].unpack()
    except (AttributeError, TypeError, ValueError):
      raise missing("the (consts, carry, xs) structure of 'ft_in'", "the scan equation") from None
    nconsts, ncarry = len(consts), len(carry)
  else:
    raise missing("'num_consts'/'num_carry' or 'ft_in'", "the scan equation")
  return Scan(closed(_get(eqn, "jaxpr")), nconsts, ncarry, _get(eqn, "length"),
              _get(eqn, "reverse"), _get(eqn, "unroll"))  # fmt: skip


class While(NamedTuple):
  cond: Any  #: closed jaxpr: (*cond_consts, *carry) -> predicate
  body: Any  #: closed jaxpr: (*body_consts, *carry) -> carry
  cond_nconsts: int
  body_nconsts: int


def while_loop(eqn: Any) -> While:
  return While(closed(_get(eqn, "cond_jaxpr")), closed(_get(eqn, "body_jaxpr")),
               _get(eqn, "cond_nconsts"), _get(eqn, "body_nconsts"))  # fmt: skip


def cond_branches(eqn: Any) -> list:
  """The closed branches of a ``cond`` (its inputs: the index, then the branches' operands)."""
  return [closed(b) for b in _get(eqn, "branches")]


# ------------------------------------------------------------------- calls


class Remat(NamedTuple):
  body: Any
  prevent_cse: bool
  policy: Any


def remat(eqn: Any) -> Remat:
  return Remat(closed(_get(eqn, "jaxpr")), _get(eqn, "prevent_cse"), _get(eqn, "policy"))


class ShardMap(NamedTuple):
  body: Any
  mesh: Any
  in_specs: tuple
  out_specs: tuple
  axis_names: Any
  check_vma: bool


def shard_map(eqn: Any) -> ShardMap:
  return ShardMap(closed(_get(eqn, "jaxpr")), _get(eqn, "mesh"), tuple(_get(eqn, "in_specs")),
                  tuple(_get(eqn, "out_specs")), _get(eqn, "newly_manual_axes"),
                  _get(eqn, "check_vma"))  # fmt: skip


def jit_body(eqn: Any) -> Any:
  return closed(_get(eqn, "jaxpr"))


def jit_name(eqn: Any) -> str:
  return str(eqn.params.get("name", ""))


def rebind_jit(eqn: Any, body: Any, args: Sequence[Any]) -> list:
  """Binds ``eqn``'s jit primitive with a new closed body (same shardings, donations, name)."""
  return list(eqn.primitive.bind(*args, **{**eqn.params, "jaxpr": closed(body)}))


def call_body(eqn: Any) -> Any:
  """The (open) body of a call-like equation (``jit``, ``remat``, ``custom_jvp_call``,
  ``custom_vjp_call``) whose inputs are the equation's, one to one; None for any other."""
  name = eqn.primitive.name
  if name in JIT_NAMES or name in REMAT_NAMES:
    body = _get(eqn, "jaxpr")
  elif name in CUSTOM_NAMES:
    body = _get(eqn, "call_jaxpr")
  else:
    return None
  return closed(body).jaxpr


# ----------------------------------------------------------- custom derivatives


class CustomJvp(NamedTuple):
  call: Any  #: closed jaxpr of the function
  num_consts: int
  #: jvp(zeros) -> (closed jvp jaxpr, which output tangents are zero); ``zeros[i]`` says
  #: that input i's tangent is a symbolic zero (JAX's jvp_jaxpr_fun, 0.10.2 to 0.12)
  jvp: Callable


def custom_jvp(eqn: Any) -> CustomJvp:
  fun = _get(eqn, "jvp_jaxpr_fun")

  def jvp(zeros: Sequence[bool]) -> tuple[Any, list]:
    jaxpr, consts, out_zeros = fun.call_wrapped(*zeros)
    return closed(jaxpr, consts), list(out_zeros)

  return CustomJvp(closed(_get(eqn, "call_jaxpr")), _get(eqn, "num_consts"), jvp)


class CustomVjp(NamedTuple):
  call: Any  #: closed jaxpr of the function
  num_consts: int
  fwd: Callable  #: fwd(nonzeros) -> closed jaxpr: primals -> (*computed residuals, *outputs)
  bwd: Callable  #: bwd(*residuals, *cotangents) -> input cotangents (the user's rule)
  residuals: Callable  #: residuals(fwd_outputs, inputs) -> (residuals, outputs)


def custom_vjp(eqn: Any) -> CustomVjp:
  thunk, bwd, out_trees = (_get(eqn, n) for n in ("fwd_jaxpr_thunk", "bwd", "out_trees"))

  def fwd(nonzeros: Sequence[bool]) -> Any:
    jaxpr, consts = thunk.call_wrapped(*nonzeros)
    return closed(jaxpr, consts)

  def residuals(outs: Sequence[Any], inputs: Sequence[Any]) -> tuple[list, list]:
    """Splits the forward jaxpr's outputs into the residuals (those the forward rule passed
    through from the inputs re-inserted) and the primal outputs. ``inputs`` are all the
    equation's inputs, its constants first, as ``input_fwds`` counts them."""
    _, res_tree, input_fwds = out_trees()
    n_res = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    computed = iter(outs[:n_res])
    res = [next(computed) if f is None else inputs[f] for f in input_fwds]
    return res, list(outs[n_res:])

  return CustomVjp(closed(_get(eqn, "call_jaxpr")), _get(eqn, "num_consts"), fwd,
                   lambda *a: bwd.call_wrapped(*a), residuals)  # fmt: skip


# ------------------------------------------------------- inlining and widening

#: The names of call primitives whose body takes the equation's inputs one to one and gives
#: its outputs (``closed_call``, ``core_call``: JAX's plain calls) besides those above.
PLAIN_CALL_NAMES = ("closed_call", "core_call")


def inline_body(eqn: Any) -> Any:
  """The closed body of a call-like equation (``jit``, ``remat``, ``custom_jvp_call``,
  ``custom_vjp_call``, ``closed_call``), which evaluated on the equation's inputs gives its
  outputs (the primal function of a custom derivative); None for any other equation."""
  name = eqn.primitive.name
  if name in JIT_NAMES or name in REMAT_NAMES:
    return closed(_get(eqn, "jaxpr"))
  if name in CUSTOM_NAMES or name in PLAIN_CALL_NAMES:
    return closed(_get(eqn, "call_jaxpr"))
  return None


#: The name prefixes of the collective primitives of ``jax.lax`` (psum, all_gather, ppermute,
#: ... and their ``_invariant``, ``unreduced_``, ``_start``/``_done`` forms): the value they
#: give a device depends on every device's inputs.
_COLLECTIVE_PREFIXES = (
  "psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_gather", "all_to_all",
  "ragged_all_to_all", "reduce_scatter", "unreduced_", "psend", "precv", "preduced",
)  # fmt: skip


def is_collective(eqn: Any) -> bool:
  """Whether ``eqn`` communicates between the devices of a mesh (``lax.psum``, ...)."""
  return eqn.primitive.name.startswith(_COLLECTIVE_PREFIXES)


#: float32's (exponent, mantissa) bits: ``reduce_precision`` to them changes no float32.
_FLOAT32_BITS = {"exponent_bits": 8, "mantissa_bits": 23}


def float32_params(eqn: Any) -> dict:
  """``eqn``'s parameters with every floating dtype narrower than float32 (``new_dtype`` of a
  cast, ``preferred_element_type`` of a dot or a convolution) made float32, and a
  ``reduce_precision`` to fewer bits than float32's made one to float32's: the same operation,
  computed and returned in float32."""
  params = dict(eqn.params)
  for key, value in params.items():
    if isinstance(value, np.dtype) and _is_narrow_float(value):
      params[key] = np.dtype(np.float32)
  if eqn.primitive.name == "reduce_precision":
    for key, bits in _FLOAT32_BITS.items():
      params[key] = max(int(_get(eqn, key)), bits)
  return params



def _is_narrow_float(dtype: np.dtype) -> bool:
  """float16, bfloat16 and the fp8 types (numpy calls ml_dtypes' kind ``"V"``, not ``"f"``)."""
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize < 4
