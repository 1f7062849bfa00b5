"""The Python examples of the Markdown pages, as a reader would type them.

A page's ```` ```python ```` blocks run in order in one fresh interpreter (they share one
namespace, as in a session), in an empty temporary folder. A block that cannot run here is
marked by an HTML comment on the line before its fence, giving the reason:
``<!-- skip: needs a GPU -->``; it is reported as skipped, and the blocks after it must not
depend on it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a page."""

    page: Path
    line: int  # of the first line of code (1-based)
    code: str
    skip: str | None  # the reason it does not run here, or None


def python_blocks(page: Path) -> list[Block]:
    """The ```` ```python ```` blocks of ``page``, in order, with their skip marks."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        indent, lang, start = m.group("indent"), m.group("lang"), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :])
            i += 1
        i += 1
        if lang != "python":
            continue
        before = lines[start - 1] if start > 0 else ""
        mark = SKIP.match(before)
        blocks.append(
            Block(page, start + 2, "\n".join(body) + "\n", mark.group("reason") if mark else None)
        )
    return blocks


RUNNER = r"""
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for path, line, code in blocks:
    # Padded so that a traceback names the page's own line numbers.
    exec(compile("\n" * (line - 1) + code, path, "exec"), namespace)
"""


def run_page(blocks: list[Block], cwd: Path, env: dict[str, str], timeout: float) -> None:
    """Run the blocks not marked ``skip`` in one interpreter; raise ``AssertionError`` with
    its output when it fails."""
    todo = [(str(b.page), b.line, b.code) for b in blocks if b.skip is None]
    if not todo:
        return
    script = cwd / ".blocks.json"
    script.write_text(json.dumps(todo), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        msg = f"exit code {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
        raise AssertionError(msg)
