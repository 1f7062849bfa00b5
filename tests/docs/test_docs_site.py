"""The documentation site: it builds with warnings as errors, its reference lists every
public name, every public name has a complete docstring, and no document points outside the
repository."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import types

import pytest
from docs_audit import (
    DATA_NAMES,
    DOCS,
    ROOT,
    docstring_problems,
    markdown_pages,
    public_names,
    public_objects,
    reference_targets,
)

# Documents a user or a contributor reads, besides the site's pages.
DOCUMENTS = [*markdown_pages(), ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md"]


class TestDocstrings:
    def test_every_public_name_has_a_complete_docstring(self):
        """Every public function, class, method and property says what it does, its
        arguments, what it returns and what it raises (Google style)."""
        problems = [
            f"{qual}: {problem}"
            for qual, obj in public_objects()
            for problem in docstring_problems(qual, obj)
        ]
        assert not problems, "\n".join(problems)

    def test_the_check_sees_a_missing_docstring(self, monkeypatch):
        """Removing a docstring is reported (the check above cannot pass vacuously)."""
        import easycore

        monkeypatch.setattr(easycore.derive_seed, "__doc__", None)
        found = dict(public_objects())
        assert docstring_problems("easycore.derive_seed", found["easycore.derive_seed"]) == [
            "no docstring"
        ]

    def test_the_check_sees_an_undocumented_argument(self):
        """A parameter missing from ``Args:`` and a missing ``Returns:`` are reported."""

        def half(x: float, y: float) -> float:
            """Half of x.

            Args:
                x: a number.
            """
            return x / 2

        assert docstring_problems("half", half) == ["Args: lacks ['y']", "no Returns:"]


class TestReference:
    def test_reference_lists_every_public_name(self):
        """Every name of a public module's ``__all__`` has a ``::: name`` on a reference page."""
        targets = reference_targets()
        missing = [name for name, _ in public_names() if name not in targets]
        assert not missing, f"not in docs/reference/*.md: {missing}"
        text = "".join(p.read_text() for p in (DOCS / "reference").glob("*.md"))
        for name in DATA_NAMES:
            assert name in text

    def test_reference_names_exist(self):
        """Every ``::: name`` names a public object (a renamed one fails here and in the build)."""
        known = {qual for qual, _ in public_objects()}
        assert not reference_targets() - known


@pytest.mark.timeout(120)
def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict`` succeeds (a broken link or anchor, a page left out of the
    nav, a ``::: name`` that does not resolve fail it) and the built reference has an entry
    for every public name and every public method."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    built = "".join(p.read_text() for p in (tmp_path / "site" / "reference").rglob("*.html"))
    ids = set(re.findall(r'id="(easycore[\w.]*)"', built))
    wanted = {qual for qual, obj in public_objects() if not isinstance(obj, types.ModuleType)}
    assert not wanted - ids, f"missing from the built reference: {sorted(wanted - ids)}"


class TestLinks:
    def test_readme_links_resolve(self):
        """The README's relative links point at files of the repository."""
        text = (ROOT / "README.md").read_text()
        links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
        local = [link for link in links if "://" not in link]
        assert local, "the README links to the documentation"
        missing = [link for link in local if not (ROOT / link).exists()]
        assert not missing, missing

    @pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
    def test_no_document_refers_outside_the_repository(self, doc):
        """No document points at a file a user who clones easycore does not have."""
        text = doc.read_text()
        for needle in ("../shared", "/work/", "API.md"):
            assert needle not in text, f"{doc.name} mentions {needle!r}"
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" in link or link.startswith("mailto:"):
                continue
            target = (doc.parent / link).resolve()
            assert target.is_relative_to(ROOT), f"{doc.name} links outside: {link}"
            assert target.exists(), f"{doc.name} links to a missing file: {link}"


def test_docs_extension_fences_doctests():
    """The site's griffe extension turns ``>>>`` runs into code and Sphinx roles into code."""
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        from doctest_fences import fence_doctests
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    text = inspect.cleandoc(
        """Summary with :class:`~easycore.Runner`, and code::

            x = 1

        >>> x["A"]["B"]
        1

        After."""
    )
    assert fence_doctests(text).splitlines() == [
        "Summary with `Runner`, and code:",
        "",
        "    x = 1",
        "",
        "```pycon",
        '>>> x["A"]["B"]',
        "1",
        "```",
        "",
        "After.",
    ]
