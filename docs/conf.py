"""Sphinx configuration of the documentation site (``docs/``).

Build it with ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (after
``pip install -e ".[docs]"``): every warning is an error, so a broken link, a page left out of
the table of contents or a public name missing from the API reference fails the build.

The guides are ``docs/*.md`` as they are (MyST Markdown); the API reference is ``docs/api/``,
one page per wing, from the docstrings (autodoc, napoleon for their Google style). Inline code
in any page that names a public name (```autocast```, ```jmp_scaler.TrainState```) becomes a
link to its entry when the site is built (``docs/_ext/jmp_scaler_links.py``): the Markdown is
not edited for it.
"""

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports jax: no accelerator probing
DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the source tree's jmp_scaler, whatever is installed
sys.path.insert(0, str(DOCS / "_ext"))

import jmp_scaler  # noqa: E402

project = "jmp_scaler"
author = "the jmp_scaler authors"
copyright = "the jmp_scaler authors, Apache-2.0"  # noqa: A001 - Sphinx's name
version = release = jmp_scaler.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "jmp_scaler_links",
]
root_doc = "index"
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext"]

# MyST: GitHub-style heading anchors (the guides link to `flax.md#checkpoints`), ::: fences
# for the site's own directives (```{...} fences would be read as code by tests/_docs.py).
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

# autodoc: the signature as written, types in it; members in source order.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"jmp_scaler {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
