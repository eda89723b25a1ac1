"""torch.autocast's own op lists, ported: every op given half-precision inputs, as torch tests it.

The lists are PyTorch's ``torch/testing/_internal/autocast_test_lists.py`` (the CUDA
lists: ``torch_fp16``/``nn_fp16``/``linalg_fp16``/``methods_fp16`` lower precision,
``torch_fp32``/``nn_fp32``/``methods_fp32`` float32, ``torch_need_autocast_promote``,
``torch_expect_builtin_promote``) and ``docs/source/amp.rst``, with the same arguments
(float32 for the lower-precision list, float16 or bfloat16 for the others, n = 8).
For each op with a JAX counterpart (jnp, jax.nn, optax, flax) three things are
checked: the result's dtype is torch's (or the one docs/autocast.md gives, with the
reason, in ``why``); the compute dtype in the jaxpr (matmuls and convolutions in the
compute dtype, every other computing equation in float32); and the value against the
same function evaluated in float64 on the same (rounded) inputs. All cases of one
dtype compile as one program.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import warnings
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend.core import jaxprs_in_params
from jax.scipy.ndimage import map_coordinates
from jax.scipy.special import erfinv

import jmp_scaler
from tests import _xla
from tests.test_autocast_fn import eqns, in_dtypes, result_dtype

# Fast XLA:CPU compilation: these programs run for microseconds; the fusion emitters
# alone take three quarters of compiling ~120 small ops.
FAST = _xla.compile_options()
pytestmark = pytest.mark.filterwarnings(  # jnp's own, for .at[].set of float32 into float16
    "ignore:scatter inputs have incompatible types:FutureWarning")
POLICIES = {"float16": "p=f32,c=f16,o=f32", "bfloat16": "p=f32,c=bf16,o=f32"}
N = 8
_RNG = np.random.default_rng(0)
_OWN = np.random.default_rng(1)  # cases added later: the others keep their draws


def _both_halves(x):
  """``x`` rounded to bfloat16, whose values float16 holds exactly too (none below 2^-14): the
  float16 and bfloat16 cases get the same inputs and share one float64 reference."""
  x = np.asarray(np.asarray(x, jnp.bfloat16), np.float64)
  x = np.where(np.abs(x) < 2.0**-14, 0.0, x)
  assert (np.asarray(x, np.float16) == x).all()
  return x


@dataclasses.dataclass(frozen=True)
class H:
  """An argument in the test's half-precision dtype."""
  value: np.ndarray

  def __post_init__(self):
    object.__setattr__(self, "value", _both_halves(self.value))


@dataclasses.dataclass(frozen=True)
class F:
  """An argument in float32."""
  value: np.ndarray


def h(*shape, lo=None, hi=None, scale=1.0):
  x = _RNG.normal(size=shape) * scale
  return H(np.clip(x, lo, hi) if lo is not None or hi is not None else x)


def f(*shape):
  return F(_RNG.normal(size=shape))


def rand(*shape):  # torch.rand: uniform in [0, 1)
  return H(_RNG.uniform(size=shape))


def ints(*shape, value=1):
  return np.full(shape, value, np.int32)


@dataclasses.dataclass(frozen=True)
class Op:
  """One op of torch's lists and its JAX counterpart.

  ``out`` is the result dtype here ("compute", "float32" or "bool"); where it is not
  torch's, ``why`` says why (docs/autocast.md says the same). ``torch_out``: torch's
  result dtype where it is not its list's (an explicit ``dtype=``). ``eps``: a
  documented difference in value, the relative error in units of the half dtype's
  epsilon (a constant rounded to the input dtype when the function was traced).
  """

  torch: str
  table: str  # "lower", "float32", "promote", "builtin"
  fn: Callable
  args: tuple
  out: str
  why: str = ""
  eps: float = 0.0
  torch_out: str = ""
  exact_in_half: tuple = ()  # ops before a float32 composite, exact in any dtype (softmin's neg)
  bias_adds: int = 0  # adds of a bias to a matmul's result, in the compute dtype (addmm)

  @property
  def id(self):
    return f"{self.table}-{self.torch}"


TORCH_OUT = {"lower": "compute", "float32": "float32", "promote": "float32"}


# ------------------------------------------------------------------ the counterparts


def conv(x, w):
  return lax.conv(x, w, (1,) * (x.ndim - 2), "SAME")


def conv_transpose(x, w):
  spec = "NC" + "DHW"[3 - (x.ndim - 2):]
  dn = (spec, "OI" + spec[2:], spec)
  return lax.conv_transpose(x, w, (1,) * (x.ndim - 2), "SAME", dimension_numbers=dn)


def conv_bias(x, w, b):
  return conv(x, w) + b[None, :, None, None]


def conv_tbc(x, w, b):  # time, batch, channel; weight (kernel, in, out)
  return lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("WNC", "WIO", "WNC")) + b


