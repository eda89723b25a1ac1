"""google-tunix, imported by the helper that needs it, when that helper is called.

``import jmp_scaler`` and ``from jmp_scaler import tunix`` never import tunix: it is an
optional extra (``pip install 'jmp_scaler[tunix]'``) and a heavy import. Each helper imports
the tunix modules it builds on at its first call, through :func:`tunix_module`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import re
from types import ModuleType

#: The oldest google-tunix the helpers are tested with (tests/test_tunix.py).
MIN_VERSION = (0, 1, 7)
_INSTALL = "pip install 'jmp_scaler[tunix]' (google-tunix>=0.1.7)"


def tunix_module(name: str) -> ModuleType:
  """``tunix.<name>`` (``"generate.sampler"``, ``"sft.peft_trainer"``), imported now.

  Raises:
    ImportError: saying how to install google-tunix, when it is not installed or is older
      than :data:`MIN_VERSION`.
  """
  if importlib.util.find_spec("tunix") is None:
    raise ImportError(f"jmp_scaler.tunix needs google-tunix, which is not installed: {_INSTALL}")
  _check_version()
  return importlib.import_module(f"tunix.{name}")


@functools.cache
def _check_version() -> None:
  try:
    text = importlib.metadata.version("google-tunix")
  except importlib.metadata.PackageNotFoundError:
    return  # a source checkout of tunix: nothing to compare
  found = tuple(int(m) for m in re.findall(r"\d+", text)[:3])
  if found < MIN_VERSION:
    raise ImportError(f"jmp_scaler.tunix needs google-tunix>=0.1.7, found {text}: {_INSTALL}")
