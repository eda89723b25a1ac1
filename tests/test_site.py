"""The project as published: one version, the licence, the changelog, the documentation site.

The fast tests read files; the slow one builds the site (Sphinx, warnings as errors; or takes
the one built at ``$JMP_SCALER_SITE``), serves it on localhost and loads three pages in
headless Chromium (``pip install -e ".[docs]"`` and
Debian's ``chromium``; skipped, saying which is missing, where one is). Its screenshots are
kept in ``$JMP_SCALER_ARTIFACTS/site`` (default: ``out/site`` in the clone, ignored by git), a
path it prints.
"""

from __future__ import annotations

import functools
import http.server
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import tomllib

import pytest

import jmp_scaler

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# `.. autofunction:: jmp_scaler.name` and the like, in the API pages' eval-rst blocks.
_ENTRY = re.compile(r"^\.\. auto(?:function|class|data|module):: jmp_scaler\.(\w+)\s*$", re.M)


def api_entries() -> list[str]:
  """The public names the API reference documents, one per autodoc entry."""
  return [n for p in sorted((DOCS / "api").glob("*.md")) for n in _ENTRY.findall(p.read_text())]


def test_every_public_name_has_one_entry_in_the_api_reference():
  entries = api_entries()
  assert sorted(set(entries)) == sorted(entries), "a name documented twice"
  assert set(entries) == set(jmp_scaler.__all__) | {"jmp"}


def test_the_api_pages_hold_no_python_block_and_every_wing_has_its_page():
  pages = {p.stem for p in (DOCS / "api").glob("*.md")}
  package = pathlib.Path(jmp_scaler.__file__).parent
  wings = {p.name for p in package.iterdir() if (p / "__init__.py").exists()} - {"jaxcompat"}
  assert wings <= pages, wings - pages
  for p in (DOCS / "api").glob("*.md"):
    assert "```python" not in p.read_text(), p  # tests/_docs.py runs python blocks


def test_every_guide_is_in_the_site_s_table_of_contents():
  index = (DOCS / "index.md").read_text()
  toc = {line.strip() for block in re.findall(r":::\{toctree\}(.*?):::", index, re.S)
         for line in block.splitlines() if line.strip() and not line.strip().startswith(":")}
  guides = {p.stem for p in DOCS.glob("*.md")} - {"index"}
  assert guides <= toc, guides - toc
  assert {"api/index", "project/changelog"} <= toc


def test_the_version_is_written_once():
  project = PYPROJECT["project"]
  assert "version" not in project and "version" in project["dynamic"]
  dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]
  assert dynamic == {"attr": "jmp_scaler.__version__"}
  assert re.fullmatch(r"\d+\.\d+\.\d+", jmp_scaler.__version__)
  assert importlib.metadata.version("jmp_scaler") == jmp_scaler.__version__


def test_jmp_scaler_is_imported_from_the_wheel_ci_installed():
  """.ci/run's wheel step runs the fast suite from a copy of the tree without jmp_scaler/,
  against the wheel installed in a fresh venv (JMP_SCALER_EXPECT_WHEEL=1)."""
  if not os.environ.get("JMP_SCALER_EXPECT_WHEEL"):
    pytest.skip("only in .ci/run's wheel step (JMP_SCALER_EXPECT_WHEEL=1)")
  package = pathlib.Path(jmp_scaler.__file__).resolve().parent
  assert package.parent == pathlib.Path(sysconfig.get_paths()["purelib"]).resolve(), package
  assert not (ROOT / "jmp_scaler" / "__init__.py").exists(), "the tests run inside a source tree"
  direct_url = importlib.metadata.distribution("jmp_scaler").read_text("direct_url.json") or ""
  assert '"editable": true' not in direct_url and ".whl" in direct_url, direct_url
  assert (package / "py.typed").is_file()


def test_the_license_is_the_apache_2_0_text_pyproject_declares():
  text = (ROOT / "LICENSE").read_text()
  assert PYPROJECT["project"]["license"] == "Apache-2.0"
  assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
  assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190


def test_the_changelog_keeps_a_changelog_with_the_current_version_and_breaking_changes():
  text = (ROOT / "CHANGELOG.md").read_text()
  releases = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
  assert releases[0] == ("Unreleased", "")
  assert (jmp_scaler.__version__, "2026-11-29") in releases
  sections = set(re.findall(r"^### (\w+)$", text, re.M))
  assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
  assert "**Breaking**: `get_scale`" in text and "`adam`, `adamw` and `scale_by_adam` keep" in text


