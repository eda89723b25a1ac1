"""``jmp_tunix.mismatch_origin``: where tunix's decode path (prefill, then one KV-cache step per
token) and its full forward part, module by module (issue 46).

The argument checks need no tunix; the others run on tunix's tiny random Qwen3 (2 layers,
d=64, vocabulary 48) and Llama3 and are skipped, saying so, where google-tunix is not
installed. Two rollouts of 32 prompts x 24 tokens (tunix's rollout under float32 and
bfloat16, as ``jmp_tunix.rollout_engine`` builds it), read by several tests; about 15 s on a
2-core CPU.
"""

from __future__ import annotations

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_scaler
from jmp_scaler import tunix as jmp_tunix
from tests import _tunix as T
from tests._tunix import PAD, SIZES, CharTokenizer

F32, BF16 = "p=f32,c=f32,o=f32", "p=f32,c=bf16,o=f32"
PROMPTS = [f"{i // 4}+{i % 4}=" for i in range(32)]
TOKENS = 24  # 32 prompts x (8 + 24) positions: XLA:CPU's bfloat16 paths part at this size


# ---------------------------------------------------------------- no tunix needed


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "qwen3"}, "model must be a flax NNX module"),
    ({"prompt_tokens": np.zeros((2, 4), np.float32)}, "prompt_tokens must be"),
    ({"completion_tokens": np.zeros(4, np.int32)}, "completion_tokens must be"),
    ({"completion_tokens": np.zeros((3, 4), np.int32)}, "one batch"),
    ({"completion_tokens": np.zeros((2, 0), np.int32)}, "at least one token"),
    ({"cache_size": 7}, "cache_size=7 must be an int of at least prompt \\+ completion = 8"),
    ({"tolerance": 0.0}, "tolerance=0.0 must be a positive number"),
    ({"policy": "p=f32,c=f99"}, "mismatch_origin: policy='p=f32,c=f99' is not a dtype policy"),
])
def test_the_arguments_are_checked_before_tunix_is_imported(kwargs, match):
  given = dict(model=nnx.Linear(2, 2, rngs=nnx.Rngs(0)), prompt_tokens=np.ones((2, 4), np.int32),
               completion_tokens=np.ones((2, 4), np.int32), policy=F32)
  given.update(kwargs)
  with pytest.raises(ValueError, match=match):
    jmp_tunix.mismatch_origin(given.pop("model"), given.pop("prompt_tokens"),
                              given.pop("completion_tokens"), given.pop("policy"), pad_id=PAD,
                              **given)


# ---------------------------------------------------------------- tunix


@pytest.fixture(scope="module")
def tunix():
  pytest.importorskip("tunix", reason="google-tunix is not installed: pip install -e '.[tunix]'")
  from tunix.models.llama3 import model as llama3
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl import common
  from tunix.rl.rollout import base_rollout

  return types.SimpleNamespace(qwen3=qwen3, llama3=llama3, common=common,
                               base_rollout=base_rollout)


def _qwen3(tunix):
  return T.qwen3(tunix.qwen3)


def _rollout(tunix, model, policy):
  """tunix's vanilla rollout under ``policy`` (the recipe's), its 32 completions cut at a
  sampled pad, and the trainer's log-probabilities of them: tunix's compute_per_token_logps
  under the policy, the weights an argument (as the recipe's policy loss runs it; the
  rollout's own get_per_token_logps closes over them, which XLA compiles otherwise)."""
  config = tunix.base_rollout.RolloutConfig(
      max_tokens_to_generate=TOKENS, max_prompt_length=8, kv_cache_size=8 + TOKENS,
      temperature=1.0, top_p=1.0, top_k=None, return_logprobs=True)
  rollout = jmp_tunix.rollout_engine(policy)(model, CharTokenizer(), rollout_config=config)
  out = rollout.generate(PROMPTS, config)
  shape = (len(PROMPTS), TOKENS)
  tokens, sampled = np.full(shape, PAD, np.int32), np.zeros(shape, np.float32)
  for i, (t, logps) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
    n = int(np.argmax(np.asarray(t) == PAD)) if PAD in list(t) else len(t)
    tokens[i, :n], sampled[i, :n] = np.asarray(t)[:n], np.asarray(logps)[:n]
  prompts = np.asarray(out.left_padded_prompt_tokens)
  graphdef, state = nnx.split(model)

  def trainer(state, prompt, completion):
    return tunix.common.compute_per_token_logps(graphdef, state, prompt, completion,
                                                pad_id=PAD, eos_id=2)

  trained = np.asarray(jax.jit(jmp_scaler.autocast(trainer, policy))(
      state, jnp.asarray(prompts), jnp.asarray(tokens)))
  return types.SimpleNamespace(prompts=prompts, tokens=tokens, sampled=sampled, trained=trained)


@pytest.fixture(scope="module")
def float32(tunix):
  model = _qwen3(tunix)
  run = _rollout(tunix, model, F32)
  run.report = jmp_tunix.mismatch_origin(model, run.prompts, run.tokens, F32, pad_id=PAD)
  return run


@pytest.fixture(scope="module")
def bfloat16(tunix):
  model = _qwen3(tunix)
  run = _rollout(tunix, model, BF16)
  run.report = jmp_tunix.mismatch_origin(model, run.prompts, run.tokens, BF16, pad_id=PAD,
                                         cache_size=8 + TOKENS)
  return run


