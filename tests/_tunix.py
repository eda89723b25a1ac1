"""What the tunix tests share: a character tokenizer and a tiny random Qwen3 of tunix's zoo."""

import jax.numpy as jnp
from flax import nnx

PAD = 0
#: The tiny Qwen3's (and Llama3's) sizes: 2 layers, d=64, the tokenizer's 48 ids.
SIZES = dict(num_layers=2, vocab_size=48, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
             num_kv_heads=2, rope_theta=10000, norm_eps=1e-6)


class CharTokenizer:
  """What tunix's TokenizerAdapter needs: 5 specials and 43 characters, 48 ids."""

  vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "<sep>",
           *"abcdefghijklmnopqrstuvwxyz0123456789 +-=?.,"]

  def __init__(self):
    self.ids = {c: i for i, c in enumerate(self.vocab)}

  def encode(self, text, **kwargs):
    return [1] + [self.ids.get(c, 3) for c in text]

  def decode(self, ids, **kwargs):
    return "".join(self.vocab[i] for i in ids if i >= 5)

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return PAD


def qwen3(qwen3_module, dtype=jnp.float32):
  """A tiny random Qwen3 (``tunix.models.qwen3.model``) computing in ``dtype``, float32
  parameters (tunix allocates the KV cache in ``dtype``)."""
  config = qwen3_module.ModelConfig(
      **SIZES, use_tied_embedding=False, dtype=dtype, param_dtype=jnp.float32,
      shd_config=qwen3_module.ShardingConfig.get_default_sharding())
  return qwen3_module.Qwen3(config, rngs=nnx.Rngs(params=0))