def prelu(x, a):
  return jnp.where(x >= 0, x, a * x)


def flax_cell(cell, carry_first=True):
  """A flax RNN cell on torch's (input, hidden, ...) arguments: one step, the new hidden."""

  def run(x, hx, *_):
    carry = (hx, hx) if isinstance(cell, nn.LSTMCell) else hx
    shapes = jax.eval_shape(lambda: cell.init(jax.random.key(0), carry, x))
    leaves, tree = jax.tree.flatten(shapes)
    rng = np.random.default_rng(1)
    params = jax.tree.unflatten(tree, [jnp.asarray(rng.normal(size=s.shape) / 3, x.dtype)
                                       for s in leaves])  # fmt: skip
    new_carry, out = cell.apply(params, carry, x)
    return out

  return run


def layer_norm_hand(x):
  return (x - x.mean()) / jnp.sqrt(x.var() + 1e-5)


def flax_apply(module, *shape):
  def run(x):
    variables = jax.eval_shape(lambda: module.init(jax.random.key(0), x))
    ones = jax.tree.map(lambda s: jnp.ones(s.shape, jnp.float32) * 0.9, variables)
    return module.apply(ones, x)

  return run


def cos_embedding(a, b, y):
  cos = optax.cosine_similarity(a, b)
  return jnp.mean(jnp.where(y == 1, 1 - cos, jnp.maximum(0.0, cos)))


def pairwise(x, y):
  return jnp.linalg.norm(x[:, None, :] - y[None, :, :], axis=-1)


def pdist(x):
  i, j = np.triu_indices(x.shape[0], 1)
  return pairwise(x, x)[i, j]


def renorm(x):  # p=2, dim=0, maxnorm=1
  norms = jnp.linalg.norm(x, axis=1, keepdims=True)
  return x * jnp.where(norms > 1.0, 1.0 / (norms + 1e-7), 1.0)


def nll(logp, y):
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def multilabel_margin(x, y):  # every target row is {1}: hinge of x[:, 1] against the others
  target = jnp.take_along_axis(x, y[:, :1], axis=1)
  others = jnp.arange(x.shape[1]) != 1
  return jnp.mean(jnp.sum(jnp.where(others, jnp.maximum(0.0, 1.0 - (target - x)), 0.0), 1)
                  / x.shape[1])  # fmt: skip


def multi_margin(x, y):
  target = jnp.take_along_axis(x, y[:, None], axis=1)
  others = jnp.arange(x.shape[1])[None, :] != y[:, None]
  return jnp.mean(jnp.sum(jnp.where(others, jnp.maximum(0.0, 1.0 - target + x), 0.0), 1)
                  / x.shape[1])  # fmt: skip


def scatter_add(x, idx, src):  # torch.scatter_add(x, 0, idx, src)
  j, k = jnp.meshgrid(jnp.arange(2), jnp.arange(2), indexing="ij")
  return x.at[idx, j[None], k[None]].add(src)


def grid_sample(x, grid):
  return map_coordinates(x, [grid[0], grid[1]], order=1)


MATMUL_IN_COMPUTE = "a matmul in JAX (dot_general): runs in the compute dtype, as matmul does"
BIAS = ("an addend of the result's own shape is not a broadcast bias: the add promotes with it "
        "(as PyTorch's own add would)")
NOT_MATMUL = "not a matmul in JAX: runs in its inputs' dtype (float32 here)"
EXPLICIT_DTYPE = ("jnp.sum(x16, dtype=jnp.float16) traces to the jaxpr of lax.reduce_sum(x16): "
                  "a float16 reduction, which autocast runs in float32 like any other")
CELL = ("matmuls and their bias adds in the compute dtype; the sums of two matmuls, the gates "
        "and the state update, which only float32 ops use, in float32")


