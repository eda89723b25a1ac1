"""The models of bench_memory.py: each written once, with a ``dtype`` field that is ``None``
for plain float32 code (what ``autocast`` transforms) and a half dtype for hand annotation
(every layer's ``dtype=``, norms' statistics and the softmax in float32 as Flax computes
them, the parameters stored in float32).

* ``gpt``: a GPT-2 block (pre-LN, causal attention, a 4d MLP with ``nn.gelu``);
* ``llama``: a Llama block (RMSNorm, rotary embeddings, a SiLU-gated MLP);
* ``lm1b``: the architecture of flax's lm1b example (an embedding, sinusoidal positions,
  pre-LN blocks with a ReLU MLP, a LayerNorm and an output projection);
* ``gemma``: a Gemma-3 layout on NNX (RMSNorm before and after attention and the MLP, a
  gated GELU MLP, grouped-query attention with RoPE and query/key norms, an embedding
  scaled by sqrt(d) and tied to the output);
* ``resnet``: a ResNet with BatchNorm (three stages of two basic blocks on 32x32 images).

The transformer blocks are stacked ``layers`` times, unrolled, under ``nn.scan``
(``scan=True``), or under ``jax.checkpoint`` with ``dots_saveable`` (``remat=True``).
Written for this benchmark; no example's code is copied.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

F32 = jnp.float32


def _dense(features: int, dtype: Any, name: str | None = None, bias: bool = True) -> nn.Dense:
  return nn.Dense(features, dtype=dtype, use_bias=bias, name=name)


def _causal_attention(q, k, v, dtype):
  """Scores and the weighted sum in the compute dtype, the softmax in float32, as Flax's
  attention computes with ``force_fp32_for_softmax`` (what a careful hand annotation does)."""
  d = q.shape[-1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.asarray(math.sqrt(d), q.dtype)
  n = q.shape[1]
  mask = jnp.tril(jnp.ones((n, n), bool))
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  weights = jax.nn.softmax(scores.astype(F32), axis=-1)
  if dtype is not None:
    weights = weights.astype(dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _rope(x, base: float = 10000.0):
  """Rotary embedding of ``x`` (batch, seq, heads, dim), the angles in float32."""
  n, d = x.shape[1], x.shape[-1]
  freq = base ** (-jnp.arange(0, d, 2, dtype=F32) / d)
  angle = jnp.arange(n, dtype=F32)[:, None] * freq[None, :]
  sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class GPTBlock(nn.Module):
  d: int
  heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x, _=None):
    b, n, _d = x.shape
    h = nn.LayerNorm(dtype=self.dtype)(x)
    qkv = _dense(3 * self.d, self.dtype)(h).reshape(b, n, 3, self.heads, -1)
    a = _causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], self.dtype)
    x = x + _dense(self.d, self.dtype)(a.reshape(b, n, self.d))
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.gelu(_dense(4 * self.d, self.dtype)(h))
    return x + _dense(self.d, self.dtype)(h), None


class LlamaBlock(nn.Module):
  d: int
  heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x, _=None):
    b, n, _d = x.shape
    h = nn.RMSNorm(dtype=self.dtype)(x)
    q, k, v = (_dense(self.d, self.dtype, bias=False)(h).reshape(b, n, self.heads, -1)
               for _ in range(3))
    a = _causal_attention(_rope(q), _rope(k), v, self.dtype)
    x = x + _dense(self.d, self.dtype, bias=False)(a.reshape(b, n, self.d))
    h = nn.RMSNorm(dtype=self.dtype)(x)
    hidden = 8 * self.d // 3
    gate = nn.silu(_dense(hidden, self.dtype, bias=False)(h))
    up = _dense(hidden, self.dtype, bias=False)(h)
    return x + _dense(self.d, self.dtype, bias=False)(gate * up), None


class LM1BBlock(nn.Module):
  d: int
  heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x, _=None):
    b, n, _d = x.shape
    h = nn.LayerNorm(dtype=self.dtype)(x)
    q, k, v = (_dense(self.d, self.dtype)(h).reshape(b, n, self.heads, -1) for _ in range(3))
    a = _causal_attention(q, k, v, self.dtype)
    x = x + _dense(self.d, self.dtype)(a.reshape(b, n, self.d))
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.relu(_dense(4 * self.d, self.dtype)(h))
    return x + _dense(self.d, self.dtype)(h), None


BLOCKS = {"gpt": GPTBlock, "llama": LlamaBlock, "lm1b": LM1BBlock}


class Stack(nn.Module):
  """``layers`` blocks over float32 inputs of width ``d``; a float32 scalar loss."""

  block: str
  d: int
  heads: int
  layers: int
  scan: bool = False
  remat: bool = False
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    cls = BLOCKS[self.block]
    if self.remat:
      cls = nn.remat(cls, policy=jax.checkpoint_policies.dots_saveable)
    if self.scan:
      stack = nn.scan(cls, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.layers)(self.d, self.heads, self.dtype)
      x, _ = stack(x, None)
    else:
      for _ in range(self.layers):
        x, _ = cls(self.d, self.heads, self.dtype)(x)
    return x


class LM1B(nn.Module):
  """flax's lm1b layout: embedding, sinusoidal positions, pre-LN ReLU blocks, final norm,
  an output projection; the loss is the token cross-entropy in float32."""

  vocab: int
  d: int
  heads: int
  layers: int
  dtype: Any = None

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d, dtype=self.dtype)(tokens)
    n = tokens.shape[1]
    pos = jnp.arange(n, dtype=F32)[:, None] / (10000 ** (jnp.arange(0, self.d, 2) / self.d))
    x = x + jnp.concatenate([jnp.sin(pos), jnp.cos(pos)], -1).astype(x.dtype)[None]
    for _ in range(self.layers):
      x, _ = LM1BBlock(self.d, self.heads, self.dtype)(x)
    x = nn.LayerNorm(dtype=self.dtype)(x)
    return _dense(self.vocab, self.dtype)(x)


class ResNet(nn.Module):
  """Three stages of two basic blocks (conv-BN-relu x2 + shortcut), global pool, a head."""

  widths: tuple = (32, 64, 128)
  classes: int = 10
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = lambda: nn.BatchNorm(use_running_average=not train, dtype=self.dtype)  # noqa: E731
    conv = lambda f, s=1: nn.Conv(f, (3, 3), (s, s), use_bias=False, dtype=self.dtype)  # noqa
    x = nn.relu(norm()(conv(self.widths[0])(x)))
    for i, f in enumerate(self.widths):
      for j in range(2):
        stride = 2 if (j == 0 and i > 0) else 1
        y = nn.relu(norm()(conv(f, stride)(x)))
        y = norm()(conv(f)(y))
        if x.shape[-1] != f or stride != 1:
          x = norm()(nn.Conv(f, (1, 1), (stride, stride), use_bias=False, dtype=self.dtype)(x))
        x = nn.relu(x + y)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.classes, dtype=self.dtype)(x)


# ------------------------------------------------------------------- Gemma-3 layout, NNX


class GemmaBlock(nnx.Module):
  def __init__(self, d: int, heads: int, kv_heads: int, rngs: nnx.Rngs, dtype: Any = None):
    self.heads, self.kv_heads, self.dim = heads, kv_heads, d // heads
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)  # noqa: E731
    norm = lambda n: nnx.RMSNorm(n, dtype=dtype, rngs=rngs)  # noqa: E731
    self.pre_attn, self.post_attn, self.pre_mlp, self.post_mlp = (norm(d) for _ in range(4))
    self.q, self.k, self.v = lin(d, d), lin(d, kv_heads * self.dim), lin(d, kv_heads * self.dim)
    self.q_norm, self.k_norm = norm(self.dim), norm(self.dim)
    self.o = lin(d, d)
    self.gate, self.up, self.down = lin(d, 4 * d), lin(d, 4 * d), lin(4 * d, d)
    self.dtype = dtype

  def __call__(self, x):
    b, n, d = x.shape
    h = self.pre_attn(x)
    q = self.q_norm(self.q(h).reshape(b, n, self.heads, self.dim))
    k = self.k_norm(self.k(h).reshape(b, n, self.kv_heads, self.dim))
    v = self.v(h).reshape(b, n, self.kv_heads, self.dim)
    rep = self.heads // self.kv_heads
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    a = _causal_attention(_rope(q), _rope(k), v, self.dtype).reshape(b, n, d)
    x = x + self.post_attn(self.o(a))
    h = self.pre_mlp(x)
    h = nnx.gelu(self.gate(h), approximate=True) * self.up(h)
    return x + self.post_mlp(self.down(h))


class Gemma(nnx.Module):
  def __init__(self, vocab: int, d: int, heads: int, kv_heads: int, layers: int,
               rngs: nnx.Rngs, dtype: Any = None):  # fmt: skip
    self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([GemmaBlock(d, heads, kv_heads, rngs, dtype) for _ in range(layers)])
    self.final = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
    self.d = d

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x * jnp.asarray(math.sqrt(self.d), x.dtype)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.final(x))