def test_in_float32_the_paths_agree_within_the_tolerance_at_every_module(float32):
  report = float32.report
  names = [row.name for row in report.layers]
  assert names[:2] == ["layers.0.input_layernorm", "layers.0.attn.q_proj"]
  assert names[-3:] == ["final_norm", "lm_head", "logits"]
  # a submodule's row comes before the row of the module that calls it
  assert names.index("layers.0.attn.o_proj") < names.index("layers.0.attn") < names.index(
      "layers.0")
  assert report.origin is None and report.positions > len(PROMPTS) * 5
  assert all(row.difference <= report.tolerance and row.share == 0 for row in report.layers)
  assert report.layer("logits").input_difference is None
  assert report.layer("layers.0.attn").input_difference is not None
  assert report.excess_precision == (0.0, 0.0)
  assert float(report.parity.mean_abs_dlogp) < 1e-6
  text = str(report)
  assert "origin: none, the logits agree" in text and "lm_head" in text
  with pytest.raises(KeyError, match="no module 'attn'"):
    report.layer("attn")


def test_the_paths_are_the_rollout_s_sampler_and_trainer(float32, bfloat16):
  """The decode path's log-probabilities are those tunix's sampler drew the tokens with, the
  full forward's those of tunix's compute_per_token_logps, under the policy (bfloat16's
  mismatch is 1e-3 and more: 1e-5 tells the paths apart)."""
  for run in (float32, bfloat16):
    report, mask = run.report, run.report.mask
    assert mask.sum() == (np.cumprod(run.tokens != PAD, axis=1) > 0).sum()
    np.testing.assert_allclose(report.decode_logprobs[mask], run.sampled[mask], atol=1e-5)
    np.testing.assert_allclose(report.forward_logprobs[mask], run.trained[mask], atol=1e-5)
    dlogp = np.abs(report.decode_logprobs - report.forward_logprobs)[mask]
    np.testing.assert_allclose(float(report.parity.mean_abs_dlogp), dlogp.mean(), rtol=1e-5)


def test_in_bfloat16_the_origin_is_the_first_module_whose_input_agrees_and_output_not(bfloat16):
  """Where is XLA's to say (jax 0.10's XLA:CPU: layers.0.attn; jax 0.12.0's: lm_head, the
  attention agreeing exactly as written; jax 0.12.1's: nowhere, the paths agree as written and
  the mismatch XLA compiles is its excess precision); what the origin is, is the function's."""
  report = bfloat16.report
  if report.origin is None:  # jax 0.12.1's XLA:CPU: the paths agree as written, to the bit
    assert report.layer("logits").difference <= report.tolerance, str(report)
    assert "origin: none" in str(report)
    assert max(report.excess_precision) > 0  # what the compiled paths differ by is XLA's
    return
  assert report.origin is not None, str(report)
  names = [row.name for row in report.layers]
  row = report.layer(report.origin)
  assert row.difference > report.tolerance
  assert row.input_difference is None or row.input_difference <= report.tolerance
  for before in report.layers[:names.index(report.origin)]:  # no earlier module qualifies
    assert before.difference <= report.tolerance or (
        before.input_difference is not None and before.input_difference > report.tolerance)
  assert 0 < row.share <= 1 and row.mean_difference <= row.difference
  assert row.difference < float(jnp.finfo(jnp.bfloat16).eps)  # one rounding apart
  assert report.layer("logits").difference > report.tolerance
  assert f"{report.origin}  " in str(report) and "<- the paths part here" in str(report)
  assert report.dtype == "bfloat16" and report.policy == BF16 and report.cache_size == 32
  decode, forward = report.excess_precision  # as XLA compiles the paths, against as written
  assert decode >= 0 and forward >= 0


def test_a_module_planted_to_round_in_the_decode_path_is_named(tunix, float32):
  """layers.1.attn.o_proj rounds its output to bfloat16 when called with one token (a decode
  step) and not in the full forward: under float32 it is where the paths part."""
  model = _qwen3(tunix)
  o_proj = model.layers[1].attn.o_proj
  base = type(o_proj)

  class DecodeRounds(base):
    def __call__(self, x):
      out = base.__call__(self, x)
      return out.astype(jnp.bfloat16).astype(out.dtype) if x.shape[1] == 1 else out

  o_proj.__class__ = DecodeRounds
  report = jmp_tunix.mismatch_origin(model, float32.prompts, float32.tokens, F32, pad_id=PAD)
  assert report.origin == "layers.1.attn.o_proj", str(report)
  assert report.layer("layers.1.attn").difference > report.tolerance
  assert report.layer("layers.0").difference <= report.tolerance
  assert report.layer("layers.1.attn.o_proj").input_difference <= report.tolerance


def test_a_model_without_init_cache_and_a_float32_head_rule(tunix, float32):
  """tunix's Llama3 has no init_cache (the sampler's own cache layout then) and names its
  head's scope: autocast's scoped rule keeps that matmul in float32, in both paths."""
  config = tunix.llama3.ModelConfig(**SIZES,
                                    shd_config=tunix.llama3.ShardingConfig.get_default_sharding())
  model = tunix.llama3.Llama3(config, rngs=nnx.Rngs(params=0))
  assert not hasattr(model, "init_cache")
  head = {("dot_general", r"(^|/)einsum/BTD,DV->BTV$"): "float32"}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = jmp_tunix.mismatch_origin(model, float32.prompts, float32.tokens,
                                       "p=f32,c=f16,o=f32", pad_id=PAD, rules=head)
  assert not [w for w in caught if "matched no" in str(w.message)]  # the rule found the head
  assert [r.name for r in report.layers][-2:] == ["lm_head", "logits"]
  assert report.positions == float32.report.positions