def _lower():
  m = lambda: f(N, N)
  b3 = lambda: f(N, N, N)
  c = [f(N, N, N), f(N, N, N, N), f(N, N, N, N, N)]
  return [
    Op("conv1d", "lower", conv, (c[0], f(N, N, 3)), "compute"),
    Op("conv2d", "lower", conv, (c[1], f(N, N, 3, 3)), "compute"),
    Op("conv3d", "lower", conv, (c[2], f(N, N, 3, 3, 3)), "compute"),
    Op("conv_transpose1d", "lower", conv_transpose, (c[0], f(N, N, 3)), "compute"),
    Op("conv_transpose2d", "lower", conv_transpose, (c[1], f(N, N, 3, 3)), "compute"),
    Op("conv_transpose3d", "lower", conv_transpose, (c[2], f(N, N, 3, 3, 3)), "compute"),
    Op("cudnn_convolution", "lower", conv, (c[1], f(N, N, 3, 3)), "compute"),
    Op("cudnn_convolution_transpose", "lower", conv_transpose, (c[1], f(N, N, 3, 3)), "compute"),
    Op("_convolution", "lower", conv_bias, (c[1], f(N, N, 3, 3), f(N)), "compute", bias_adds=1),
    Op("convolution", "lower", conv_bias, (c[1], f(N, N, 3, 3), f(N)), "compute", bias_adds=1),
    Op("conv_tbc", "lower", conv_tbc, (f(N, N, N), f(3, N, N), f(N)), "compute", bias_adds=1),
    Op("prelu", "lower", prelu, (f(N), f(1)), "float32", NOT_MATMUL),
    Op("addmm", "lower", lambda a, x, y: a + x @ y, (m(), m(), m()), "float32", BIAS),
    Op("addmv", "lower", lambda a, x, v: a + x @ v, (f(N), m(), f(N)), "float32", BIAS),
    Op("addr", "lower", lambda a, u, v: a + jnp.outer(u, v), (m(), f(N), f(N)), "float32",
       "jnp.outer is a broadcast mul, not a matmul; the add promotes"),
    Op("matmul", "lower", jnp.matmul, (m(), m()), "compute"),
    Op("__matmul__", "lower", lambda a, b: a @ b, (m(), m()), "compute"),
    Op("einsum", "lower", functools.partial(jnp.einsum, "bkhd,bqhd->bqkh"),
       (f(2, 2, 2, 2), f(2, 2, 2, 2)), "compute"),
    Op("mm", "lower", jnp.dot, (m(), m()), "compute"),
    Op("mv", "lower", jnp.matmul, (m(), f(N)), "compute"),
    Op("chain_matmul", "lower", lambda a, b, c: jnp.linalg.multi_dot([a, b, c]),
       (m(), m(), m()), "compute"),
    Op("multi_dot", "lower", lambda a, b, c: jnp.linalg.multi_dot([a, b, c]),
       (m(), m(), m()), "compute"),
    Op("addbmm", "lower", lambda a, x, y: a + jnp.sum(x @ y, 0), (m(), b3(), b3()), "float32",
       "the sum over the batch is a float32 reduction and the add promotes"),
    Op("baddbmm", "lower", lambda a, x, y: a + x @ y, (b3(), b3(), b3()), "float32", BIAS),
    Op("bmm", "lower", jnp.matmul, (b3(), b3()), "compute"),
    Op("linear", "lower", lambda x, w, b: x @ w.T + b[0], (m(), m(), m()), "compute",
       bias_adds=1),
    Op("linalg_vecdot", "lower", jnp.linalg.vecdot, (m(), m()), "compute"),
    Op("LSTMCell", "lower", flax_cell(nn.LSTMCell(N)), (m(), m()), "float32", CELL, bias_adds=4),
    Op("GRUCell", "lower", flax_cell(nn.GRUCell(N)), (m(), m()), "float32", CELL, bias_adds=4),
    Op("RNNCell", "lower", flax_cell(nn.SimpleCell(N)), (m(), m()), "float32", CELL,
       bias_adds=1),
    Op("rnn_relu_cell", "lower", flax_cell(nn.SimpleCell(N, activation_fn=nn.relu)),
       (m(), m()), "float32", CELL, bias_adds=1),
  ]  # fmt: skip


