"""Models shared by the benchmarks: an MLP and a pre-LN transformer block (and ``row``,
the one way their tables are printed).

Plain JAX (no Flax module) so that the step a variant compiles is the model,
the optimizer and the variant's scaling/skip logic, nothing else. Parameters
are float32 masters; ``loss`` casts them and the inputs to ``compute_dtype``
(float16, bfloat16 or float32) and returns a float32 scalar.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MLP:
  """``depth`` dense layers of ``width`` with ReLU, a linear head, softmax CE."""

  width: int = 1024
  depth: int = 4
  classes: int = 10
  batch: int = 128

  def init(self, key):
    keys = jax.random.split(key, self.depth + 1)
    dims = [self.width] * (self.depth + 1)
    layers = [_dense(k, dims[i], dims[i + 1]) for i, k in enumerate(keys[:-1])]
    return {"layers": layers, "head": _dense(keys[-1], self.width, self.classes)}

  def batch_of(self, key):
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (self.batch, self.width), jnp.float32)
    y = jax.random.randint(ky, (self.batch,), 0, self.classes)
    return {"x": x, "y": y}

  def loss(self, params, batch, compute_dtype=jnp.float16):
    p = _cast(params, compute_dtype)
    h = batch["x"].astype(compute_dtype)
    for layer in p["layers"]:
      h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = (h @ p["head"]["w"] + p["head"]["b"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


@dataclasses.dataclass(frozen=True)
class Transformer:
  """``layers`` pre-LN blocks (attention + GELU MLP), regression to a target.

  LayerNorm and softmax run in float32, the matmuls in ``compute_dtype``.
  """

  d: int = 256
  heads: int = 4
  ff: int = 1024
  seq: int = 128
  batch: int = 16
  layers: int = 1

  def init(self, key):
    def block(k):
      k1, k2, k3, k4 = jax.random.split(k, 4)
      ones, zeros = jnp.ones(self.d, jnp.float32), jnp.zeros(self.d, jnp.float32)
      return {
          "ln1": {"g": ones, "b": zeros},
          "qkv": _dense(k1, self.d, 3 * self.d),
          "out": _dense(k2, self.d, self.d),
          "ln2": {"g": ones, "b": zeros},
          "up": _dense(k3, self.d, self.ff),
          "down": _dense(k4, self.ff, self.d),
      }

    return {"blocks": [block(k) for k in jax.random.split(key, self.layers)]}

  def batch_of(self, key):
    kx, ky = jax.random.split(key)
    shape = (self.batch, self.seq, self.d)
    return {
        "x": jax.random.normal(kx, shape, jnp.float32),
        "y": jax.random.normal(ky, shape, jnp.float32),
    }

  def loss(self, params, batch, compute_dtype=jnp.float16):
    p = _cast(params, compute_dtype)
    h = batch["x"].astype(compute_dtype)
    for blk in p["blocks"]:
      h = h + self._attention(blk, _layer_norm(h, blk["ln1"]))
      u = _layer_norm(h, blk["ln2"]) @ blk["up"]["w"] + blk["up"]["b"]
      h = h + jax.nn.gelu(u) @ blk["down"]["w"] + blk["down"]["b"]
    return jnp.mean(jnp.square(h.astype(jnp.float32) - batch["y"]))

  def _attention(self, blk, x):
    b, t, d = x.shape
    hd = d // self.heads
    qkv = (x @ blk["qkv"]["w"] + blk["qkv"]["b"]).reshape(b, t, 3, self.heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
    causal = jnp.tril(jnp.ones((t, t), bool))
    w = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1).astype(x.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)
    return o @ blk["out"]["w"] + blk["out"]["b"]


def _dense(key, n_in, n_out):
  w = jax.random.normal(key, (n_in, n_out), jnp.float32) * (2.0 / n_in) ** 0.5
  return {"w": w, "b": jnp.zeros(n_out, jnp.float32)}


def _cast(params, dtype):
  return jax.tree.map(lambda p: p.astype(dtype), params)


def _layer_norm(x, p, eps=1e-5):
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.var(x32, axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps) * p["g"] + p["b"]
  return y.astype(x.dtype)


def poison(batch):
  """The same batch with an inf in its first input: every gradient overflows."""
  x = batch["x"]
  return {**batch, "x": x.at[(0,) * x.ndim].set(jnp.inf)}


@dataclasses.dataclass(frozen=True)
class DeepMLP:
  """A residual tanh MLP with ``leaves`` parameter leaves and about ``params`` parameters.

  ``leaves // 2`` square dense layers (weight and bias),
  ``h = h + r * tanh(h @ w + b)`` with ``r = sqrt(2 / leaves)`` (so that ``h``
  stays of order 1 at any depth and float16 never overflows at the benchmarks'
  loss scale), regression to a target: the width shrinks as the leaf count
  grows, so the parameter count (and the optimizer's arithmetic) stays the same
  while the number of leaves the scaler handles grows. 8 leaves: 4 layers of 1024.
  """

  leaves: int = 8
  params: int = 4 * 1024 * 1024
  batch: int = 32

  @property
  def width(self) -> int:
    return max(8, int(round((self.params / (self.leaves // 2)) ** 0.5)))

  def init(self, key):
    w = self.width
    return {"layers": [_dense(k, w, w) for k in jax.random.split(key, self.leaves // 2)]}

  def batch_of(self, key):
    kx, ky = jax.random.split(key)
    shape = (self.batch, self.width)
    return {"x": jax.random.normal(kx, shape, jnp.float32),
            "y": jax.random.normal(ky, shape, jnp.float32)}

  def loss(self, params, batch, compute_dtype=jnp.float16):
    p = _cast(params, compute_dtype)
    h = batch["x"].astype(compute_dtype)
    r = (2.0 / self.leaves) ** 0.5
    for layer in p["layers"]:
      h = h + jnp.tanh(h @ layer["w"] + layer["b"]) * r
    return jnp.mean(jnp.square(h.astype(jnp.float32) - batch["y"]))


@dataclasses.dataclass(frozen=True)
class GPT:
  """A GPT-style decoder: token and position embeddings, pre-LN blocks, tied LM head.

  ``layers`` blocks of :class:`Transformer` (16 leaves each) plus the
  embeddings and the final LayerNorm; LayerNorm and softmax in float32.
  """

  layers: int = 6
  d: int = 256
  heads: int = 4
  seq: int = 128
  batch: int = 8
  vocab: int = 1024

  def _blocks(self):
    return Transformer(d=self.d, heads=self.heads, ff=4 * self.d, seq=self.seq,
                       batch=self.batch, layers=self.layers)

  def init(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "tok": jax.random.normal(k1, (self.vocab, self.d), jnp.float32) * 0.02,
        "pos": jax.random.normal(k2, (self.seq, self.d), jnp.float32) * 0.02,
        "blocks": self._blocks().init(k3)["blocks"],
        "ln_f": {"g": jnp.ones(self.d, jnp.float32), "b": jnp.zeros(self.d, jnp.float32)},
    }

  def batch_of(self, key):
    tokens = jax.random.randint(key, (self.batch, self.seq + 1), 0, self.vocab)
    # A float input (zeros) that poison() can set to inf: added to the embeddings.
    return {"tokens": tokens, "x": jnp.zeros((self.batch, self.seq, self.d), jnp.float32)}

  def loss(self, params, batch, compute_dtype=jnp.float16):
    p = _cast(params, compute_dtype)
    blocks = self._blocks()
    inp, tgt = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    h = p["tok"][inp] + p["pos"][None] + batch["x"].astype(compute_dtype)
    for blk in p["blocks"]:
      h = h + blocks._attention(blk, _layer_norm(h, blk["ln1"]))
      u = _layer_norm(h, blk["ln2"]) @ blk["up"]["w"] + blk["up"]["b"]
      h = h + jax.nn.gelu(u) @ blk["down"]["w"] + blk["down"]["b"]
    logits = (_layer_norm(h, p["ln_f"]) @ p["tok"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))


def row(first, width, cells, widths):
  """A table row: every cell right-aligned and after a space, so that a figure wider than
  its column (a 17.86x step under load) still parses as its own word."""
  return f"{first:<{width}}" + "".join(
      f" {str(c):>{n}}" for c, n in zip(cells, widths, strict=True))
