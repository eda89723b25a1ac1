"""Draws the package's house from its imports: floors, and what each room imports.

A module's floor is one more than the highest floor it imports from (the ground
floor imports nothing of the package). Prints the floors and, with
``--check``, exits non-zero on an import cycle or on an underscore name
imported from another module (each module's private names stay private).

  python tools/house.py            # the drawing
  python tools/house.py --check    # what tests/test_house.py asserts
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jmp_scaler"


def imports() -> dict[str, dict[str, set[str]]]:
  """``{module: {imported module: {names}}}`` for every module of the package."""
  graph: dict[str, dict[str, set[str]]] = {}
  for path in sorted(PACKAGE.glob("*.py")):
    name = path.stem
    edges: dict[str, set[str]] = {}
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # function-level imports count too
      if isinstance(node, ast.ImportFrom) and node.module:
        if node.module == "jmp_scaler":  # from jmp_scaler import _validation as v
          for alias in node.names:
            edges.setdefault(alias.name, set())
        elif node.module.startswith("jmp_scaler."):
          target = node.module.split(".", 1)[1]
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
    deps = [d for d in graph.get(m, {}) if d in graph and d != "__init__"]
    level[m] = 1 + max((visit(d) for d in deps), default=-1)
    visiting.pop()
    return level[m]

  for m in graph:
    if m != "__init__":
      visit(m)
  return level


def private_imports(graph: dict[str, dict[str, set[str]]]) -> list[str]:
  """``"a imports _x from b"`` for every underscore name crossing a module boundary."""
  return sorted(
      f"{m} imports {n} from {d}"
      for m, edges in graph.items() if m != "__init__"
      for d, names in edges.items() for n in names if n.startswith("_")
  )  # fmt: skip


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="fail on cycles and private imports")
  args = parser.parse_args()
  graph = imports()
  level = floors(graph)
  for f in range(max(level.values()) + 1):
    rooms = sorted(m for m, v in level.items() if v == f)
    print(f"floor {f}:")
    for m in rooms:
      deps = ", ".join(sorted(d for d in graph[m] if d in graph)) or "-"
      print(f"  {m:<18} imports {deps}")
  bad = private_imports(graph)
  for line in bad:
    print(f"private import: {line}")
  return 1 if (args.check and bad) else 0


if __name__ == "__main__":
  sys.exit(main())
