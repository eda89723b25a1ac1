"""Draws the package's house from its imports: wings, floors, and what each room imports.

The package is a ground floor of shared helpers (``jmp_scaler/_*.py``) and one
wing (subpackage) per concept. Each wing has a declared floor (:data:`WINGS`),
and a wing may import only from itself and from wings on lower floors. Inside
the house, a module's floor is one more than the highest floor it imports
from. Prints the wings with their rooms and, with ``--check``, exits non-zero
on an import cycle, on an import from a wing that is not below, on a module
in no declared wing, or on an underscore name imported from another module
(each module's private names stay private).

  python tools/house.py            # the drawing
  python tools/house.py --check    # what tests/test_house.py asserts
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import pathlib
import sys

# The jmp_scaler that Python imports: the source tree (editable install) or an installed wheel.
PACKAGE = pathlib.Path(importlib.util.find_spec("jmp_scaler").origin).parent
GROUND = ""

#: Each wing's floor: a wing imports only from wings on a lower floor (and itself).
WINGS = {
    GROUND: 0,          # _leaves, _validation
    "jaxcompat": 0,     # every JAX internal read, one module per concern
    "scaling": 1,       # the scaler, the exact skip, accumulation, several devices
    "lowbit": 1,        # stochastic rounding, Kahan summation, 16-bit Adam, fp8
    "precision": 2,     # policies (which recommend a scaler and an optimizer), autocast
    "training": 2,      # TrainState, NNXOptimizer
    "checkpoint": 2,    # checkpoint I/O and the restore check
    "diagnostics": 3,   # reports and the monitor
    "jmp": 3,           # jmp 0.0.4's API over precision: `from jmp_scaler import jmp`
    "tunix": 4,         # float16 RL in google-tunix: `from jmp_scaler import tunix`
}


def wing(module: str) -> str:
  """``"scaling"`` for ``"scaling._scaler"``; :data:`GROUND` for ``"_leaves"``."""
  return module.rpartition(".")[0]


def _modules() -> dict[str, pathlib.Path]:
  """``{"_leaves": path, "scaling._scaler": path, ...}``: every module but ``__init__``."""
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE).with_suffix("")
    if rel.name != "__init__":
      found[".".join(rel.parts)] = path
  return found


def imports() -> dict[str, dict[str, set[str]]]:
  """``{module: {imported module: {names}}}`` for every module of the package."""
  modules = _modules()
  packages = {GROUND} | {wing(m) for m in modules}
  graph: dict[str, dict[str, set[str]]] = {}
  for name, path in modules.items():
    edges: dict[str, set[str]] = {}
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # function-level imports count too
      if isinstance(node, ast.ImportFrom) and node.module and (
          node.module == "jmp_scaler" or node.module.startswith("jmp_scaler.")):
        target = node.module.partition(".")[2]
        if target in packages:  # from jmp_scaler.precision import _rules as R: modules
          for alias in node.names:
            edges.setdefault(f"{target}.{alias.name}".lstrip("."), set())
        else:
          edges.setdefault(target, set()).update(a.name for a in node.names)
    graph[name] = edges
  return graph


def floors(graph: dict[str, dict[str, set[str]]]) -> dict[str, int]:
  """Each module's floor; raises ValueError on a cycle."""
  level: dict[str, int] = {}
  visiting: list[str] = []

  def visit(m: str) -> int:
    if m in level:
      return level[m]
    if m in visiting:
      cycle = visiting[visiting.index(m):] + [m]
      raise ValueError(f"import cycle: {' -> '.join(cycle)}")
    visiting.append(m)
    deps = [d for d in graph.get(m, {}) if d in graph]
    level[m] = 1 + max((visit(d) for d in deps), default=-1)
    visiting.pop()
    return level[m]

  for m in graph:
    visit(m)
  return level


def upward_imports(graph: dict[str, dict[str, set[str]]], wings=None) -> list[str]:
  """``"a imports b: wing x (floor i) is not below wing y (floor j)"`` for every bad edge.

  Also names every module whose wing has no declared floor.
  """
  wings = WINGS if wings is None else wings
  bad = [f"{m} is in no declared wing" for m in graph if wing(m) not in wings]
  for m, edges in graph.items():
    for d in edges:
      a, b = wing(m), wing(d)
      if a == b or a not in wings or b not in wings:
        continue
      if wings[b] >= wings[a]:
        bad.append(f"{m} imports {d}: wing {b or 'ground'} (floor {wings[b]}) "
                   f"is not below wing {a or 'ground'} (floor {wings[a]})")
  return sorted(bad)


def private_imports(graph: dict[str, dict[str, set[str]]]) -> list[str]:
  """``"a imports _x from b"`` for every underscore name crossing a module boundary."""
  return sorted(
      f"{m} imports {n} from {d}"
      for m, edges in graph.items()
      for d, names in edges.items() for n in names if n.startswith("_")
  )  # fmt: skip


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="fail on any of the faults above")
  args = parser.parse_args()
  graph = imports()
  level = floors(graph)
  for name, floor in sorted(WINGS.items(), key=lambda kv: (kv[1], kv[0])):
    print(f"floor {floor}: {name or 'ground'}/")
    for m in sorted(m for m in graph if wing(m) == name):
      deps = ", ".join(sorted(d for d in graph[m] if d in graph)) or "-"
      print(f"  {m.rpartition('.')[2]:<16} (room floor {level[m]}) imports {deps}")
  bad = upward_imports(graph) + private_imports(graph)
  for line in bad:
    print(f"fault: {line}")
  return 1 if (args.check and bad) else 0


if __name__ == "__main__":
  sys.exit(main())
