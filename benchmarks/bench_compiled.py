"""What the compilers users run make of a train step: XLA:TPU and XLA:GPU, without the hardware.

Every figure here comes from a real TPU or GPU compiler running on this host: libtpu (the
``jax[tpu]`` extra) describes a TPU slice, jax's CUDA plugin (``jax[cuda12]``) an NVIDIA GPU
from a target description (``benchmarks/targets/*.txtpb``, XLA's own specs), and
``jax.jit(step, in_shardings=..., out_shardings=..., donate_argnums=0).lower(<abstract
arguments placed on that device>).compile()`` gives the optimized HLO, ``memory_analysis()``
and (TPU) ``cost_analysis()``. Nothing runs, so nothing needs the accelerator; MaxText's
``train_compile.py`` uses the same path for its users' TPU jobs.

Targets (``--targets``): ``v5e``, ``v6e``, ``v5p`` (one chip each), ``v5e4`` (a 2x2 v5e slice:
the FSDP step, per-chip figures), ``h100``, ``b200``. A target whose compiler is not installed
is skipped with the reason.

Models (``--models``): those of bench_memory.py (benchmarks/_memory_models.py) as language
models trained on next-token cross-entropy (an embedding, the blocks, a final norm and an
output projection; ResNet on images): ``gpt``, ``gpt_scan`` (``nn.scan``), ``gpt_remat``
(``dots_saveable``), ``llama``, ``llama_scan``, ``lm1b``, ``gemma`` (NNX), ``resnet``
(BatchNorm), and ``gpt136m``, a 136M-parameter GPT (12 layers, d=768, 12 heads, seq 1024,
batch 8, vocab 32768, untied head). The other transformers: 4 layers, d=512, 8 heads, seq
1024, batch 8, vocab 8192; ResNet: widths 64/128/256, batch 128, 32x32.

Variants (``--variants``), every one a full train step (float32 master parameters, Adam, the
state donated):

  float32    the model as written, no dtype anywhere
  hand       ``dtype=<half>`` on every layer (Flax's hand annotation)
  autocast   ``jmp_scaler.autocast(model.apply, "p=f32,c=<half>,o=f32")`` of the float32 model
  module     ``jmp_scaler.autocast_linen`` around the float32 model (``autocast_nnx``: Gemma)

and the same with ``+scale``: ``optax.chain(jmp_scaler.dynamic_scale(), optax.adam)``,
``jmp_scaler.TrainState``, ``jmp_scaler.value_and_grad``. Without it: flax's ``TrainState``,
``optax.adam``, ``jax.value_and_grad``.

Each compile prints one line as it finishes: temp and peak MiB (``memory_analysis()``), bytes
accessed (TPU's cost model), the dots and convolutions by operand and result dtypes, the
conditionals, collectives and custom calls of the optimized HLO, and the compile seconds.
The tables at the end give temp MiB per target, model and variant, with the ratios autocast /
hand and autocast / float32 (and module / hand).

  python benchmarks/bench_compiled.py                # everything: about 3 hours on 2 CPU cores
  python benchmarks/bench_compiled.py --targets v5e,h100 --models gpt --variants hand,autocast
  python benchmarks/bench_compiled.py --quick        # tiny sizes, seconds per compile
  python benchmarks/bench_compiled.py --models gpt --variants autocast --rules softmax=primitives
  python benchmarks/bench_compiled.py --targets v5e4 --models gpt   # FSDP over a 2x2 v5e slice
  python benchmarks/bench_compiled.py --set layers=1 # any size overridden, for every model
  python benchmarks/bench_compiled.py --lowbit --targets h100,b200  # fp8, MXFP8, NVFP4 GEMMs

``--lowbit`` compiles a dense layer's forward and backward (256x1024 @ 1024x1024, float32
master weights) under ``rules={"dot_general": "fp8"}`` for the H100 and ``"mxfp8"`` and
``"nvfp4"`` for the B200, and prints the GEMMs' operand dtypes (inside XLA's GEMM fusions
too) and cuDNN's block-scaled GEMMs (``__cudnn$blockScaledDot``); docs/fp8.md says what they
show. The B200's target description says cuDNN 9.10: below it XLA:GPU dequantises a
block-scaled dot into a float32 GEMM (benchmarks/targets/b200.txtpb).

Installs (beside this package): ``pip install "jax[tpu,cuda12-local]==<your jax>"``: libtpu
(jax 0.10.2 pins 0.0.42, jax 0.12.0.1 0.0.50) and jax's CUDA plugin without the CUDA wheels,
which a compile without a GPU does not need (about 0.7 GB and 0.1 GB; ``jax[cuda12]`` brings 4
GB more of CUDA libraries and gives the same programs). ``JAX_PLATFORMS=cpu`` is set here, so
the CUDA plugin needs no GPU. ``XLA_FLAGS=--xla_dump_to=DIR`` writes XLA's buffer assignment
and memory-usage report of each compile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import warnings
from collections import Counter
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # beside another libtpu process
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no GCE metadata server to ask here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _memory_models as M  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_scaler  # noqa: E402

MIB = 2.0**20
HERE = os.path.dirname(os.path.abspath(__file__))
BASE_VARIANTS = ("float32", "hand", "autocast", "module")
VARIANTS = (*BASE_VARIANTS, *(f"{v}+scale" for v in BASE_VARIANTS))
HALF = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}

# ------------------------------------------------------------------------------- targets

#: name -> (platform, topology name or target file, extra arguments, chips)
TARGETS: dict[str, tuple[str, str, dict, int]] = {
  "v5e": ("tpu", "v5e:1x1", {"chips_per_host_bounds": (1, 1, 1)}, 1),
  "v6e": ("tpu", "v6e:1x1", {"chips_per_host_bounds": (1, 1, 1)}, 1),
  "v5p": ("tpu", "v5:1x1x1", {"chips_per_host_bounds": (1, 1, 1),
                              "chip_config_name": "megacore"}, 1),
  "v5e4": ("tpu", "v5e:2x2", {"chips_per_host_bounds": (2, 2, 1)}, 4),
  "h100": ("cuda", "h100_sxm.txtpb", {}, 1),
  "b200": ("cuda", "b200.txtpb", {}, 1),
}
DEFAULT_TARGETS = ("v5e", "v6e", "v5p", "h100", "b200")

_DEVICES: dict[str, Any] = {}


def target_config(filename: str) -> str:
  """The text of a GpuTargetConfigProto (benchmarks/targets/)."""
  with open(os.path.join(HERE, "targets", filename)) as f:
    return f.read()


def devices(target: str) -> list:
  """The devices of ``target``, described by its compiler (cached); raises if unavailable."""
  if target not in _DEVICES:
    from jax.experimental import topologies

    platform, name, kw, chips = TARGETS[target]
    jax.devices()  # starts the backends, which registers the installed plugins (CUDA's)
    if platform == "tpu":
      topo = topologies.get_topology_desc(topology_name=name, platform="tpu", **kw)
    else:
      topo = topologies.get_topology_desc(topology_name="", platform="cuda",
                                          target_config=target_config(name), topology="1x1x1")
    found = list(topo.devices)
    if len(found) != chips:
      raise RuntimeError(f"{target}: {len(found)} devices, expected {chips}")
    _DEVICES[target] = found
  return _DEVICES[target]


def platform_of(target: str) -> str:
  return TARGETS[target][0]


# -------------------------------------------------------------------------------- models


class LM(nn.Module):
  """A language model around ``_memory_models.Stack``: token (and, for GPT, learned position)
  embeddings, the blocks, a final norm and an untied output projection, all with ``dtype``."""

  block: str
  vocab: int
  d: int
  heads: int
  layers: int
  scan: bool = False
  remat: bool = False
  dtype: Any = None

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d, dtype=self.dtype)(tokens)
    if self.block == "gpt":
      pos = nn.Embed(tokens.shape[1], self.d, dtype=self.dtype)(jnp.arange(tokens.shape[1]))
      x = x + pos[None]
    x = M.Stack(self.block, self.d, self.heads, self.layers, self.scan, self.remat,
                self.dtype)(x)  # fmt: skip
    norm = nn.RMSNorm if self.block == "llama" else nn.LayerNorm
    x = norm(dtype=self.dtype)(x)
    return nn.Dense(self.vocab, dtype=self.dtype)(x)


#: --set overrides of the sizes below (``layers=1,seq=512``), for every model
OVERRIDES: dict[str, int] = {}


def sizes(quick: bool) -> dict:
  found = _sizes(quick)
  found.update(OVERRIDES)
  found["big"].update(OVERRIDES)
  return found


def _sizes(quick: bool) -> dict:
  if quick:
    return dict(d=64, heads=2, layers=2, batch=2, seq=64, vocab=256, images=4, hw=16,
                widths=(8, 16, 32), big=dict(d=96, heads=2, layers=2, seq=64, batch=2,
                                             vocab=512))  # fmt: skip
  return dict(d=512, heads=8, layers=4, batch=8, seq=1024, vocab=8192, images=128, hw=32,
              widths=(64, 128, 256), big=dict(d=768, heads=12, layers=12, seq=1024, batch=8,
                                               vocab=32768))  # fmt: skip


MODELS = ("gpt", "gpt_scan", "gpt_remat", "llama", "llama_scan", "lm1b", "gemma", "resnet",
          "gpt136m")  # fmt: skip
DEFAULT_MODELS = ("gpt", "gpt_scan", "llama", "lm1b", "gemma", "resnet", "gpt136m")


class Case:
  """One model: ``make(dtype)`` builds it, ``init`` its abstract variables, ``batch`` the
  abstract inputs; ``forward(model, params, rest, batch, transform, context)`` gives
  ``(loss, new_rest)``."""

  def __init__(self, name: str, quick: bool, half: Any):
    s = sizes(quick)
    self.name, self.half, self.nnx = name, half, name == "gemma"
    i32 = jnp.int32
    if name == "resnet":
      self.batch = {"x": jax.ShapeDtypeStruct((s["images"], s["hw"], s["hw"], 3), jnp.float32),
                    "y": jax.ShapeDtypeStruct((s["images"],), i32)}
      self.make = lambda dt: M.ResNet(s["widths"], dtype=dt)
      return
    if name == "gpt136m":
      s = {**s, **s["big"]}
    self.batch = {"tokens": jax.ShapeDtypeStruct((s["batch"], s["seq"]), i32),
                  "labels": jax.ShapeDtypeStruct((s["batch"], s["seq"]), i32)}
    if name == "lm1b":
      self.make = lambda dt: M.LM1B(s["vocab"], s["d"], s["heads"], s["layers"], dtype=dt)
    elif name == "gemma":
      args = (s["vocab"], s["d"], s["heads"], max(1, s["heads"] // 2), s["layers"])
      self.make = lambda dt: M.Gemma(*args, rngs=nnx.Rngs(0), dtype=dt)
    else:
      block = "llama" if name.startswith("llama") else "gpt"
      kw = dict(scan=name.endswith("_scan"), remat=name.endswith("_remat"))
      self.make = lambda dt: LM(block, s["vocab"], s["d"], s["heads"], s["layers"], dtype=dt,
                                **kw)  # fmt: skip


def xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), labels).mean()


def build(case: Case, variant: str, policy: str, rules: dict | None):
  """(abstract state, step) of ``variant`` of ``case`` (state and step as a user writes
  them: ``TrainState`` and ``value_and_grad``; jmp_scaler's with ``+scale``)."""
  base, scaled = variant.split("+")[0], variant.endswith("+scale")
  tx = optax.adam(1e-4)
  if scaled:
    tx = optax.chain(jmp_scaler.dynamic_scale(), tx)
  State = ScaledState if scaled else PlainState
  context = (lambda: jmp_scaler.autocast_linen(policy)) if base == "module" else (
    contextlib.nullcontext)  # fmt: skip
  transform = (lambda f: jmp_scaler.autocast(f, policy, rules=rules)) if base == "autocast" \
    else (lambda f: f)  # fmt: skip
  dtype = case.half if base == "hand" else None

  if case.nnx:
    model = case.make(dtype)
    if base == "module":
      model = jmp_scaler.autocast_nnx(model, policy)
    graphdef, params = nnx.split(model)

    def loss_fn(p, rest, batch):
      fwd = transform(lambda p_, t: nnx.merge(graphdef, p_)(t))
      return xent(fwd(p, batch["tokens"]), batch["labels"]), rest
    rest = None
  else:
    model = case.make(dtype)
    plain = case.make(None)
    example = {k: jnp.zeros(v.shape, v.dtype) for k, v in case.batch.items()}
    first = example["x"] if case.name == "resnet" else example["tokens"]
    variables = jax.eval_shape(lambda: plain.init(jax.random.key(0), first))
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"} or None

    def loss_fn(p, rest, batch):
      with context():
        if case.name == "resnet":
          logits, new = transform(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))(
            {"params": p, **rest}, batch["x"])  # fmt: skip
          return xent(logits, batch["y"]), new
        logits = transform(model.apply)({"params": p}, batch["tokens"])
      return xent(logits, batch["labels"]), rest

  def create(p, r):
    return State.create(apply_fn=None, params=p, tx=tx, rest=r)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    state = jax.eval_shape(create, params, rest)

  def step(state, batch):
    fn = lambda p: loss_fn(p, state.rest, batch)  # noqa: E731
    if scaled:
      (loss, rest), grads = jmp_scaler.value_and_grad(fn, state, has_aux=True)(state.params)
    else:
      (loss, rest), grads = jax.value_and_grad(fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, rest=rest), loss

  return state, step