def test_public_names_in_inline_code_become_links():
  pytest.importorskip("sphinx", reason="the docs extra is not installed (pip install -e .[docs])")
  sys.path.insert(0, str(DOCS / "_ext"))
  try:
    import jmp_scaler_links as links
  finally:
    sys.path.remove(str(DOCS / "_ext"))
  known = {"jmp_scaler.TrainState", "jmp_scaler.TrainState.apply_gradients",
           "jmp_scaler.autocast", "jmp_scaler.jmp"}
  assert links.target("autocast", known) == "jmp_scaler.autocast"
  assert links.target("jmp_scaler.autocast(fn, policy)", known) == "jmp_scaler.autocast"
  assert links.target("TrainState.apply_gradients", known) == \
      "jmp_scaler.TrainState.apply_gradients"
  assert links.target("state.apply_gradients", known) is None  # not a public name
  assert links.target("TrainState.replace", known) == "jmp_scaler.TrainState"
  assert links.target("from jmp_scaler import jmp", known) == "jmp_scaler.jmp"
  assert links.target("jmp", known) is None  # the original package
  assert links.target("optax.adam", known) is None


# The pages loaded in the browser: what each must show.
PAGES = {
    "index.html": "jmp_scaler",
    "autocast.html": "Autocast: mixed precision as a function transformation",
    "api/precision.html": "Precision: policies and autocast",
}


def _chromium() -> str | None:
  return shutil.which("chromium") or shutil.which("chromium-browser")


def _png_size(path: pathlib.Path) -> tuple[int, int]:
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
  return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


class _Quiet(http.server.SimpleHTTPRequestHandler):
  def log_message(self, format, *args):  # noqa: A002 - the base class's name
    del format, args


@pytest.mark.slow
def test_the_site_builds_without_warnings_and_renders_in_chromium(tmp_path):
  # .ci/run's site step sets JMP_SCALER_REQUIRE_SITE=1: there a missing tool fails, not skips.
  skip = pytest.fail if os.environ.get("JMP_SCALER_REQUIRE_SITE") else pytest.skip
  if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("furo") is None:
    skip("Sphinx is not installed: pip install -e '.[docs]'")
  browser = _chromium()
  if browser is None:
    skip("chromium is not installed: apt-get install -y chromium (Debian's package)")
  if os.environ.get("JMP_SCALER_SITE"):  # built by .ci/run's docs step, with -W
    html = pathlib.Path(os.environ["JMP_SCALER_SITE"])
  else:
    html = tmp_path / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
         str(html)], capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert build.returncode == 0, f"{build.stdout[-3000:]}\n{build.stderr[-5000:]}"
  from sphinx.util.inventory import InventoryFile

  with open(html / "objects.inv", "rb") as f:
    inventory = InventoryFile.load(f, "", os.path.join)
  documented = {name for kind, objects in inventory.items() if kind.startswith("py:")
                for name in objects}
  missing = {f"jmp_scaler.{n}" for n in jmp_scaler.__all__} - documented
  assert not missing, f"public names without an entry in the built reference: {missing}"

  shots = pathlib.Path(os.environ.get("JMP_SCALER_ARTIFACTS", ROOT / "out")) / "site"
  shots.mkdir(parents=True, exist_ok=True)
  handler = functools.partial(_Quiet, directory=str(html))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # a port the OS picks
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    port = server.server_address[1]
    for page, title in PAGES.items():
      url = f"http://127.0.0.1:{port}/{page}"
      flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
               "--virtual-time-budget=10000"]
      dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True,
                           timeout=300)
      assert dom.returncode == 0, dom.stderr[-3000:]
      text = dom.stdout
      assert re.search(rf"<title>{re.escape(title)}", text), (page, text[:500])
      assert re.search(r'<h1>[^<]*', text), page
      assert 'class="sidebar-search"' in text, f"{page}: no search box"
      assert 'class="sidebar-tree"' in text and 'href="' in text, f"{page}: no navigation"
      assert re.search(r'<div class="highlight[^"]*"><div class="highlight"><pre>', text) or \
          "<pre>" in text, f"{page}: no code block"
      shot = shots / (page.replace("/", "_").removesuffix(".html") + ".png")
      shot.unlink(missing_ok=True)
      png = subprocess.run([*flags, "--window-size=1280,1600", f"--screenshot={shot}", url],
                           capture_output=True, text=True, timeout=300)
      assert png.returncode == 0 and shot.exists(), png.stderr[-3000:]
      assert _png_size(shot) == (1280, 1600)
      print(f"site: {page} rendered, screenshot {shot}")
  finally:
    server.shutdown()
    server.server_close()
  print(f"site: screenshots of {len(PAGES)} pages in {shots}")
