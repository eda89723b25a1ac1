"""What every multi-device worker (tests/*_worker.py) prints: one JSON object, a value per
scenario, or the scenario's traceback as ``{"error": ...}``, so that one broken scenario
fails its own test and the others still report. The workers import it as ``_report``: a
script's folder comes first on ``sys.path``."""

import json
import traceback
from collections.abc import Callable
from typing import Any


def play(scenarios: dict[str, Callable[[], Any]], report: dict[str, Any] | None = None):
  """Runs every scenario in order and prints ``report`` with their results added."""
  report = dict(report or {})
  for name, scenario in scenarios.items():
    try:
      report[name] = scenario()
    except Exception:  # noqa: BLE001 - reported to the test
      report[name] = {"error": traceback.format_exc()}
  print(json.dumps(report), flush=True)


def parse(stdout: str) -> dict[str, Any]:
  """The report a worker printed: its last line of output."""
  return json.loads(stdout.strip().splitlines()[-1])


def scenario(report: dict[str, Any], name: str) -> Any:
  """Scenario ``name``'s result; the test fails with its traceback if it raised."""
  r = report[name]
  assert not (isinstance(r, dict) and "error" in r), r["error"]
  return r