class PlainState(train_state.TrainState):
  rest: Any = None  # BatchNorm's statistics


class ScaledState(jmp_scaler.TrainState):
  rest: Any = None


# ------------------------------------------------------------------------------ sharding


def _fsdp_spec(x, n: int) -> P:
  """Shard a leaf's largest axis divisible by ``n`` over the mesh (FSDP); scalars replicated."""
  shape = getattr(x, "shape", ())
  axes = [i for i in np.argsort(shape)[::-1] if shape[i] % n == 0 and shape[i] >= n]
  if not axes:
    return P()
  spec = [None] * len(shape)
  spec[axes[0]] = "fsdp"
  return P(*spec)


def place(tree, devs: list, batch: bool = False):
  """``tree`` as ShapeDtypeStructs on ``devs``: one device, or FSDP over all of them."""
  if len(devs) == 1:
    sharding = SingleDeviceSharding(devs[0])
    to = lambda x: sharding  # noqa: E731
  else:
    mesh = Mesh(np.array(devs), ("fsdp",))
    n = len(devs)
    to = lambda x: NamedSharding(  # noqa: E731
      mesh, (P("fsdp") if x.shape[0] % n == 0 else P()) if batch else _fsdp_spec(x, n))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=to(x)), tree)


def compile_step(case: Case, variant: str, target: str, policy: str, rules: dict | None):
  """The compiled step of ``variant`` of ``case`` for ``target``, with its compile seconds."""
  devs = devices(target)
  state, step = build(case, variant, policy, rules)
  state_in, batch_in = place(state, devs), place(case.batch, devs, batch=True)
  shardings = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
  loss_sharding = (SingleDeviceSharding(devs[0]) if len(devs) == 1
                   else NamedSharding(Mesh(np.array(devs), ("fsdp",)), P()))  # fmt: skip
  jitted = jax.jit(step, in_shardings=(shardings(state_in), shardings(batch_in)),
                   out_shardings=(shardings(state_in), loss_sharding), donate_argnums=0)
  t0 = time.perf_counter()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    lowered = jitted.lower(state_in, batch_in)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, t1 - t0, time.perf_counter() - t1


