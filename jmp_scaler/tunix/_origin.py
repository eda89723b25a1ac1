"""Where the sampler and the trainer part: tunix's decode path against its full forward, module
by module.

The sampler computes a token's log-probability through a prefill and one KV-cache decode step
per token; the trainer through one forward pass over the whole sequence. Same weights, same
policy: where the two programs round differently, their hidden states part, and
:func:`mismatch_origin` names the first module where they do, as
:func:`jmp_scaler.compare_precision` names a layer (an NNX attribute path, ``layers.0.attn``).

The model is called as tunix's ``Sampler`` and ``compute_per_token_logps`` call it, with
tunix's own masks and positions. A copy of the model whose modules record their inputs and
outputs while a path is traced gives the hidden states. Those programs are compiled without
XLA's excess precision (``xla_allow_excess_precision``, on by default: XLA may skip a rounding
to bfloat16 or float16 that the program asks for, and which ones it skips changes once hidden
states are outputs), so that what is compared is the programs as written; the paths are also
run as XLA compiles them by default, unrecorded, for the log-probabilities the sampler and the
trainer see.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_scaler.diagnostics._compare import fmt_error, wrap_line
from jmp_scaler.diagnostics._parity import LogprobParity, logprob_parity
from jmp_scaler.precision._autocast import autocast
from jmp_scaler.tunix._args import policy_arg
from jmp_scaler.tunix._lazy import tunix_module

#: The default ``tolerance``: 64 float32 epsilons (7.6e-6). Where both paths round alike,
#: their hidden states differ only by the order of float32 sums (at most 6 epsilons on tunix's
#: tiny Qwen3 in float32); one value rounded differently to float16 in a hidden state of 4096
#: features is above it.
TOLERANCE = 64 * float(np.finfo(np.float32).eps)
#: The row of the model's own output (the module at the root of the attribute paths).
LOGITS = "logits"
#: The compile options of the recorded programs: every rounding the program asks for is made.
AS_WRITTEN: dict[str, str | bool] = {"xla_allow_excess_precision": False}

_TAPE: contextvars.ContextVar[_Tape | None] = contextvars.ContextVar("jmp_tape", default=None)
_RECORDING: dict[tuple[type, str], type] = {}


# ---------------------------------------------------------------- the report


@dataclasses.dataclass(frozen=True)
class LayerMismatch:
  """One module's row of a :class:`MismatchOrigin`.

  A difference is relative, per token position: ``|decode - forward| / |forward|`` (L2
  norms over the position's features), at the positions both paths compute (the prompt's
  tokens and the completion's up to its first pad), in the programs as written.

  Attributes:
    name: the module's NNX attribute path (``layers.0.attn``); ``"logits"`` for the model
      itself (its output).
    difference: the largest difference of the module's output at one position.
    mean_difference: its mean over the positions.
    share: the share of positions where the output differs by more than the report's
      ``tolerance``.
    input_difference: the largest difference of the module's input (its first floating
      argument with a value per position); None for a module without one (the model, whose
      inputs are tokens).
  """

  name: str
  difference: float
  mean_difference: float
  share: float
  input_difference: float | None


@dataclasses.dataclass(frozen=True, eq=False)
class MismatchOrigin:
  """What :func:`mismatch_origin` measured (``print`` it for the table).

  Attributes:
    layers: one :class:`LayerMismatch` per module, in the order their calls return (a
      submodule before the module that calls it), the model's logits last.
    origin: the first of them whose output differs by more than ``tolerance`` while its
      input does not: where the two paths part, as written. None if the logits agree within
      the tolerance.
    policy: the policy's string.
    dtype: the policy's compute dtype, the unit of the table's last column.
    tolerance: the largest relative difference counted as agreement.
    positions: the token positions compared.
    cache_size: the KV cache's positions in the decode path.
    parity: :func:`jmp_scaler.logprob_parity` of the completion tokens' log-probabilities,
      the decode path's as the sampler's and the full forward's as the trainer's, as XLA
      compiles the two paths by default: what the sampler and the trainer see.
    parity_as_written: the same, the programs compiled without XLA's excess precision (the
      programs the table compares).
    excess_precision: how far XLA's default compilation moves each path's log-probabilities
      from the programs as written, mean ``|dlogp|``: ``(decode path, full forward)``.
    decode_logprobs, forward_logprobs: the completion tokens' log-probabilities as XLA
      compiles the paths by default, ``[batch, completion]`` float32 (temperature 1), 0
      where ``mask`` is False.
    mask: the completion tokens counted: each completion up to its first pad.
  """

  layers: tuple[LayerMismatch, ...]
  origin: str | None
  policy: str
  dtype: str
  tolerance: float
  positions: int
  cache_size: int
  parity: LogprobParity
  parity_as_written: LogprobParity
  excess_precision: tuple[float, float]
  decode_logprobs: np.ndarray
  forward_logprobs: np.ndarray
  mask: np.ndarray

  def layer(self, name: str) -> LayerMismatch:
    """The row of module ``name``; raises KeyError naming the modules if there is none."""
    for row in self.layers:
      if row.name == name:
        return row
    raise KeyError(f"no module {name!r}; the modules are {[r.name for r in self.layers]}")

  def __str__(self) -> str:
    eps = float(jnp.finfo(self.dtype).eps)
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(self.dtype, self.dtype)
    lines = [wrap_line(
      f"mismatch_origin: {self.policy}; the decode path (a prefill, then one step per token "
      f"through a KV cache of {self.cache_size}) against the full forward, as written, at "
      f"{self.positions} token positions: the largest relative difference at one position")]
    width = max([len("module"), *(len(r.name) for r in self.layers)])
    lines.append(f"  {'module':<{width}}  {'input':>9}  {'output':>9}  {'positions':>9}  "
                 f"{'eps(' + short + ')':>9}")
    for r in self.layers:
      mark = "  <- the paths part here" if r.name == self.origin else ""
      share = f"{100 * r.share:.1f}%"
      lines.append(f"  {r.name:<{width}}  {fmt_error(r.input_difference):>9}  "
                   f"{fmt_error(r.difference):>9}  {share:>9}  {r.difference / eps:>9.3g}{mark}")
    if self.origin is None:
      lines.append(wrap_line(f"origin: none, the logits agree within the tolerance "
                         f"{self.tolerance:.2g} at every position"))
    else:
      row = self.layer(self.origin)
      agrees = "" if row.input_difference is None else "its input agrees, "
      lines.append(wrap_line(
        f"origin: {row.name}: {agrees}its output differs by up to {row.difference:.2g} "
        f"({row.difference / eps:.2g} of {self.dtype}'s epsilon) at {100 * row.share:.1f}% "
        f"of the positions (tolerance {self.tolerance:.2g}); the 'positions' column counts "
        "the positions beyond it"))
    lines.append(f"log-probabilities of the {int(self.parity.tokens)} completion tokens, decode "
                 "path against full forward:")
    for what, report in (("as XLA compiles them", self.parity),
                         ("as written", self.parity_as_written)):
      d = report.to_dict("")
      lines.append(f"  {what:<21} |dlogp| mean {d['mean_abs_dlogp']:.2e}, max "
                   f"{d['max_abs_dlogp']:.2e}; ratio outside +-1% {100 * d['outside_1%']:.2f}%")
    decode, forward = self.excess_precision
    lines.append(wrap_line(
      f"XLA's excess precision moves the decode path's log-probabilities by {decode:.2e} and "
      f"the full forward's by {forward:.2e} (mean |dlogp| against the programs as written)"))
    return "\n".join(lines)


# ---------------------------------------------------------------- recording modules


@dataclasses.dataclass
class _Tape:
  """What the modules called while one path is traced record: their outputs and inputs with
  a value per position (``[batch, positions, ...]``), by attribute path, in return order."""

  batch_positions: tuple[int, int]
  outputs: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
  inputs: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
  order: list[str] = dataclasses.field(default_factory=list)

  def per_position(self, tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree)
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
            and tuple(x.shape[:2]) == self.batch_positions]  # fmt: skip


def _recording_class(cls: type, path: str) -> type:
  """``cls`` whose calls record their input and output on the active tape (one class per
  path, as ``compare_precision`` gives each module a scope of its own)."""
  if (cls, path) not in _RECORDING:
    base_call = cls.__call__

    def __call__(self, *args, **kwargs):
      tape = _TAPE.get()
      if tape is None:
        return base_call(self, *args, **kwargs)
      given = tape.per_position((args, kwargs))
      out = base_call(self, *args, **kwargs)
      values = tape.per_position(out)
      if values:  # the last one: tunix's modules return (cache, hidden)
        tape.outputs[path] = values[-1]
        if given:
          tape.inputs[path] = given[0]
        if path not in tape.order:
          tape.order.append(path)
      return out

    _RECORDING[cls, path] = type(cls.__name__, (cls,), {"__call__": __call__,
                                                        "__module__": cls.__module__})
  return _RECORDING[cls, path]


def _recording(model: nnx.Module) -> nnx.Module:
  """A copy of ``model`` (the same arrays) whose modules record their calls; the model itself
  records its output as :data:`LOGITS`."""
  copy = nnx.merge(*nnx.split(model))
  for path, module in nnx.iter_modules(copy):
    if callable(module):
      name = ".".join(map(str, path)) if path else LOGITS
      module.__class__ = _recording_class(type(module), name)
  return copy


def _taped(batch_positions: tuple[int, int], fn: Callable[[], Any]) -> tuple[Any, _Tape]:
  tape = _Tape(batch_positions)
  token = _TAPE.set(tape)
  try:
    return fn(), tape
  finally:
    _TAPE.reset(token)


# ---------------------------------------------------------------- the public function


def mismatch_origin(model: Any, prompt_tokens: Any, completion_tokens: Any, policy: Any, *,
                    pad_id: int, cache_size: int | None = None, rules: Any = None,
                    tolerance: float = TOLERANCE) -> MismatchOrigin:  # fmt: skip
  """Where tunix's decode path and its full forward part, module by module, under ``policy``.

  The two programs of RL fine-tuning, on the same tokens: the sampler's (a prefill of the
  prompts into a KV cache, then one decode step per completion token, fed the given tokens)
  and the trainer's (one forward pass over prompt and completion, as tunix's
  ``compute_per_token_logps`` runs it), both under ``jmp_scaler.autocast(..., policy)`` from
  the same weights, with tunix's own masks and positions. Every module's output is compared
  at the token positions both compute; the first module whose output differs by more than
  ``tolerance`` while its input does not is where the mismatch enters::

    report = jmp_tunix.mismatch_origin(model, rollout.left_padded_prompt_tokens,
                                       completions, "p=f32,c=bf16,o=f32", pad_id=0)
    print(report)          # the table; report.origin: "layers.0.attn"

  A module is named by its NNX attribute path, as :func:`jmp_scaler.compare_precision`
  names a layer. The operations of a module outside its submodules are the module's own: an
  origin at ``layers.0.attn`` whose submodules all agree on their inputs is the attention's
  scores, softmax and weighted sum (over the KV cache in one path, the sequence in the
  other).

  The hidden states are compared in the programs as written: compiled without XLA's excess
  precision (``xla_allow_excess_precision``, on by default), which lets XLA skip roundings to
  the compute dtype that the program asks for, and skip different ones once hidden states are
  outputs. The two paths also run unrecorded as XLA compiles them by default, for the
  log-probabilities the sampler and the trainer see (``parity``, at temperature 1);
  ``excess_precision`` says how far that moves each path. The decode steps run in a
  ``lax.scan`` (tunix's sampler: a ``while_loop`` that also samples), with the model called as
  tunix's ``_prefill_fn`` and ``_sample_step`` call it.

  The default tolerance is float32's rounding, not the compute dtype's: where both paths
  round a value to the compute dtype alike they agree to float32's epsilon, and where they
  part they differ by one rounding of the compute dtype, a fraction of its epsilon at the
  first module, the difference the mismatch grows from.

  Args:
    model: a model of tunix's zoo (an NNX module called as ``model(tokens, positions,
      cache, attention_mask)``, returning ``(logits, cache)``), with float32 parameters.
    prompt_tokens: the prompts, left-padded with ``pad_id``, ``[batch, prompt]`` integers
      (a rollout's ``left_padded_prompt_tokens``).
    completion_tokens: the completions, ``[batch, completion]`` integers; each is compared
      up to its first ``pad_id`` (tunix's trainer treats a pad as padding, its sampler not).
    policy: a :class:`jmp_scaler.Policy` or a policy string (``"p=f32,c=bf16,o=f32"``).
    pad_id: the tokenizer's pad id.
    cache_size: the KV cache's positions (the rollout's ``kv_cache_size``); default
      ``prompt + completion``, the least tunix's sampler takes.
    rules: autocast's ``rules``, for both paths (``{("dot_general", pattern): "float32"}``
      keeps the matmuls of the modules whose scope matches ``pattern`` in float32).
    tolerance: the largest relative difference counted as agreement.

  Returns:
    A :class:`MismatchOrigin`: ``print`` it for the table; ``.origin`` names the module,
    ``.layers`` has the numbers, ``.parity`` the log-probabilities' mismatch.

  Raises:
    ValueError: naming the argument: a model that is not an NNX module (or has neither an
      ``init_cache`` nor a config giving the cache's layout), tokens that are not
      ``[batch, length]`` integers with one batch and at least one token each, a
      ``cache_size`` below ``prompt + completion``, a policy that does not parse, a
      tolerance that is not a positive number.
    ImportError: if google-tunix is not installed.
  """
  policy = policy_arg("mismatch_origin", policy)
  if not isinstance(model, nnx.Module):
    raise ValueError(f"jmp_tunix.mismatch_origin: model must be a flax NNX module of tunix's "
                     f"zoo, got {type(model).__name__}")
  prompt = _tokens("prompt_tokens", prompt_tokens)
  completion = _tokens("completion_tokens", completion_tokens)
  (batch, n_prompt), (batch_c, n_completion) = prompt.shape, completion.shape
  if batch != batch_c or 0 in (batch, n_prompt, n_completion):
    raise ValueError(
        f"jmp_tunix.mismatch_origin: prompt_tokens {list(prompt.shape)} and completion_tokens "
        f"{list(completion.shape)} must have one batch and at least one token each")
  length = n_prompt + n_completion
  cache_size = length if cache_size is None else cache_size
  if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < length:
    raise ValueError(f"jmp_tunix.mismatch_origin: cache_size={cache_size!r} must be an int of "
                     f"at least prompt + completion = {length}")
  if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (
      0 < tolerance < math.inf):
    raise ValueError(f"jmp_tunix.mismatch_origin: tolerance={tolerance!r} must be a positive "
                     "number")
  common = tunix_module("rl.common")
  gen_utils = tunix_module("generate.utils")
  graphdef, state = nnx.split(_recording(model))
  segments = _accepts_segment_ids(model)
  order: list[str] = []

  def forward(record: bool) -> Callable:  # compute_per_token_logps's call of the model
    def fn(state, prompt, completion):
      tokens, positions, mask, segment_ids = common.process_ids(prompt, completion, pad_id,
                                                                pad_id)
      kwargs = {"segment_ids": segment_ids} if segments else {}
      module = nnx.merge(graphdef, state)
      (logits, _), tape = _run(record, (batch, length), lambda: module(
          tokens, positions=positions, cache=None, attention_mask=mask, **kwargs))
      if record:
        order[:] = tape.order  # the trace's return order: static, read on the host
      logp = common.selective_log_softmax(logits[:, -n_completion - 1:-1], completion)
      return logp, tape.outputs, tape.inputs

    return fn

  def prefill(record: bool) -> Callable:  # the sampler's _prefill_fn's call
    def fn(state, cache, prompt, positions, first):
      mask = gen_utils.make_causal_attn_mask(prompt != pad_id, cache_size)
      module = nnx.merge(graphdef, state)
      (logits, cache), tape = _run(record, (batch, n_prompt), lambda: module(
          prompt, positions, cache, mask))
      return _next_logprob(logits, first), cache, tape.outputs, tape.inputs

    return fn

  def decode(record: bool) -> Callable:  # the sampler's _sample_step, fed the tokens
    def fn(state, cache, buffer, positions):
      def step(cache, t):
        token = jax.lax.dynamic_slice_in_dim(buffer, t, 1, axis=1)
        position = jax.lax.dynamic_slice_in_dim(positions, t, 1, axis=1)
        mask = gen_utils.compute_attention_masks(t, cache_size, buffer == pad_id)
        module = nnx.merge(graphdef, state)
        (logits, cache), tape = _run(record, (batch, 1), lambda: module(
            token, positions=position, cache=cache, attention_mask=mask))
        following = jax.lax.dynamic_slice_in_dim(buffer, jnp.minimum(t + 1, length - 1), 1,
                                                 axis=1)[:, 0]
        return cache, (_next_logprob(logits, following), tape.outputs, tape.inputs)

      _, (logp, outputs, inputs) = jax.lax.scan(step, cache, jnp.arange(n_prompt, length))
      steps = lambda x: jnp.moveaxis(x, 0, 1)[:, :, 0]  # [steps, batch, 1, ...]
      return jnp.moveaxis(logp, 0, 1), jax.tree.map(steps, outputs), jax.tree.map(steps, inputs)

    return fn

  def compiled(fn: Callable, args: tuple, as_written: bool) -> Any:
    jitted = jax.jit(autocast(fn, policy, rules=rules))
    if as_written:
      return jitted.lower(*args).compile(compiler_options=AS_WRITTEN)(*args)
    return jitted(*args)

  buffer = jnp.concatenate([prompt, completion], axis=1)
  positions = _sampler_positions(prompt != pad_id, n_completion)

  def paths(record: bool) -> tuple[jax.Array, jax.Array, tuple]:
    """The full forward's and the decode path's log-probabilities of the completion tokens,
    and (recorded, as written) the hidden states of both."""
    f_logp, f_out, f_in = compiled(forward(record), (state, prompt, completion), record)
    cache = _init_cache(model, batch, cache_size)
    p_logp, cache, p_out, p_in = compiled(
        prefill(record), (state, cache, prompt, positions[:, :n_prompt], completion[:, 0]),
        record)
    d_logp, d_out, d_in = compiled(decode(record), (state, cache, buffer, positions), record)
    decode_logp = jnp.concatenate([p_logp[:, None], d_logp[:, :-1]], axis=1)
    return f_logp, decode_logp, (f_out, f_in, p_out, p_in, d_out, d_in)

  f_written, d_written, (f_out, f_in, p_out, p_in, d_out, d_in) = paths(record=True)
  f_default, d_default, _ = paths(record=False)

  valid_completion = np.cumprod(np.asarray(completion) != pad_id, axis=1).astype(bool)
  valid = np.concatenate([np.asarray(prompt) != pad_id, valid_completion], axis=1)
  rows = []
  for name in order:
    if name not in p_out or name not in d_out:  # no value per position in the decode path
      continue
    out = _differences(f_out[name], p_out[name], d_out[name], valid)
    given = (None if not (name in f_in and name in p_in and name in d_in) else
             float(np.max(_differences(f_in[name], p_in[name], d_in[name], valid))))
    rows.append(LayerMismatch(name, float(np.max(out)), float(np.mean(out)),
                              float(np.mean(out > tolerance)), given))
  origin = next((r.name for r in rows if r.difference > tolerance and (
      r.input_difference is None or r.input_difference <= tolerance)), None)
  if not rows or rows[-1].difference <= tolerance:
    origin = None

  def host(logp: jax.Array) -> np.ndarray:
    return np.where(valid_completion, np.asarray(logp, np.float32), 0.0).astype(np.float32)

  forward_w, decode_w = host(f_written), host(d_written)  # as written
  forward_d, decode_d = host(f_default), host(d_default)  # as XLA compiles them

  def moved(default: np.ndarray, written: np.ndarray) -> float:
    if not valid_completion.any():
      return 0.0
    return float(np.abs(default - written)[valid_completion].mean())

  return MismatchOrigin(
      layers=tuple(rows), origin=origin, policy=str(policy),
      dtype=str(np.dtype(policy.compute_dtype)), tolerance=float(tolerance),
      positions=int(valid.sum()), cache_size=cache_size,
      parity=logprob_parity(decode_d, forward_d, valid_completion),
      parity_as_written=logprob_parity(decode_w, forward_w, valid_completion),
      excess_precision=(moved(decode_d, decode_w), moved(forward_d, forward_w)),
      decode_logprobs=decode_d, forward_logprobs=forward_d, mask=valid_completion)


def _run(record: bool, batch_positions: tuple[int, int], fn: Callable[[], Any]
         ) -> tuple[Any, _Tape]:  # fmt: skip
  """``fn()`` and the tape its modules recorded (an empty one unless ``record``)."""
  if record:
    return _taped(batch_positions, fn)
  return fn(), _Tape(batch_positions)


def _next_logprob(logits: jax.Array, token: jax.Array) -> jax.Array:
  """The sampler's log-probability of ``token`` from the last position's logits (its
  ``sample_top_p`` at temperature 1: a float32 log-softmax)."""
  logp = jax.nn.log_softmax(logits[:, -1].astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _sampler_positions(prompt_mask: jax.Array, n_completion: int) -> jax.Array:
  """The sampler's positions (``init_sample_state``): the prompt's real tokens counted, every
  completion position a token."""
  mask = jnp.concatenate([prompt_mask, jnp.ones((prompt_mask.shape[0], n_completion), bool)],
                         axis=1)
  return tunix_module("sft.utils").build_positions_from_mask(mask)


def _tokens(name: str, x: Any) -> jax.Array:
  a = jnp.asarray(x)
  if a.ndim != 2 or not jnp.issubdtype(a.dtype, jnp.integer):
    raise ValueError(f"jmp_tunix.mismatch_origin: {name} must be [batch, length] integers, "
                     f"got {a.dtype}{list(a.shape)}")
  return a.astype(jnp.int32)


def _accepts_segment_ids(model: nnx.Module) -> bool:
  """Whether tunix's trainer hands the model ``segment_ids`` (it does when the model's
  ``__call__`` takes them)."""
  try:
    params = inspect.signature(type(model).__call__).parameters
  except (TypeError, ValueError):
    return False
  return "segment_ids" in params or any(
      p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def _init_cache(model: Any, batch: int, size: int) -> Any:
  """The KV cache tunix's sampler makes: the model's ``init_cache``, else tunix's layout, in
  the sampler's dtype (the config's, else the first parameter's)."""
  config: Any = getattr(model, "config", None)
  dtype = getattr(config, "dtype", None)
  if dtype is None:
    dtype = jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype
  if hasattr(model, "init_cache"):
    return model.init_cache(batch, size, dtype)
  if not all(hasattr(config, k) for k in ("num_layers", "num_kv_heads", "head_dim")):
    raise ValueError(
        f"jmp_tunix.mismatch_origin: model {type(model).__name__} has no init_cache and no "
        "config with num_layers, num_kv_heads and head_dim: not a model of tunix's zoo")
  shape = (batch, size, config.num_kv_heads, config.head_dim)
  return {f"layer_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                         "end_index": jnp.zeros((batch,), jnp.int32)}
          for i in range(config.num_layers)}  # fmt: skip


def _differences(forward: Any, prefill: Any, decode: Any, valid: np.ndarray) -> np.ndarray:
  """The relative difference at each valid position, the decode path (prefill then decode
  steps, along the positions) against the full forward; an empty selection gives [0]."""
  full = np.asarray(forward, np.float64)
  path = np.concatenate([np.asarray(prefill, np.float64), np.asarray(decode, np.float64)],
                        axis=1)
  full, path = full.reshape(*full.shape[:2], -1), path.reshape(*path.shape[:2], -1)
  with np.errstate(invalid="ignore", over="ignore"):
    num = np.linalg.norm(path - full, axis=-1)
    den = np.linalg.norm(full, axis=-1)
    rel = np.where(den > 0, num / np.where(den > 0, den, 1.0), num)
  rel = np.where(np.isfinite(rel), rel, np.inf)[valid]
  return rel if rel.size else np.zeros(1)