def _float32():
  p = lambda **k: h(N, **k)
  m = lambda **k: h(N, N, **k)
  return [
    Op("acos", "float32", jnp.arccos, (p(lo=-0.9, hi=0.9),), "float32"),
    Op("asin", "float32", jnp.arcsin, (p(lo=-0.9, hi=0.9),), "float32"),
    Op("cosh", "float32", jnp.cosh, (p(),), "float32"),
    Op("sinh", "float32", jnp.sinh, (p(),), "float32"),
    Op("tan", "float32", jnp.tan, (p(lo=-1.5, hi=1.5),), "float32"),
    Op("erfinv", "float32", erfinv, (p(lo=-0.9, hi=0.9),), "float32"),
    Op("exp", "float32", jnp.exp, (p(),), "float32"),
    Op("expm1", "float32", jnp.expm1, (p(),), "float32"),
    Op("log", "float32", jnp.log, (p(lo=0.1, hi=100),), "float32"),
    Op("log10", "float32", jnp.log10, (p(lo=0.1, hi=100),), "float32", eps=1),
    Op("log2", "float32", jnp.log2, (p(lo=0.1, hi=100),), "float32"),
    Op("log1p", "float32", jnp.log1p, (p(lo=-0.9, hi=100),), "float32"),
    Op("reciprocal", "float32", jnp.reciprocal, (p(),), "float32"),
    Op("__rdiv__", "float32", lambda x: 1.0 / x, (p(),), "float32"),
    Op("__rtruediv__", "float32", lambda x: 2.0 / x, (p(),), "float32"),
    Op("rsqrt", "float32", lax.rsqrt, (p(lo=0.1, hi=100),), "float32"),
    Op("pow", "float32", jnp.power, (H(np.clip(_RNG.normal(size=N) + 1, 0, 100)), p()),
       "float32"),
    Op("pow (scalar)", "float32", lambda x: x**1.7, (H(np.clip(_RNG.normal(size=N) + 1, 0, 100)),),
       "float32", eps=4),
    Op("pow (jnp.power, Python exponent)", "float32", lambda x: jnp.power(x, 1.7),
       (H(np.clip(_OWN.normal(size=N) * 20 + 30, 0.5, 100)),), "float32", eps=4),
    Op("__pow__", "float32", lambda x: x**1.5, (rand(N),), "float32"),
    Op("__rpow__", "float32", lambda x: 2.0**x, (p(),), "float32"),
    Op("softmax", "float32", functools.partial(jax.nn.softmax, axis=0), (p(),), "float32"),
    Op("softmin", "float32", lambda x: jax.nn.softmax(-x, axis=0), (p(),), "float32",
       exact_in_half=("neg",)),
    Op("log_softmax", "float32", functools.partial(jax.nn.log_softmax, axis=0), (p(),),
       "float32"),
    Op("logsumexp", "float32", functools.partial(jax.nn.logsumexp, axis=1), (m(),), "float32"),
    Op("layer_norm", "float32", flax_apply(nn.LayerNorm()), (p(),), "float32"),
    Op("layer_norm (hand-written)", "float32", layer_norm_hand, (p(),), "float32"),
    Op("group_norm", "float32", flax_apply(nn.GroupNorm(num_groups=1)), (m(),), "float32"),
    Op("norm", "float32", jnp.linalg.norm, (p(),), "float32"),
    Op("norm (dim=0)", "float32", functools.partial(jnp.linalg.norm, axis=0), (p(),), "float32"),
    Op("norm (p=1)", "float32", functools.partial(jnp.linalg.norm, ord=1), (p(),), "float32"),
    Op("norm (p=1, dim=0)", "float32", functools.partial(jnp.linalg.norm, ord=1, axis=0),
       (p(),), "float32"),
    Op("normalize", "float32",
       lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=1, keepdims=True), 1e-12), (m(),),
       "float32"),
    Op("cosine_similarity", "float32", optax.cosine_similarity, (m(), m()), "float32"),
    Op("poisson_nll_loss", "float32", lambda x, t: jnp.mean(jnp.exp(x) - t * x), (m(), m()),
       "float32"),
    Op("cosine_embedding_loss", "float32", cos_embedding,
       (H(np.array([[1.0, 2, 3]])), H(np.array([[1.0, 3, 4]])), ints(1)), "float32"),
    Op("hinge_embedding_loss", "float32",
       lambda x, y: jnp.mean(jnp.where(y == 1, x, jnp.maximum(0.0, 1.0 - x))), (m(), ints(N)),
       "float32"),
    Op("kl_div", "float32", lambda x, t: optax.kl_divergence(x, t).mean(), (m(), rand(N, N)),
       "float32"),
    Op("margin_ranking_loss", "float32",
       lambda a, b, y: jnp.mean(jnp.maximum(0.0, -y * (a - b))), (m(), m(), H(np.ones(N))),
       "float32"),
    Op("triplet_margin_loss", "float32",
       lambda a, p, n: optax.losses.triplet_margin_loss(a, p, n).mean(), (m(), m(), m()),
       "float32"),
    Op("binary_cross_entropy_with_logits", "float32",
       lambda x, t: optax.sigmoid_binary_cross_entropy(x, t).mean(), (m(), rand(N, N)),
       "float32"),
    Op("cumprod", "float32", functools.partial(jnp.cumprod, axis=0), (p(),), "float32"),
    Op("cumsum", "float32", functools.partial(jnp.cumsum, axis=0), (p(),), "float32"),
    Op("dist", "float32", lambda a, b: jnp.linalg.norm(a - b), (p(), p()), "float32"),
    Op("pdist", "float32", pdist, (m(),), "float32"),
    Op("cdist", "float32", pairwise, (m(), m()), "float32"),
    Op("prod", "float32", jnp.prod, (p(),), "float32"),
    Op("prod (dim=0)", "float32", functools.partial(jnp.prod, axis=0), (p(),), "float32"),
    Op("renorm", "float32", renorm, (m(),), "float32"),
    Op("sum", "float32", jnp.sum, (p(),), "float32"),
    Op("sum (dim=1)", "float32", functools.partial(jnp.sum, axis=1), (m(),), "float32"),
    Op("sum (dtype=float16)", "float32", lambda x: jnp.sum(x, dtype=x.dtype),
       (H(_OWN.normal(size=N)),), "float32", EXPLICIT_DTYPE, torch_out="compute"),
    Op("softplus", "float32", jax.nn.softplus, (p(),), "float32"),
    Op("nll_loss", "float32", nll, (F(_RNG.uniform(size=(N, N))), ints(N, value=0)), "float32"),
    Op("nll_loss2d", "float32",
       lambda x, y: -jnp.mean(jnp.take_along_axis(x, y[:, None], axis=1)),
       (rand(N, N, N, N), ints(N, N, N, value=0)), "float32"),
    Op("cross_entropy", "float32",
       lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean(),
       (m(), ints(N, value=3)), "float32"),
    Op("l1_loss", "float32", lambda a, b: jnp.mean(jnp.abs(a - b)), (m(), m()), "float32"),
    Op("smooth_l1_loss", "float32", lambda a, b: optax.huber_loss(a, b, delta=1.0).mean(),
       (m(), m()), "float32"),
    Op("mse_loss", "float32", lambda a, b: optax.squared_error(a, b).mean(), (m(), m()),
       "float32"),
    Op("multilabel_margin_loss", "float32", multilabel_margin, (m(), ints(N, N)), "float32"),
    Op("soft_margin_loss", "float32", lambda x, y: jnp.mean(jax.nn.softplus(-y * x)),
       (m(), ints(N, N)), "float32"),
    Op("multi_margin_loss", "float32", multi_margin, (m(), ints(N)), "float32"),
  ]  # fmt: skip