# ------------------------------------------------------------------------------ analysis

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z0-9]+)\[")
_OP = re.compile(r"=\s*([a-z0-9]+)\[[^\]]*\](?:\{[^}]*\})?\s+([\w\-]+)\(([^)]*)\)")
_SHORT = {"bf16": "bf16", "f16": "f16", "f32": "f32", "f64": "f64", "f8e4m3fn": "e4m3",
          "f8e5m2": "e5m2", "f4e2m1fn": "e2m1", "f8e8m0fnu": "e8m0", "s8": "s8", "s32": "s32"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")  # fmt: skip


def analyse_hlo(text: str) -> dict:
  """From an optimized HLO module's text: the dots and convolutions as ``lhs,rhs->out``
  dtypes, and the counts of conditionals, collectives, custom calls (by target), whiles."""
  dtype_of: dict[str, str] = {}
  for line in text.splitlines():
    m = _DEF.match(line)
    if m:
      dtype_of[m.group(1)] = m.group(2)
  dots: Counter = Counter()
  ops: Counter = Counter()
  custom: Counter = Counter()
  for line in text.splitlines():
    m = _OP.search(line)
    if not m:
      if " conditional(" in line:
        ops["conditional"] += 1
      tuple_call = re.search(r"custom-call\(.*custom_call_target=\"([^\"]+)\"", line)
      if tuple_call:
        custom[tuple_call.group(1)] += 1
      for c in COLLECTIVES:
        if re.search(rf"\s{c}(-start)?\(", line):
          ops[c] += 1
      if " while(" in line:
        ops["while"] += 1
      continue
    out, op, operands = m.groups()
    if op in ("dot", "convolution"):
      names = re.findall(r"%([\w.\-]+)", operands) or [o.strip() for o in operands.split(",")]
      ins = [_SHORT.get(dtype_of.get(n, "?"), dtype_of.get(n, "?")) for n in names[:2]]
      dots[f"{op[:4]} {','.join(ins)}->{_SHORT.get(out, out)}"] += 1
    elif op == "conditional":
      ops["conditional"] += 1
    elif op == "custom-call":
      t = re.search(r'custom_call_target="([^"]+)"', line)
      custom[t.group(1) if t else "?"] += 1
    elif op == "while":
      ops["while"] += 1
    else:
      for c in COLLECTIVES:
        if op in (c, f"{c}-start"):
          ops[c] += 1
  return {"dots": dict(dots), "ops": dict(ops), "custom_calls": dict(custom)}


def measure(compiled, target: str) -> dict:
  mem = compiled.memory_analysis()
  found = {
    "temp": int(mem.temp_size_in_bytes),
    "peak": int(getattr(mem, "peak_memory_in_bytes", 0) or 0),
    "args": int(mem.argument_size_in_bytes),
    "out": int(mem.output_size_in_bytes),
    "alias": int(mem.alias_size_in_bytes),
  }
  if platform_of(target) == "tpu":
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    found["bytes_accessed"] = float(cost.get("bytes accessed", float("nan")))
    found["flops"] = float(cost.get("flops", float("nan")))
  found.update(analyse_hlo(compiled.as_text()))
  return found


def _counts(d: dict) -> str:
  return " ".join(f"{k}:{v}" for k, v in sorted(d.items())) or "-"


def print_line(r: dict) -> None:
  ba = f" acc {r['bytes_accessed'] / 1e9:7.2f}GB" if "bytes_accessed" in r else ""
  print(f"{r['target']:<5} {r['model']:<10} {r['variant']:<15} temp {r['temp'] / MIB:9.1f} "
        f"peak {r['peak'] / MIB:9.1f} MiB{ba} | dots {_counts(r['dots'])} | "
        f"{_counts(r['ops'])} | custom {_counts(r['custom_calls'])} | "
        f"lower {r['lower_s']:.1f}s compile {r['compile_s']:.1f}s", flush=True)


# -------------------------------------------------------------------------------- tables


def _fmt(x: float) -> str:
  return f"{x:.0f}" if x >= 1000 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _ratio(a, b) -> str:
  return f"{a / b:.2f}" if a and b else "-"


def print_tables(rows: list[dict], variants: list[str], key: str = "temp") -> None:
  unit = 1e9 if key == "bytes_accessed" else MIB
  label = "GB accessed" if key == "bytes_accessed" else f"{key} MiB"
  for target in dict.fromkeys(r["target"] for r in rows):
    mine = [r for r in rows if r["target"] == target and key in r]
    if not mine:
      continue
    cols = [v for v in variants if any(r["variant"] == v for r in mine)]
    ratios = []
    for sfx in ("", "+scale"):
      if {f"autocast{sfx}", f"hand{sfx}"} <= set(cols):
        ratios.append((f"ac/hand{sfx and '+s'}", f"autocast{sfx}", f"hand{sfx}"))
      if {f"autocast{sfx}", f"float32{sfx}"} <= set(cols):
        ratios.append((f"ac/f32{sfx and '+s'}", f"autocast{sfx}", f"float32{sfx}"))
      if {f"module{sfx}", f"hand{sfx}"} <= set(cols):
        ratios.append((f"mod/hand{sfx and '+s'}", f"module{sfx}", f"hand{sfx}"))
    print(f"\n## {target}: {label}")
    head = ["model", *cols, *(r[0] for r in ratios)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for model in dict.fromkeys(r["model"] for r in mine):
      got = {r["variant"]: r[key] for r in mine if r["model"] == model}
      cells = [_fmt(got[v] / unit) if v in got else "-" for v in cols]
      cells += [_ratio(got.get(a), got.get(b)) for _, a, b in ratios]
      print("| " + " | ".join([model, *cells]) + " |")


# ------------------------------------------------------------------------- low-bit GEMMs

#: (target, autocast rule) pairs of ``--lowbit``: each rule on the GPU it is for.
LOWBIT = (("h100", "fp8"), ("b200", "mxfp8"), ("b200", "nvfp4"))
BLOCK_SCALED = "__cudnn$blockScaledDot"  # cuDNN's block-scaled GEMM (XLA:GPU on Blackwell)


def compile_lowbit(target: str, rule: str, m: int = 256, k: int = 1024, n: int = 1024):
  """A dense layer's forward and backward (``x @ w + b``, float32 master weights and input,
  ``rules={"dot_general": rule}`` under a bfloat16 policy) compiled for ``target``, with the
  lowered text."""
  dense = jmp_scaler.autocast(lambda p, x: x @ p["w"] + p["b"], "p=f32,c=bf16,o=f32",
                              rules={"dot_general": rule})  # fmt: skip
  step = jax.value_and_grad(lambda p, x: jnp.mean(dense(p, x) ** 2), argnums=(0, 1))
  sharding = SingleDeviceSharding(devices(target)[0])
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)  # noqa: E731
  lowered = jax.jit(step).lower({"w": sds(k, n), "b": sds(n)}, sds(m, k))
  return lowered.compile(), lowered.as_text()


def lowbit_row(target: str, rule: str) -> dict:
  """What the compiled program's GEMMs are: the dots by operand dtypes (inside fusions too),
  cuDNN's block-scaled GEMMs, and the lowering's ``__op$block_scaled_dot`` calls."""
  compiled, lowered = compile_lowbit(target, rule)
  found = analyse_hlo(compiled.as_text())
  return {"target": target, "rule": rule, "dots": found["dots"],
          "block_scaled": found["custom_calls"].get(BLOCK_SCALED, 0),
          "lowered_block_scaled": lowered.count("__op$block_scaled_dot"),
          "custom_calls": found["custom_calls"]}  # fmt: skip


def print_lowbit(r: dict) -> None:
  print(f"{r['target']:<5} {r['rule']:<6} GEMMs {_counts(r['dots'])} | cuDNN block-scaled "
        f"{r['block_scaled']} (lowered: {r['lowered_block_scaled']} __op$block_scaled_dot) | "
        f"custom {_counts(r['custom_calls'])}", flush=True)


# ---------------------------------------------------------------------------------- main


def parse_rules(text: str | None) -> dict | None:
  """``softmax=primitives,dot_general=fp8`` -> a rules dict for autocast."""
  if not text:
    return None
  return dict(part.split("=", 1) for part in text.split(","))


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  split = lambda s: s.split(",")  # noqa: E731
  p.add_argument("--targets", type=split, default=list(DEFAULT_TARGETS),
                 help=f"of {', '.join(TARGETS)} (default {','.join(DEFAULT_TARGETS)})")
  p.add_argument("--models", type=split, default=list(DEFAULT_MODELS),
                 help=f"of {', '.join(MODELS)} (default {','.join(DEFAULT_MODELS)})")
  p.add_argument("--variants", type=split, default=list(VARIANTS),
                 help=f"of {', '.join(VARIANTS)}")
  p.add_argument("--dtype", default="bfloat16", choices=sorted(HALF))
  p.add_argument("--rules", default=None, help="autocast's rules, e.g. softmax=primitives")
  p.add_argument("--quick", action="store_true", help="tiny sizes")
  p.add_argument("--set", default=None,
                 help="size overrides for every model, e.g. layers=1,seq=512 (d, heads, layers, "
                      "batch, seq, vocab, images, hw)")
  p.add_argument("--json", default=None, help="also write the rows to this file")
  p.add_argument("--lowbit", action="store_true",
                 help="only the low-bit rules' GEMMs: fp8 on h100, mxfp8 and nvfp4 on b200")
  args = p.parse_args(argv)
  for name, given, known in (("targets", args.targets, TARGETS), ("models", args.models, MODELS),
                             ("variants", args.variants, VARIANTS)):  # fmt: skip
    bad = [x for x in given if x not in known]
    if bad:
      p.error(f"--{name}: unknown {bad}; known: {', '.join(known)}")
  policy = f"p=f32,c={'bf16' if args.dtype == 'bfloat16' else 'f16'},o=f32"
  rules = parse_rules(args.rules)
  OVERRIDES.update({k: int(v) for k, v in (parse_rules(args.set) or {}).items()})
  print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}; policy {policy}; rules {rules}; "
        f"sizes {'quick' if args.quick else 'full'} {OVERRIDES or ''}")
  targets = []
  for t in args.targets:
    try:
      devs = devices(t)
      targets.append(t)
      print(f"target {t}: {len(devs)} x {devs[0].device_kind}", flush=True)
    except Exception as e:  # noqa: BLE001 - the compiler is not installed, or refused it
      print(f"target {t}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
  rows: list[dict] = []
  if args.lowbit:
    for target, rule in LOWBIT:
      if target in targets:
        rows.append(lowbit_row(target, rule))
        print_lowbit(rows[-1])
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    return rows
  for model in args.models:
    case = Case(model, args.quick, HALF[args.dtype])
    for t in targets:
      for variant in args.variants:
        try:
          compiled, lower_s, compile_s = compile_step(case, variant, t, policy, rules)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
          print(f"{t:<5} {model:<10} {variant:<15} FAILED {type(e).__name__}: "
                f"{str(e).splitlines()[0][:300]}", flush=True)
          continue
        r = {"target": t, "model": model, "variant": variant, "lower_s": lower_s,
             "compile_s": compile_s, **measure(compiled, t)}  # fmt: skip
        del compiled
        rows.append(r)
        print_line(r)
        if args.json:
          with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
  print_tables(rows, args.variants)
  if any("bytes_accessed" in r for r in rows):
    print_tables(rows, args.variants, key="bytes_accessed")
  return rows


if __name__ == "__main__":
  main()
