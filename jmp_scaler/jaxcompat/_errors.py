"""The error a JAX release without an internal jmp_scaler reads raises."""

from __future__ import annotations

import jax

#: The JAX releases the internals read in this wing are known to hold for (tested by CI at
#: both ends).
SUPPORTED = "jax 0.10.2 to 0.12.x"


class JaxInternalsError(RuntimeError):
  """A JAX internal that jmp_scaler reads is missing from the installed JAX."""


def missing(what: str, where: str) -> JaxInternalsError:
  """The error for ``what`` (an internal) missing from ``where`` (its place in JAX)."""
  return JaxInternalsError(
    f"jmp_scaler cannot read {what} of {where} in jax {jax.__version__}: this JAX release "
    f"changed an internal jmp_scaler reads (supported: {SUPPORTED}). Please report it with "
    "your jax version; jmp_scaler/jaxcompat/ is the one place to adapt."
  )