def _promote():
  p16, p32 = lambda **k: h(N, **k), lambda: f(N)
  return [
    Op("addcdiv", "promote", lambda a, b, c: a + b / c, (p32(), p16(), p16(lo=0.1, hi=100)),
       "float32"),
    Op("addcmul", "promote", lambda a, b, c: a + b * c, (p32(), p16(), p16()), "float32"),
    Op("atan2", "promote", jnp.arctan2, (p32(), p16(lo=0.1, hi=100)), "float32"),
    Op("bilinear", "promote",
       lambda x1, x2, w, b: jnp.einsum("bi,oij,bj->bo", x1, w, x2) + b,
       (h(1, 2), f(1, 2), h(1, 2, 2), f(1)), "compute",
       "two matmuls in JAX (dot_general) and a bias add: in the compute dtype, as addmm",
       bias_adds=1),
    Op("cross", "promote", jnp.cross, (f(3), h(3)), "float32"),
    Op("dot", "promote", jnp.dot, (p16(), p32()), "compute", MATMUL_IN_COMPUTE),
    Op("vdot", "promote", jnp.vdot, (p16(), p32()), "compute", MATMUL_IN_COMPUTE),
    Op("tensordot", "promote", jnp.tensordot, (f(2, 2, 2), h(2, 2, 2)), "compute",
       MATMUL_IN_COMPUTE),
    Op("grid_sample", "promote", grid_sample, (h(5, 5), F(_RNG.uniform(0, 4, size=(2, 6)))),
       "float32"),
    Op("index_put", "promote", lambda x, v: x.at[1].set(v[0]), (p32(), h(1)), "float32"),
    Op("index_put (float16 destination)", "promote", lambda x, v: x.at[1].set(v[0]),
       (p16(), f(1)), "float32"),
    Op("scatter_add", "promote", scatter_add,
       (F(np.zeros((2, 2, 2))), _RNG.integers(0, 2, (2, 2, 2)).astype(np.int32), h(2, 2, 2)),
       "float32"),
    Op("scatter_add (float16 destination)", "promote", scatter_add,
       (H(np.zeros((2, 2, 2))), _RNG.integers(0, 2, (2, 2, 2)).astype(np.int32), f(2, 2, 2)),
       "float32"),
  ]  # fmt: skip


def _builtin():
  pair = lambda: (f(N), h(N))
  ops = [("eq", jnp.equal, "bool"), ("ge", jnp.greater_equal, "bool"),
         ("gt", jnp.greater, "bool"), ("le", jnp.less_equal, "bool"), ("lt", jnp.less, "bool"),
         ("ne", jnp.not_equal, "bool"), ("add", jnp.add, "float32"),
         ("div", jnp.divide, "float32"), ("mul", jnp.multiply, "float32"),
         ("equal", jnp.array_equal, "bool")]  # fmt: skip
  out = [Op(name, "builtin", fn, pair(), dt) for name, fn, dt in ops]
  out += [Op("cat", "builtin", lambda a, b: jnp.concatenate([a, b]), (h(N), f(N)), "float32"),
          Op("stack", "builtin", lambda a, b: jnp.stack([a, b]), (h(N), f(N)), "float32")]
  return out


OPS = _lower() + _float32() + _promote() + _builtin()
TORCH_BUILTIN = {"bool", "float32"}  # torch's expected dtype for the builtin list is the op's own


def materialise(op, half):
  """The op's arguments as numpy arrays (an eager jnp conversion compiles a program each)."""
  return tuple(np.asarray(a.value, jnp.dtype(half)) if isinstance(a, H)
               else np.asarray(a.value, np.float32) if isinstance(a, F) else np.asarray(a)
               for a in op.args)  # fmt: skip


