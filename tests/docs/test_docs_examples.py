"""Every Python example of the documentation (docs/**/*.md and the README) runs.

Each page is one test: its blocks run in order in a fresh interpreter, in an empty folder.
Blocks marked ``<!-- skip: reason -->`` (a GPU, a cluster) are tests of their own that skip
with that reason, so ``pytest -ra`` lists every example that did not run here.
"""

from __future__ import annotations

import os

import pytest
from docs_audit import ROOT, markdown_pages
from markdown_examples import python_blocks, run_page

PAGES = [p for p in markdown_pages() if python_blocks(p)]
SKIPPED = [b for p in PAGES for b in python_blocks(p) if b.skip is not None]


def _name(page):
    return str(page.relative_to(ROOT))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_examples_run(page, tmp_path):
    """The page's examples run in order, as a reader would type them, and exit cleanly."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "pkg") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONWARNINGS": "error::DeprecationWarning",
    }
    run_page(python_blocks(page), tmp_path, env, timeout=180)


@pytest.mark.parametrize(
    "block", SKIPPED, ids=[f"{_name(b.page)}:{b.line}" for b in SKIPPED] or None
)
def test_marked_example(block):
    """An example that needs what this machine lacks is reported, with its reason."""
    pytest.skip(f"{_name(block.page)}:{block.line}: {block.skip}")


def test_examples_are_found():
    """The extractor sees the pages' examples (so an empty list cannot pass for success)."""
    assert len(PAGES) >= 5
    assert sum(len(python_blocks(p)) for p in PAGES) >= 20
