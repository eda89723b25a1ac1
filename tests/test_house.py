"""The package's import structure: floors without cycles, private names kept private."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("house", ROOT / "tools" / "house.py")
house = importlib.util.module_from_spec(spec)
spec.loader.exec_module(house)


def test_no_import_cycles_and_a_ground_floor_of_shared_helpers():
  level = house.floors(house.imports())
  ground = {m for m, f in level.items() if f == 0}
  assert {"_leaves", "_validation"} <= ground
  assert level["_scaler"] == 1  # the scaler builds only on the ground floor


def test_no_underscore_name_is_imported_across_modules():
  assert house.private_imports(house.imports()) == []


def test_the_drawing_finds_a_planted_cycle():
  graph = {"_a": {"_b": set()}, "_b": {"_a": {"_x"}}}
  try:
    house.floors(graph)
  except ValueError as err:
    assert "_a -> _b -> _a" in str(err)
  else:
    raise AssertionError("a cycle was not found")
  assert house.private_imports(graph) == ["_b imports _x from _a"]


def test_every_public_name_is_documented_and_exported():
  import jmp_scaler

  text = (ROOT / "README.md").read_text() + "".join(
      p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
  assert [n for n in jmp_scaler.__all__ if n not in text] == []
  assert all(hasattr(jmp_scaler, n) for n in jmp_scaler.__all__)
  assert sorted(jmp_scaler.__all__) == list(jmp_scaler.__all__)
