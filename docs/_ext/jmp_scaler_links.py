"""Inline code naming a public name links to its API entry, when the site is built.

```autocast```, ```jmp_scaler.autocast```, ```autocast(fn, policy)```,
```jmp_scaler.TrainState.apply_gradients``` and ```from jmp_scaler import jmp``` in a guide or a
docstring become links to the entry of the API reference (docs/api/), so the guides need no
hand-written links and stay plain Markdown. Only names in ``jmp_scaler.__all__`` (and
``jmp_scaler.jmp``) are linked; a public name without an entry in the API reference is an error
(the build runs with warnings as errors), which keeps the reference complete.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util import logging

import jmp_scaler

LOGGER = logging.getLogger(__name__)
#: Repository files outside docs/ (without .md) -> the site's page that includes each.
REPOSITORY_PAGES = {"BENCHMARKS": "project/benchmarks", "CHANGELOG": "project/changelog"}
PUBLIC = frozenset(jmp_scaler.__all__) | {"jmp"}
# `name`, `jmp_scaler.name`, `name.attr`, each optionally called: `name(...)`.
_CODE = re.compile(r"(?:jmp_scaler\.)?([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)*)(\(.*\))?", re.S)
_IMPORT = re.compile(r"from jmp_scaler import (\w+)")


def target(text: str, known) -> str | None:
  """The documented object ``text`` (inline code) names, if it names a public one.

  ``known`` holds the documented objects' full names; the longest documented prefix of an
  attribute chain wins (``TrainState.apply_gradients`` is its method's entry where the
  reference has one, the class's otherwise).
  """
  text = text.strip()
  m = _IMPORT.fullmatch(text)
  if m:
    return f"jmp_scaler.{m.group(1)}" if m.group(1) in PUBLIC else None
  m = _CODE.fullmatch(text)
  if m is None or m.group(1) not in PUBLIC:
    return None
  if m.group(1) == "jmp" and not text.startswith("jmp_scaler."):
    return None  # `jmp` alone is the original package, not jmp_scaler.jmp
  parts = [m.group(1), *[p for p in m.group(2).split(".") if p]]
  for end in range(len(parts), 0, -1):
    name = "jmp_scaler." + ".".join(parts[:end])
    if name in known or end == 1:
      return name
  return None


class LinkPublicNames(SphinxPostTransform):
  """Wraps each inline literal that names a public name in a cross-reference (before
  Sphinx resolves cross-references, priority 10)."""

  default_priority = 5

  def run(self, **kwargs) -> None:
    known = self.env.get_domain("py").objects
    for node in list(self.document.findall(nodes.literal)):
      if isinstance(node.parent, (nodes.reference, addnodes.pending_xref)):
        continue
      if any(isinstance(a, addnodes.desc_signature) for a in _ancestors(node)):
        continue
      name = target(node.astext(), known)
      if name is None:
        continue
      if name not in known:
        LOGGER.warning("%s is public but has no entry in the API reference (docs/api/)", name,
                       location=node, type="jmp_scaler", subtype="api")
        continue
      if name == _documented_here(node):
        continue  # an entry's own name inside its description
      ref = addnodes.pending_xref("", refdomain="py", reftype="obj", reftarget=name,
                                  refexplicit=True, refwarn=True, refdoc=self.env.docname)
      ref["py:module"] = ref["py:class"] = None
      node.replace_self(ref)
      ref.append(node)


class RepositoryFiles(SphinxPostTransform):
  """A guide's link to a Markdown file of the repository outside ``docs/``
  (``../BENCHMARKS.md``, ``../CHANGELOG.md``) goes to the site's page that includes it."""

  default_priority = 5  # before MyST resolves links to documents (9)

  def run(self, **kwargs) -> None:
    srcdir = pathlib.Path(self.env.srcdir)
    pages = {str(srcdir.parent / name): page for name, page in REPOSITORY_PAGES.items()}
    for node in self.document.findall(addnodes.pending_xref):
      target = node.get("reftarget", "")
      if not target or target in self.env.all_docs:
        continue
      path = os.path.normpath(target if os.path.isabs(target) else srcdir / target)
      if path in pages:
        node["reftarget"] = pages[path]


def _every_public_name_documented(app, env) -> None:
  """The API reference has an entry for every name in ``jmp_scaler.__all__``."""
  del app
  known = env.get_domain("py").objects
  for name in sorted(PUBLIC):
    if f"jmp_scaler.{name}" not in known:
      LOGGER.warning("jmp_scaler.%s is public but has no entry in the API reference (docs/api/)",
                     name, type="jmp_scaler", subtype="api")


def _builtin_docstring(app, what, name, obj, options, lines) -> None:
  """A constant documents itself, not its type (``DEFAULT_RULES`` is not ``dict``'s
  docstring)."""
  del app, name, options
  if what == "data" and lines and inspect.getdoc(type(obj)) == inspect.getdoc(obj):
    lines.clear()


def _ancestors(node):
  while node.parent is not None:
    node = node.parent
    yield node


def _documented_here(node) -> str | None:
  for a in _ancestors(node):
    if isinstance(a, addnodes.desc_content):
      sig = a.parent.next_node(addnodes.desc_signature)
      return sig.get("fullname") and f"{sig.get('module')}.{sig['fullname']}"
  return None


def setup(app: Sphinx) -> dict:
  app.add_post_transform(LinkPublicNames)
  app.add_post_transform(RepositoryFiles)
  app.connect("autodoc-process-docstring", _builtin_docstring)
  app.connect("env-check-consistency", _every_public_name_documented)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
