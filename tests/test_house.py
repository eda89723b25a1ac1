"""The package's import structure: wings on floors, no cycles, private names kept private."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("house", ROOT / "tools" / "house.py")
house = importlib.util.module_from_spec(spec)
spec.loader.exec_module(house)


def test_no_import_cycles_and_a_ground_floor_of_shared_helpers():
  graph = house.imports()
  level = house.floors(graph)
  ground = {m for m, f in level.items() if f == 0}
  assert {"_leaves", "_validation"} <= ground
  assert {m for m in graph if house.wing(m) == house.GROUND} == {"_leaves", "_validation"}
  assert level["scaling._scaler"] == 1  # the scaler builds only on the ground floor


def test_the_concepts_are_wings_and_no_wing_imports_a_wing_above_it():
  graph = house.imports()
  wings = {house.wing(m) for m in graph}
  assert wings == set(house.WINGS), wings
  assert house.upward_imports(graph) == []
  # Every wing but the ground floor's is a folder whose rooms are private modules.
  for name in wings - {house.GROUND}:
    assert (house.PACKAGE / name / "__init__.py").is_file()
  assert all(m.rpartition(".")[2].startswith("_") for m in graph)


def test_no_underscore_name_is_imported_across_modules():
  assert house.private_imports(house.imports()) == []


def test_the_drawing_finds_a_planted_cycle_and_an_upward_import():
  graph = {"_a": {"_b": set()}, "_b": {"_a": {"_x"}}}
  try:
    house.floors(graph)
  except ValueError as err:
    assert "_a -> _b -> _a" in str(err)
  else:
    raise AssertionError("a cycle was not found")
  assert house.private_imports(graph) == ["_b imports _x from _a"]
  wings = {"": 0, "low": 1, "high": 2, "side": 1}
  planted = {"low._a": {"high._b": set(), "_leaves": set()}, "high._b": {"low._a": set()},
             "side._c": {"low._a": set()}, "odd._d": {}}
  assert house.upward_imports(planted, wings) == [
      "low._a imports high._b: wing high (floor 2) is not below wing low (floor 1)",
      "odd._d is in no declared wing",
      "side._c imports low._a: wing low (floor 1) is not below wing side (floor 1)",
  ]


def test_every_public_name_is_documented_and_exported():
  import jmp_scaler

  text = (ROOT / "README.md").read_text() + "".join(
      p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
  assert [n for n in jmp_scaler.__all__ if n not in text] == []
  assert all(hasattr(jmp_scaler, n) for n in jmp_scaler.__all__)
  assert sorted(jmp_scaler.__all__) == list(jmp_scaler.__all__)
