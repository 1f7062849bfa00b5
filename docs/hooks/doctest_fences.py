"""A griffe extension: doctest runs in docstrings render as Python sessions,
and Sphinx roles as code.

easycore's docstrings put their ``>>>`` examples where they read best, not only under an
``Examples:`` heading; Markdown would take ``>>>`` for a nested quote (and ``x["A"]["B"]``
for a link). This wraps each run of doctest lines, up to the next blank line, in a
```` ```pycon ```` fence, at the indentation it has. Loaded by ``mkdocs.yml``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# Sphinx roles (:class:`~easycore.Runner`) read as code in Markdown: `Runner`.
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([^`]+)`")


def _code_span(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def fence_doctests(text: str) -> str:
    """Return ``text`` with every run of ``>>>`` lines (and their output) fenced, Sphinx
    roles as code spans, and reST's ``::`` before a literal block as ``:``."""
    out: list[str] = []
    lines = _ROLE.sub(_code_span, text).splitlines()
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_fence or not stripped.startswith(">>>"):
            # reST's "text::" before an indented literal block: Markdown's indented code
            # block needs no marker, so the text ends with one colon.
            out.append(line[:-1] if line.endswith("::") and not in_fence else line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctest runs of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring in place (griffe calls this for every object)."""
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
