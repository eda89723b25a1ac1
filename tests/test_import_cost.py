"""``import jmp_scaler`` stays light: Orbax is imported by the checkpoint functions that use
it, when first called (``benchmarks/bench_import.py`` times the import; nothing here is
timed). One fresh interpreter, about as long as ``import jax, flax, optax`` takes."""

import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
  import sys
  import jmp_scaler
  heavy = sorted(m for m in sys.modules if m == "orbax" or m.startswith("orbax."))
  print("after import:", heavy)
  import jax.numpy as jnp
  state = {"w": jnp.ones(3), "step": 0}
  restored = jmp_scaler.from_bytes(state, jmp_scaler.to_bytes(state))
  assert float(restored["w"].sum()) == 3.0
  heavy = sorted(m for m in sys.modules if m == "orbax" or m.startswith("orbax."))
  print("after to_bytes/from_bytes:", heavy)
""")


def test_import_jmp_scaler_does_not_import_orbax():
  out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                       check=True).stdout.splitlines()  # fmt: skip
  assert out == ["after import: []", "after to_bytes/from_bytes: []"], out
