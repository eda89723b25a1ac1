"""The op table of :func:`jmp_scaler.autocast`, and the one place that knows JAX's internals.

Each primitive has a rule, which decides the dtype its floating inputs are cast to:

* ``"compute"``: the policy's ``compute_dtype`` (PyTorch's lower-precision list);
* ``"float32"``: float32, or wider if an input is wider (PyTorch's float32 list);
* ``"promote"``: the widest floating input, scalar constants not counted (the default);
* ``"reciprocal"``: float32 when a scalar constant is divided by a value (``1 / x``:
  PyTorch's ``__rdiv__`` and ``__rtruediv__``), otherwise ``"promote"`` (``div``);
* ``"original"``: the dtypes the function was traced with (for ops whose meaning
  depends on the bit layout, such as ``bitcast_convert_type``, and for host callbacks);
* ``"keep"``: the inputs as they come, each in its own dtype (the default for
  primitives with several independent results: ``psum``, ``sort``, ``device_put``);
* ``"fp8"`` (``dot_general`` only, or an :class:`~jmp_scaler.Fp8Recipe` as the rule): the
  dot runs as :func:`~jmp_scaler.fp8_dot_general`, its result in the compute dtype;
  ``"mxfp8"`` and ``"nvfp4"`` (or an :class:`~jmp_scaler.MxFp8Recipe` or
  :class:`~jmp_scaler.Nvfp4Recipe`) are the same rule with a block-scaled recipe: the dot runs
  as :func:`~jmp_scaler.block_scaled_dot_general`.

Integer, boolean and key-typed values are never cast, and float64 is never narrowed
(PyTorch does not autocast float64 either).

The second half of this module rebinds the higher-order primitives (``jit``,
``custom_jvp_call``, ``custom_vjp_call``, ``scan``, ``while``, ``cond``, ``checkpoint``,
``shard_map``) with transformed bodies. Their parameters change between JAX versions and
are read by :mod:`jmp_scaler.jaxcompat` (``_primitives``), nowhere here. Where a public API
can rebuild the primitive (``jax.custom_jvp``, ``jax.custom_vjp``, ``lax.scan``,
``lax.while_loop``, ``lax.switch``, ``jax.checkpoint``, ``jax.shard_map``) it is used;
``jit`` is rebound with its own parameters and a new body.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_scaler.jaxcompat import _jaxpr as J
from jmp_scaler.jaxcompat import _primitives as P
from jmp_scaler.jaxcompat._jaxpr import Primitive
from jmp_scaler.jaxcompat._tracing import selected_constants
from jmp_scaler.jaxcompat._types import row_struct, struct
from jmp_scaler.lowbit._block import MxFp8Recipe, Nvfp4Recipe
from jmp_scaler.lowbit._fp8 import Fp8Recipe
from jmp_scaler.precision._composites import ACTIVATION, COMPOSITE_RULES, DEFAULT_COMPOSITES

COMPUTE, FLOAT32, PROMOTE, RECIPROCAL = "compute", "float32", "promote", "reciprocal"
ORIGINAL, KEEP, FP8 = "original", "keep", "fp8"
RULES = (COMPUTE, FLOAT32, PROMOTE, RECIPROCAL, ORIGINAL, KEEP, FP8)
#: The rules under which an op follows its inputs: one fed only to float32 ops runs in float32.
FOLLOWING = (PROMOTE, RECIPROCAL)
#: The rules of matmuls: their result is a new value, in the compute dtype (or fp8's result).
MATMUL = (COMPUTE, FP8)
#: The primitives the "fp8" rule applies to: matmuls only (docs/fp8.md: convolutions stay
#: in the compute dtype, as TransformerEngine and torchao keep them).
FP8_OPS = ("dot_general",)
#: The block-scaled rules: names of the "fp8" rule with a block-scaled recipe.
BLOCK_RULES = {"mxfp8": MxFp8Recipe, "nvfp4": Nvfp4Recipe}
#: A recipe of the "fp8" rule: per-tensor (Fp8Recipe) or block-scaled.
AnyRecipe = Fp8Recipe | MxFp8Recipe | Nvfp4Recipe

_COMPUTE_OPS = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")
_FLOAT32_OPS = (
    # exponentials, logarithms, powers
    "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square", "sqrt",
    "rsqrt", "cbrt", "logistic", "erf", "erfc", "erf_inv", "lgamma", "digamma",
    "igamma", "igammac", "polygamma", "bessel_i0e", "bessel_i1e",
    # functions that lose their accuracy (or overflow) in half precision
    "tan", "acos", "asin", "acosh", "asinh", "atanh", "cosh", "sinh",
    # reductions and scans
    "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin",
    "cumsum", "cumprod", "cumlogsumexp", "cummax", "cummin",
    # linear algebra and FFT (no half-precision kernels)
    "fft", "cholesky", "triangular_solve", "lu", "qr", "householder_product",
    "geqrf", "geqp3", "eigh", "eig", "svd", "schur", "hessenberg", "tridiagonal",
    "tridiagonal_solve",
)  # fmt: skip
_ORIGINAL_OPS = (
  "bitcast_convert_type", "nextafter", "pure_callback", "io_callback",
  # jax <= 0.10's jnp.linalg.solve and inv: JAX's own solve as a higher-order primitive. Its
  # bodies run at the dtypes they were traced with: float32 unless the inputs were half (and
  # jax >= 0.11's jnp.linalg refuses half inputs before autocast sees them).
  "custom_linear_solve",
)  # fmt: skip

#: Primitives that move or select values without arithmetic (exact in any dtype). Fed to
#: float32 ops they are not cast themselves: the cast waits for the op that computes.
MOVES = frozenset((
  "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
  "dynamic_slice", "gather", "concatenate", "pad", "rev", "copy", "copy_p", "select_n",
))  # fmt: skip

#: The default rule table: primitive name -> rule (every primitive not listed follows
#: ``"promote"``), and activation function name -> ``"activation"`` (:mod:`._composites`).
DEFAULT_RULES: dict[str, str] = {
  **dict.fromkeys(_COMPUTE_OPS, COMPUTE),
  **dict.fromkeys(_FLOAT32_OPS, FLOAT32),
  **dict.fromkeys(_ORIGINAL_OPS, ORIGINAL),
  "div": RECIPROCAL,
  **DEFAULT_COMPOSITES,
}


class Scoped(NamedTuple):
  """A rule for the equations of one primitive whose module path matches ``pattern``."""

  name: str  # the primitive's
  pattern: str
  regex: re.Pattern
  rule: str
  recipe: AnyRecipe | None  # the recipe of the "fp8" rule, else None


def rule_table(rules: Any) -> tuple[dict[str, str], AnyRecipe, dict[str, str], frozenset[str],
                                    tuple[Scoped, ...]]:
  """:data:`DEFAULT_RULES` with the user's ``rules`` (primitive or name -> rule) over it:
  the primitives' table, the recipe of the ``"fp8"`` rule (``Fp8Recipe()`` unless a recipe
  is the rule), the composites' table (function name -> rule), the names of the functions
  the user gave a rule, and the scoped rules (a key ``(primitive, pattern)``: the rule of
  that primitive's equations whose module path ``re.search`` finds the pattern in).

  A name must be that of a primitive JAX (or any loaded module) defines, of one of jax.nn's
  activations (``"activation"``, ``"float32"`` or ``"primitives"``), or of a function of
  the user's given ``"activation"``; a
  primitive object is accepted as it is, so a primitive of your own needs no registration.
  The ``"fp8"`` rule (or an ``Fp8Recipe``) is accepted for ``dot_general`` only, as are
  ``"mxfp8"`` and ``"nvfp4"`` (or their recipes), which are the ``"fp8"`` rule with the
  block-scaled recipe.
  """
  table = {k: v for k, v in DEFAULT_RULES.items() if k not in DEFAULT_COMPOSITES}
  composites, own = dict(DEFAULT_COMPOSITES), set()
  recipe: AnyRecipe = Fp8Recipe()
  scoped: list[Scoped] = []
  if rules is None:
    return table, recipe, composites, frozenset(), ()
  if not isinstance(rules, dict):
    raise ValueError(f"rules must be a dict from primitive (or its name) to a rule, got {rules!r}")
  for key, rule in rules.items():
    if isinstance(key, str) and (key in DEFAULT_COMPOSITES or (
        rule == ACTIVATION and key not in known_primitives())):  # fmt: skip
      if rule not in COMPOSITE_RULES:
        raise ValueError(
          f"rules[{key!r}] names a function (an activation decided as one op), whose rule "
          f"must be one of {COMPOSITE_RULES}, got {rule!r}")
      composites[key] = rule
      own.add(key)
      continue
    if isinstance(key, tuple):
      if len(key) != 2 or not isinstance(key[1], str) or isinstance(key[0], tuple):
        raise ValueError(
          f"rules key {key!r}: a scoped rule's key is (primitive or its name, pattern), the "
          "pattern a regular expression searched in each equation's module path")
      try:
        regex = re.compile(key[1])
      except re.error as e:
        raise ValueError(f"rules key {key!r}: the pattern {key[1]!r} is not a regular "
                         f"expression ({e})") from e
      name = _primitive_name(key[0])
      rule, own_recipe = _primitive_rule(name, rule, f"rules[{key!r}]")
      scoped.append(Scoped(name, key[1], regex, rule, own_recipe))
      continue
    name = _primitive_name(key)
    rule, own_recipe = _primitive_rule(name, rule, f"rules[{name!r}]")
    if own_recipe is not None:
      recipe = own_recipe
    table[name] = rule
  return table, recipe, composites, frozenset(own), tuple(scoped)


def _primitive_name(key: Any) -> str:
  if isinstance(key, str):
    _check_known(key)
    return key
  if isinstance(key, Primitive):
    return key.name
  raise ValueError(f"rules keys must be primitives or primitive names, got {key!r}")


def _primitive_rule(name: str, rule: Any, where: str) -> tuple[str, AnyRecipe | None]:
  """The rule ``rule`` of the primitive ``name`` (``where`` names it in errors), and its
  recipe where the rule is the "fp8" one (a recipe object or "fp8", "mxfp8", "nvfp4")."""
  if rule == ACTIVATION:
    raise ValueError(
      f"{where} is 'activation', which applies to functions (jax.nn.gelu, your own "
      "activation by its __name__), not to primitives")
  label = rule if isinstance(rule, str) else "fp8"
  if isinstance(rule, str) and rule in BLOCK_RULES:
    rule = BLOCK_RULES[rule]()
  if rule == FP8:
    rule = Fp8Recipe()
  recipe = None
  if isinstance(rule, (Fp8Recipe, MxFp8Recipe, Nvfp4Recipe)):
    label = {MxFp8Recipe: "mxfp8", Nvfp4Recipe: "nvfp4"}.get(type(rule), "fp8")
    rule, recipe = FP8, rule
  if not isinstance(rule, str) or rule not in RULES:
    raise ValueError(
      f"{where} must be one of {RULES + tuple(BLOCK_RULES)} or a jmp_scaler."
      f"Fp8Recipe, MxFp8Recipe or Nvfp4Recipe, got {rule!r}")
  if rule == FP8 and name not in FP8_OPS:
    raise ValueError(
      f"{where} is {label!r}, which applies to {' and '.join(FP8_OPS)} only: "
      "convolutions and other ops stay in the compute dtype (docs/fp8.md)")
  return rule, recipe


def known_primitives() -> set[str]:
  """The names of the primitives defined at the top level of every loaded module."""
  names = set(DEFAULT_RULES) | set(HIGHER_ORDER) | set(P.JIT_NAMES)
  for module in list(sys.modules.values()):
    for value in list(getattr(module, "__dict__", {}).values()):
      if isinstance(value, Primitive):
        names.add(value.name)
  return names


def _check_known(name: str) -> None:
  known = known_primitives()
  if name not in known:
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ValueError(
      f"rules names an unknown primitive {name!r}{hint} (for a primitive of your own, "
      "pass the primitive object as the key)"
    )


# ----------------------------------------------------------------- dtypes


def is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype, jnp.floating)


def cast(x: Any, dtype: Any) -> Any:
  """``x`` in ``dtype`` if it is floating; anything else unchanged.

  A constant of the traced function (a literal or a closed-over array, perhaps broadcast to a
  mask's shape: :func:`jmp_scaler.jaxcompat._tracing.constant_value`) whose finite values lie
  beyond a narrower ``dtype``'s range is saturated at its largest finite number, not made
  ``inf``: an attention mask of ``-2.38e38`` (tunix's ``K_MASK``) is ``-65504`` in float16, as
  ``jnp.finfo(jnp.float16).min`` is the mask a float16 model writes, and a fully masked row's
  softmax stays the uniform one float32 gives, not NaN. Infinite constants stay infinite, and
  values computed at run time are cast as they are (an overflow there is the loss scaler's).
  """
  if dtype is None or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  if x.dtype == dtype and not getattr(jax.typeof(x), "weak_type", False):
    return x
  if np.dtype(dtype).itemsize < np.dtype(x.dtype).itemsize and jnp.issubdtype(
      dtype, jnp.floating):
    x = _saturated(x, dtype)
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x, dtype)
  return lax.convert_element_type(x, dtype)


#: The largest constant (in elements) whose values :func:`cast` reads at trace time.
SATURATE_BELOW = 2**20


def _saturated(x: Any, dtype: Any) -> Any:
  """``x`` with the values it takes from constants beyond ``dtype``'s finite range set to
  that range's end (see :func:`cast`); ``x`` unchanged if it takes none."""
  top = float(jnp.finfo(dtype).max)
  if isinstance(x, (np.ndarray, np.generic)):
    v = np.asarray(x, np.float64)
    big = np.isfinite(v) & (np.abs(v) > top)
    return np.where(big, np.sign(v) * top, v).astype(x.dtype) if big.any() else x
  for value in selected_constants(x):
    if np.size(value) > SATURATE_BELOW:
      continue
    v = np.asarray(value, np.float64).reshape(-1)
    for c in np.unique(v[np.isfinite(v) & (np.abs(v) > top)]):
      # Where x holds the constant: a value computed at run time never equals it exactly.
      x = jnp.where(x == np.asarray(c, x.dtype), np.asarray(np.sign(c) * top, x.dtype), x)
  return x


def saturated_fill(x: Any, dtype: Any) -> Any:
  """A fill (a scalar broadcast to a shape) that promotion narrows to ``dtype``, its finite
  values beyond ``dtype``'s range set to that range's end: ``jnp.where(mask, x,
  jnp.finfo(jnp.float32).min)`` masks with ``dtype``'s lowest finite number, as a model
  written for ``dtype`` does, not with ``-inf`` (a fully masked row's softmax would be NaN).
  Infinite and NaN fills stay as they are. The fill is traced inside jnp's jit, so its value
  is not known here: the clip is computed on the scalar, which is broadcast again."""
  if not x.size:
    return x
  top = float(jnp.finfo(dtype).max)
  s = lax.reshape(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim), ())  # the value it holds
  s = jnp.where(jnp.isfinite(s), jnp.clip(s, -top, top), s)
  return lax.broadcast_in_dim(s, x.shape, ())


def widest(dtypes: Sequence[Any]) -> Any:
  """The widest floating dtype among ``dtypes`` (float16 and bfloat16 give float32)."""
  out = None
  for d in dtypes:
    out = d if out is None else jnp.promote_types(out, d)
  return out


def cast_output(x: Any, dtype: Any) -> Any:
  """``x`` in the policy's output ``dtype``; a float64 value is never narrowed."""
  floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
  if floating and np.dtype(x.dtype).itemsize > max(4, np.dtype(dtype).itemsize):
    return x
  return cast(x, dtype)


def _compute_target(compute: Any, dtypes: Sequence[Any], weak: Sequence[bool]) -> Any:
  return widest([compute, *[d for d in dtypes if np.dtype(d).itemsize > 4]])


def _float32_target(compute: Any, dtypes: Sequence[Any], weak: Sequence[bool]) -> Any:
  return widest([np.dtype(np.float32), *dtypes])


def _promote_target(compute: Any, dtypes: Sequence[Any], weak: Sequence[bool]) -> Any:
  strong = [d for d, w in zip(dtypes, weak, strict=True) if not w]
  return widest(strong or dtypes)


def _reciprocal_target(compute: Any, dtypes: Sequence[Any], weak: Sequence[bool]) -> Any:
  rule = _float32_target if len(weak) == 2 and weak[0] and not weak[1] else _promote_target
  return rule(compute, dtypes, weak)


#: Rule -> target(compute_dtype, floating input dtypes, which of them are weak scalars):
#: the dtype the rule casts an equation's floating inputs to. "original" and "keep"
#: cast nothing and are not here. A new rule kind that only chooses a dtype is one
#: entry here and one name in RULES.
TARGETS: dict[str, Callable] = {
  COMPUTE: _compute_target,
  FLOAT32: _float32_target,
  PROMOTE: _promote_target,
  RECIPROCAL: _reciprocal_target,
}


def join(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
  """Element-wise widest of two lists of dtypes (non-floating entries keep ``a``'s)."""
  return [
    jnp.promote_types(x, y) if jnp.issubdtype(x, jnp.floating) and x != y else x
    for x, y in zip(a, b, strict=True)
  ]


# ------------------------------------------------ higher-order primitives
# The equations' parameters come from jmp_scaler.jaxcompat._primitives (P), whatever the JAX
# release calls them. ``run(closed_or_jaxpr, args)`` evaluates a body under the autocast rules.

Run = Callable[[Any, Sequence[Any]], list]


def _loop_dtypes(body_carry: Callable, carry: Sequence[Any]) -> list[Any]:
  """Carry dtypes that the transformed loop body maps to themselves (widening only)."""
  dtypes = [jnp.result_type(c) for c in carry]
  for _ in range(4):
    out = body_carry([struct(c, d) for c, d in zip(carry, dtypes, strict=True)])
    new = join(dtypes, [o.dtype for o in out])
    if new == dtypes:
      return dtypes
    dtypes = new
  return dtypes


def _scan(run: Run, eqn, args):
  p = P.scan(eqn)
  consts, rest = args[: p.num_consts], args[p.num_consts :]
  init, xs = rest[: p.num_carry], rest[p.num_carry :]
  n = len(init)

  def raw(carry, x):
    return run(p.body, [*consts, *carry, *x])

  def carry_avals(carry_structs):
    x_structs = [row_struct(x) for x in xs]
    return jax.eval_shape(raw, carry_structs, x_structs)[:n]

  dtypes = _loop_dtypes(carry_avals, init)

  def step(carry, x):
    out = raw(carry, x)
    return [cast(o, d) for o, d in zip(out[:n], dtypes, strict=True)], out[n:]

  init = [cast(c, d) for c, d in zip(init, dtypes, strict=True)]
  carry, ys = lax.scan(step, init, list(xs), length=p.length, reverse=p.reverse, unroll=p.unroll)
  return [*carry, *ys]


def _while(run: Run, eqn, args):
  p = P.while_loop(eqn)
  nc, nb = p.cond_nconsts, p.body_nconsts
  cconsts, bconsts, init = args[:nc], args[nc : nc + nb], args[nc + nb :]
  body = lambda carry: run(p.body, [*bconsts, *carry])
  dtypes = _loop_dtypes(lambda c: jax.eval_shape(body, c), init)
  out = lax.while_loop(
    lambda carry: run(p.cond, [*cconsts, *carry])[0],
    lambda carry: [cast(o, d) for o, d in zip(body(carry), dtypes, strict=True)],
    [cast(c, d) for c, d in zip(init, dtypes, strict=True)],
  )
  return list(out)


def _cond(run: Run, eqn, args):
  index, ops = args[0], args[1:]
  fns = [lambda *xs, b=b: run(b, xs) for b in P.cond_branches(eqn)]
  shapes = [jax.eval_shape(f, *[struct(x) for x in ops]) for f in fns]
  dtypes = [widest(ds) for ds in zip(*[[s.dtype for s in out] for out in shapes], strict=True)]
  cast_out = lambda f: lambda *xs: [cast(o, d) for o, d in zip(f(*xs), dtypes, strict=True)]
  return list(lax.switch(index, [cast_out(f) for f in fns], *ops))


def _remat(run: Run, eqn, args):
  p = P.remat(eqn)
  fn = lambda *xs: run(p.body, xs)
  return list(jax.checkpoint(fn, prevent_cse=p.prevent_cse, policy=p.policy)(*args))


def _shard_map(run: Run, eqn, args):
  p = P.shard_map(eqn)
  fn = jax.shard_map(
    lambda *xs: tuple(run(p.body, xs)),
    mesh=p.mesh,
    in_specs=p.in_specs,
    out_specs=p.out_specs,
    axis_names=p.axis_names,
    check_vma=p.check_vma,
  )
  return list(fn(*args))


def _named(fn: Callable, body: Any) -> Callable:
  """``fn`` under the name of the function the closed jaxpr ``body`` was traced from."""
  name = J.function_name(body)
  if name:
    fn.__name__ = fn.__qualname__ = name
  return fn


def _custom_jvp(run: Run, eqn, args):
  """``jax.custom_jvp`` rebuilt: the function and its JVP rule both run under autocast.

  The JVP rule is the one the user wrote (traced to a jaxpr by JAX at the original
  dtypes); its primal outputs are cast to the function's and its tangents to theirs.
  """
  p = P.custom_jvp(eqn)
  fun = jax.custom_jvp(_named(lambda *xs: run(p.call, xs), p.call))

  def rule(primals, tangents):
    outs = jax.eval_shape(lambda *a: run(p.call, a), *[struct(x) for x in primals])
    jvp_jaxpr, out_zeros = p.jvp([False] * (len(primals) - p.num_consts))  # no zero tangent
    res = run(jvp_jaxpr, [*primals[p.num_consts :], *tangents[p.num_consts :]])
    nz = iter(res[len(out_zeros) :])
    tan = [
      jnp.zeros(o.shape, o.dtype) if z else cast(next(nz), o.dtype)
      for o, z in zip(outs, out_zeros, strict=True)
    ]
    prim = [cast(o, r.dtype) for o, r in zip(res[: len(out_zeros)], outs, strict=True)]
    return prim, tan

  fun.defjvp(rule)
  return list(fun(*args))


def _custom_vjp(run: Run, eqn, args):
  """``jax.custom_vjp`` rebuilt: the function, its forward and backward under autocast.

  Cotangents of the inputs are cast to the inputs' (transformed) dtypes; the constants the
  function closes over get zero cotangents, as JAX gives them.
  """
  p = P.custom_vjp(eqn)
  nconsts = p.num_consts
  fun = jax.custom_vjp(_named(lambda *xs: run(p.call, xs), p.call))
  in_structs = [struct(x) for x in args]

  def fwd(*xs):
    outs = run(p.fwd([True] * (len(xs) - nconsts)), xs[nconsts:])
    res, prim_out = p.residuals(outs, xs)
    shapes = jax.eval_shape(lambda *a: run(p.call, a), *in_structs)
    prim_out = [cast(o, s.dtype) for o, s in zip(prim_out, shapes, strict=True)]
    return prim_out, res

  def bwd_rule(res, cts):
    flat = jax.make_jaxpr(p.bwd)(*res, *cts)
    grads = run(flat, [*res, *cts])
    zeros = [jnp.zeros(s.shape, s.dtype) for s in in_structs[:nconsts]]
    return (*zeros, *[cast(g, s.dtype) for g, s in zip(grads, in_structs[nconsts:], strict=True)])

  fun.defvjp(fwd, bwd_rule)
  return list(fun(*args))


#: Primitive name -> handler(run, eqn, args) returning the list of outputs.
HIGHER_ORDER: dict[str, Callable] = {
  "scan": _scan,
  "while": _while,
  "cond": _cond,
  **dict.fromkeys(P.REMAT_NAMES, _remat),
  "shard_map": _shard_map,
  "custom_jvp_call": _custom_jvp,
  "custom_vjp_call": _custom_vjp,
}

# ------------------------------------------------ scatters
# jnp's ``x.at[i].add(v)`` (and .set/.mul/.min/.max) is a scatter whose combiner is a
# jaxpr traced for the original dtypes; the public lax functions rebuild it for new ones.

SCATTERS: dict[str, Callable] = {
  "scatter": lax.scatter,
  "scatter-add": lax.scatter_add,
  "scatter-sub": lax.scatter_sub,
  "scatter-mul": lax.scatter_mul,
  "scatter-min": lax.scatter_min,
  "scatter-max": lax.scatter_max,
}


def is_scatter(eqn) -> bool:
  """A jnp-style scatter (``.at[]`` updates); ``lax.scatter_apply``'s own function is not."""
  name = eqn.primitive.name
  return name in SCATTERS and (name != "scatter" or eqn.params["update_jaxpr"] is None)


def rebind_scatter(eqn, args: Sequence[Any]) -> list:
  """The scatter of ``eqn`` on ``args`` (operand, indices, updates of one floating dtype)."""
  p = eqn.params
  out = SCATTERS[eqn.primitive.name](
    *args, p["dimension_numbers"], indices_are_sorted=p["indices_are_sorted"],
    unique_indices=p["unique_indices"], mode=p["mode"],
  )
  return [out]