def widen64(args):
  return tuple(np.asarray(a, np.float64) if np.issubdtype(a.dtype, np.floating) else a
               for a in args)  # fmt: skip


@functools.cache
def references():
  """Each op, untransformed, in float64 on the inputs (the same for both half dtypes)."""
  with jax.enable_x64(True):
    args = [widen64(materialise(op, "float32")) for op in OPS]
    run = lambda args: [op.fn(*a) for op, a in zip(OPS, args, strict=True)]
    return [np.asarray(r, np.float64) for r in jax.jit(run, compiler_options=FAST)(args)]


@functools.cache
def results(half: str):
  """(outputs under autocast, the jaxpr of each op's autocast region): one program."""
  policy = POLICIES[half]
  args = [materialise(op, half) for op in OPS]
  run = lambda args: [jmp_scaler.autocast(op.fn, policy)(*a)
                      for op, a in zip(OPS, args, strict=True)]  # fmt: skip
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    traced = jax.jit(run, compiler_options=FAST).trace(args)
  assert [str(w.message) for w in caught if "autocast" in str(w.message)] == []
  regions = [e.params["jaxpr"] for e in traced.jaxpr.eqns if e.primitive.name == "jit"]
  assert len(regions) == len(OPS)
  return traced.lower().compile()(args), regions


def expected_dtype(op, half):
  return {"compute": jnp.dtype(half), "float32": jnp.dtype("float32"),
          "bool": jnp.dtype("bool")}[op.out]  # fmt: skip


# Equations that move or select values without arithmetic: exact in any dtype.
MOVES = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
         "dynamic_slice", "gather", "concatenate", "pad", "rev", "copy", "copy_p",
         "convert_element_type", "stop_gradient", "select_n", "iota"}  # fmt: skip
MATMULS = {"dot_general", "conv_general_dilated"}


