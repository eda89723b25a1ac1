"""Checks a built wheel and sdist against the source tree: every module of jmp_scaler (so
every subpackage), py.typed and the licence are in the wheel, its version is
jmp_scaler.__version__, and the sdist holds the same modules.

Usage: python .ci/check_wheel.py DIST_DIR (from the root of the clone).
"""

import ast
import pathlib
import re
import sys
import tarfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def version() -> str:
  tree = ast.parse((ROOT / "jmp_scaler" / "__init__.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]:
      return node.value.value
  raise SystemExit("jmp_scaler/__init__.py sets no __version__")


def main(dist: pathlib.Path) -> None:
  wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
  assert len(wheels) == 1 and len(sdists) == 1, (wheels, sdists)
  source = {str(p.relative_to(ROOT)) for p in (ROOT / "jmp_scaler").rglob("*.py")}
  source.add("jmp_scaler/py.typed")
  packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "jmp_scaler").rglob("__init__.py")}
  names = set(zipfile.ZipFile(wheels[0]).namelist())
  missing = sorted(source - names)
  assert not missing, f"the wheel lacks {missing}"
  stray = sorted(n for n in names if not n.startswith(("jmp_scaler/", "jmp_scaler-")))
  assert not stray, f"the wheel holds files outside the package: {stray}"
  info = [n for n in names if re.fullmatch(r"jmp_scaler-[^/]+\.dist-info/METADATA", n)]
  metadata = zipfile.ZipFile(wheels[0]).read(info[0]).decode()
  assert f"\nVersion: {version()}\n" in metadata, metadata[:400]
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "no LICENSE"
  with tarfile.open(sdists[0]) as sdist:
    in_sdist = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
  assert not (source - in_sdist), f"the sdist lacks {sorted(source - in_sdist)}"
  print(f"wheel {wheels[0].name}: {len(source)} files of jmp_scaler, {len(packages)} packages "
        f"({', '.join(sorted(p.removeprefix('jmp_scaler').lstrip('/') or '.' for p in packages))}),"
        f" py.typed, LICENSE, version {version()}; sdist {sdists[0].name}: the same modules")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
