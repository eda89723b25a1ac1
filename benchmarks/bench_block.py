"""Block-scaled matmuls' error against float32, per GEMM (fprop, dgrad, wgrad), per recipe.

One ``jax.vjp`` of each op (``fp8_dot_general``, ``block_scaled_dot_general`` with each
recipe) on ``x [m, k] @ w [k, n]`` with an output gradient ``g [m, n]``; the relative
Frobenius error of ``y``, ``dx`` and ``dw`` against the float64 products. The figures of
docs/fp8.md ("Block scaling", measured):

  python benchmarks/bench_block.py                  # standard normal, 256x512 @ 512x256
  python benchmarks/bench_block.py --student-t 2    # heavy tails (outliers)
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
try:
  import jmp_scaler
except ImportError:  # run from a checkout that is not installed
  sys.path.insert(1, os.path.dirname(_HERE))
  import jmp_scaler

DN = (((1,), (0,)), ((), ()))


def recipes():
  nv = jmp_scaler.Nvfp4Recipe
  return {
      "fp8 (per tensor)": (jmp_scaler.fp8_dot_general, jmp_scaler.Fp8Recipe()),
      "mxfp8 rceil": (jmp_scaler.block_scaled_dot_general, jmp_scaler.MxFp8Recipe()),
      "mxfp8 floor": (jmp_scaler.block_scaled_dot_general, jmp_scaler.MxFp8Recipe("floor")),
      "nvfp4": (jmp_scaler.block_scaled_dot_general, nv()),
      "nvfp4 -rht": (jmp_scaler.block_scaled_dot_general, nv(random_hadamard=False)),
      "nvfp4 -sr": (jmp_scaler.block_scaled_dot_general, nv(stochastic_rounding=False)),
      "nvfp4 -rht -sr": (jmp_scaler.block_scaled_dot_general,
                         nv(random_hadamard=False, stochastic_rounding=False)),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--m", type=int, default=256)
  parser.add_argument("--k", type=int, default=512)
  parser.add_argument("--n", type=int, default=256)
  parser.add_argument("--student-t", type=float, default=None, help="degrees of freedom")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  rng = np.random.default_rng(args.seed)
  draw = ((lambda s: rng.standard_t(args.student_t, s)) if args.student_t
          else rng.standard_normal)
  x = draw((args.m, args.k)).astype(np.float32)
  w = (draw((args.k, args.n)) / 16).astype(np.float32)
  g = draw((args.m, args.n)).astype(np.float32)
  x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
  refs = (x64 @ w64, g64 @ w64.T, x64.T @ g64)
  rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
  print(f"x [{args.m}, {args.k}] @ w [{args.k}, {args.n}], "
        f"{'student-t ' + str(args.student_t) if args.student_t else 'normal'}, seed "
        f"{args.seed}, jax {jax.__version__} ({jax.default_backend()})")
  print(f"{'recipe':20}{'fprop':>9}{'dgrad':>9}{'wgrad':>9}")
  for name, (op, recipe) in recipes().items():
    f = lambda a, b, op=op, recipe=recipe: op(a, b, DN, recipe=recipe)
    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    errs = [rel(a, r) for a, r in zip((y, dx, dw), refs, strict=True)]
    print(f"{name:20}" + "".join(f"{e:9.4f}" for e in errs))
  return 0


if __name__ == "__main__":
  sys.exit(main())