def computing_eqns(jaxpr):
  """(primitive name, floating input dtypes) of every equation that computes a float."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    subs = list(jaxprs_in_params(eqn.params))
    for sub in subs:
      yield from computing_eqns(sub)
    if subs or eqn.primitive.name in MOVES:
      continue
    if any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars):
      yield eqn.primitive.name, {v.aval.dtype for v in eqn.invars
                                 if jnp.issubdtype(v.aval.dtype, jnp.floating)}  # fmt: skip


CASES = [pytest.param(op, half, id=f"{op.id}-{half}") for half in POLICIES for op in OPS]


def test_every_case_without_a_reason_is_torchs_dtype():
  for op in OPS:
    torch = op.torch_out or TORCH_OUT.get(op.table, op.out if op.out in TORCH_BUILTIN else None)
    assert op.why or op.out == torch, op.torch
    assert not op.why or op.out != torch or op.table == "promote", op.torch


@pytest.mark.parametrize("op,half", CASES)
def test_result_dtype_compute_dtype_and_value(op, half):
  outs, regions = results(half)
  i = OPS.index(op)
  out, region, ref = outs[i], regions[i], references()[i]
  assert result_dtype(region) == expected_dtype(op, half)
  # Matmuls, convolutions and their bias adds in the compute dtype; every other op that
  # computes, in float32.
  half_adds = 0
  for name, dtypes in computing_eqns(region):
    if name in MATMULS:
      assert dtypes == {jnp.dtype(half)}, (name, dtypes)
    elif name == "add" and dtypes == {jnp.dtype(half)}:
      half_adds += 1
    elif name in op.exact_in_half:  # before the softmax, which widens its input itself
      assert dtypes == {jnp.dtype(half)}, (name, dtypes)
    else:
      assert all(np.dtype(d).itemsize >= 4 for d in dtypes), (name, dtypes)
  assert half_adds == op.bias_adds
  got = np.asarray(out, np.float64)
  assert np.isfinite(got).all() == np.isfinite(ref).all()
  if any(name in MATMULS for name, _ in computing_eqns(region)):
    eps = float(jnp.finfo(half).eps)  # rounded inputs of the matmul: about eps * sqrt(n) * |x|
    np.testing.assert_allclose(got, ref, rtol=8 * eps, atol=8 * eps * np.abs(ref).max())
  else:  # float32 arithmetic on the rounded inputs
    rtol = op.eps * float(jnp.finfo(half).eps) or 2e-5
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-6 * np.abs(ref).max())


# ------------------------------------------------------------------ overflow


def _big(*shape, scale):
  return np.asarray(_RNG.normal(size=shape) * scale, np.float16)


# Each result is finite in float32 and overflows (or is rounded to 0) in float16.
OVERFLOWS = {
  "sum of squares": (lambda x: jnp.sum(x**2), np.full(2, 300.0, np.float16)),
  "mean of squares": (lambda x: jnp.mean(x**2), np.full(4, 300.0, np.float16)),
  "var": (jnp.var, np.array([300.0, -300.0], np.float16)),
  "norm": (jnp.linalg.norm, np.full((4,), 300.0, np.float16)),
  "norm (axis)": (functools.partial(jnp.linalg.norm, axis=1), np.full((2, 4), 300.0, np.float16)),
  "norm (p=1, axis)": (functools.partial(jnp.linalg.norm, ord=1, axis=0),
                       np.full((4, 2), 30000.0, np.float16)),
  "prod": (jnp.prod, np.array([300.0, 300.0], np.float16)),
  "cumsum": (jnp.cumsum, np.full(3, 40000.0, np.float16)),
  "layer_norm (flax)": (flax_apply(nn.LayerNorm()), _big(8, scale=300)),
  "layer_norm (hand-written)": (layer_norm_hand, _big(8, scale=300)),
  "group_norm (flax)": (flax_apply(nn.GroupNorm(num_groups=2)), _big(2, 8, scale=300)),
  "softmax (100 000 classes)": (jax.nn.softmax, np.zeros(100_000, np.float16)),
  "log_softmax (100 000 classes)": (jax.nn.log_softmax, np.zeros(100_000, np.float16)),
  "logsumexp (100 000 classes)": (jax.nn.logsumexp, np.zeros(100_000, np.float16)),
  "cross_entropy (100 000 classes)": (
      lambda x: optax.softmax_cross_entropy_with_integer_labels(x, jnp.zeros(1, jnp.int32)),
      np.zeros((1, 100_000), np.float16)),
  "mse_loss": (lambda a: optax.squared_error(a, -a).mean(), np.full(4, 300.0, np.float16)),
  "l1_loss": (lambda a: jnp.mean(jnp.abs(a - -a)), np.full(4, 40000.0, np.float16)),
  "cosine_similarity (optax)": (lambda a: optax.cosine_similarity(a, a), _big(4, scale=300)),
  "cosine_similarity (hand-written)": (
      lambda a: jnp.sum(a * a) / (jnp.linalg.norm(a) * jnp.linalg.norm(a)), _big(4, scale=300)),
  "cdist": (lambda a: pairwise(a, -a), np.full((2, 4), 300.0, np.float16)),
  "poisson_nll_loss": (lambda x: jnp.mean(jnp.exp(x) - x), np.full(4, 12.0, np.float16)),
}  # fmt: skip


# flax's norms compute their statistics in float32 themselves, and optax's cosine similarity
# normalises first: no hazard without autocast.
SAFE_IN_FLOAT16 = {"layer_norm (flax)", "group_norm (flax)", "cosine_similarity (optax)"}


@functools.cache
def overflow_results():
  """{name: (under autocast, in plain float16, float64 reference)}: one program each."""
  names = list(OVERFLOWS)
  xs = [np.asarray(OVERFLOWS[n][1]) for n in names]
  policy = POLICIES["float16"]
  fns = [OVERFLOWS[n][0] for n in names]
  auto, plain = jax.jit(lambda xs: (
      [jmp_scaler.autocast(fn, policy)(x) for fn, x in zip(fns, xs, strict=True)],
      [fn(x) for fn, x in zip(fns, xs, strict=True)]), compiler_options=FAST)(xs)  # fmt: skip
  with jax.enable_x64(True):
    refs = jax.jit(lambda xs: [fn(x.astype(jnp.float64)) for fn, x in zip(fns, xs, strict=True)],
                   compiler_options=FAST)(xs)  # fmt: skip
  return {n: (a, np.asarray(p, np.float64), np.asarray(r, np.float64))
          for n, a, p, r in zip(names, auto, plain, refs, strict=True)}  # fmt: skip


@pytest.mark.parametrize("name", list(OVERFLOWS))
def test_no_reduction_norm_softmax_or_loss_over_float16_overflows_where_float32_does_not(name):
  auto, plain, ref = overflow_results()[name]
  assert np.isfinite(ref).all()
  if name not in SAFE_IN_FLOAT16:  # the hazard is real: plain float16 overflows or is far off
    close = np.isfinite(plain).all() and np.allclose(plain, ref, rtol=1e-2, atol=0)
    assert not close, plain
  assert auto.dtype == jnp.float32
  got = np.asarray(auto, np.float64)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-6)


# ------------------------------------------------------------------ differences without a fix
# What autocast cannot tell apart in a jaxpr (docs/autocast.md gives each its row and reason).


@pytest.mark.parametrize("half", POLICIES)
def test_vdot_dot_and_tensordot_are_the_jaxpr_of_matmul_so_their_product_is_in_the_compute_dtype(
    half):
  rng = np.random.default_rng(7)
  x16 = jnp.asarray(rng.normal(size=N), half)
  y32 = jnp.asarray(rng.normal(size=N), jnp.float32)  # not representable in the half dtype
  matmul = str(jax.make_jaxpr(jnp.matmul)(x16, y32))
  for fn in (jnp.vdot, jnp.dot, jnp.tensordot):
    axes = {"axes": 1} if fn is jnp.tensordot else {}
    assert str(jax.make_jaxpr(functools.partial(fn, **axes))(x16, y32)) == matmul, fn
  policy = POLICIES[half]
  assert in_dtypes(jmp_scaler.autocast(jnp.vdot, policy), x16, y32)["dot_general"] == {half}
  vdot, mm, promoted = jax.jit(lambda x, y: (
      jmp_scaler.autocast(jnp.vdot, policy)(x, y), jmp_scaler.autocast(jnp.matmul, policy)(x, y),
      jmp_scaler.full_precision(jnp.vdot)(x, y)), compiler_options=FAST)(x16, y32)  # fmt: skip
  assert vdot.dtype == jnp.float32 and vdot == mm  # o=f32: the float16 product, widened
  # torch's promoted float32 product is what full_precision gives; autocast's is not it.
  ref = np.dot(np.asarray(x16, np.float64), np.asarray(y32, np.float64))
  assert promoted.dtype == jnp.float32 and abs(float(promoted) - ref) < 1e-5 * np.abs(ref) + 1e-6
  assert float(vdot) != float(promoted)


def test_bilinear_is_two_matmuls_in_the_jaxpr_in_the_compute_dtype():
  x1, x2 = jnp.ones((2, 3), jnp.float16), jnp.ones((2, 4), jnp.float32)
  w = jnp.ones((5, 3, 4), jnp.float16)
  bilinear = lambda x1, x2, w: jnp.einsum("bi,oij,bj->bo", x1, w, x2)  # noqa: E731
  names = [e.primitive.name for e in eqns(jax.make_jaxpr(bilinear)(x1, x2, w))]
  assert [n for n in names if n != "convert_element_type"] == ["dot_general"] * 2  # two matmuls
  f = jmp_scaler.autocast(bilinear, POLICIES["float16"])
  assert in_dtypes(f, x1, x2, w)["dot_general"] == {"float16"}


def test_a_python_exponent_is_rounded_to_the_input_dtype_before_autocast_sees_it():
  f = jmp_scaler.autocast(lambda x: jnp.power(x, 1.7), POLICIES["float16"])
  x = np.asarray([3.0, 50.0], np.float16)
  (pow_eqn,) = [e for e in eqns(jax.make_jaxpr(f)(x)) if e.primitive.name == "pow"]
  assert float(pow_eqn.invars[1].val) == 1.7001953125  # the Python 1.7 is gone
  exact = jmp_scaler.autocast(lambda x: jnp.power(x, jnp.float32(1.7)), POLICIES["float16"])
  got, kept = jax.jit(lambda x: (f(x), exact(x)), compiler_options=FAST)(x)
  assert got.dtype == jnp.float32  # the float32 op, with the rounded exponent
  x64 = np.asarray(x, np.float64)
  np.testing.assert_allclose(got, x64**1.7001953125, rtol=2e-6)
  err = abs(float(got[1]) / 50.0**1.7 - 1)
  assert 7.4e-4 < err < 7.8e-4, err  # |ln 50| * (1.7001953125 - 1.7): torch's pow has 1.7
  np.testing.assert_allclose(kept, x64**1.7, rtol=2e-6)  # a float32 exponent is exact


@pytest.mark.parametrize("half", POLICIES)
def test_sum_with_an_explicit_half_dtype_is_the_jaxpr_of_a_half_reduction(half):
  x = jnp.asarray(np.random.default_rng(8).normal(size=N), half)
  explicit = lambda x: jnp.sum(x, dtype=x.dtype)  # noqa: E731
  reduction = lambda x: lax.reduce_sum(x, (0,))  # noqa: E731
  assert str(jax.make_jaxpr(explicit)(x)) == str(jax.make_jaxpr(reduction)(x))
  region = jax.make_jaxpr(jmp_scaler.autocast(explicit, POLICIES[half]))(x).eqns[0].params["jaxpr"]
  assert result_dtype(region) == jnp.float32  # torch: the dtype asked for
  kept = jmp_scaler.autocast(explicit, POLICIES[half], rules={"reduce_sum": "promote"})
  region = jax.make_jaxpr(kept)(x).eqns[0].params["jaxpr"]
  assert result_dtype(region) == jnp.dtype(half)


# ------------------------------------------------------------------ the docs table


def test_docs_table_lists_every_op_of_the_lists_with_a_verdict():
  text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "autocast.md").read_text()
  rows = [ln for ln in text.splitlines() if ln.startswith("| `")]
  listed = {name for ln in rows for name in re.findall(r"`([\w_.]+)`", ln.split("|")[1])}
  missing = sorted({op.torch.split(" ")[0] for op in OPS} - listed)
  assert missing == [], missing
