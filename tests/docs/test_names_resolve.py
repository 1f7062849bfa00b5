"""Names in the documentation stay true: every dotted name that names something of easycore
resolves, so a rename or a move that leaves a docstring or a page behind fails here.

Where names are looked for: the docstrings of the package (every string statement of
``pkg/easycore``: module, class, function and attribute docstrings), ``ARCHITECTURE.md``, the
README and the pages of ``docs/`` (their prose, not the fenced examples, which run). A name is a
code span that is a dotted path of identifiers with at most one argument list at its end
(stripped: ``RunBooks.take()`` is ``RunBooks.take``), or such a path written bare in the
prose (``Run.dispatch``, as the data-flow diagram of ``_exec`` writes them).

It names something of the package when its first part is

- ``easycore``, or a module of the package by its last part (``_exec``, ``books``, ``blame``,
  ``common``; ``torch`` alone is the library): resolved from that module (from any of them
  where modules share the last part);
- a class the package defines (``RunBooks.take``), or such a class's name in lower case, as
  an instance is named (``runner.stats()`` is ``Runner.stats``), or ``books`` (a ``RunBooks``).

Written bare, only the ``easycore``, private-module and class forms count (``runner.map`` in
prose may be anyone's runner). A docstring's Sphinx role with no dot (:class:`DirLock`,
:meth:`start_chunk`) names something of its own module.

A member resolves when ``getattr`` finds it or it is an instance attribute of the class
(an attrs field, a slot, an annotation, or ``self.name = ...`` in the class's source).
Anything else (``torch.load``, ``cfg.MODEL.DEPTH``, ``imap(..., state=s)``, ``data[i]``) is not
a name of the package and is not checked. A file name is not a dotted name (``run.db``), but a
module's file (``run.py``, ``_exec/runner.py``) must be a file of the package.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from docs_audit import ROOT, markdown_pages

import easycore

PACKAGE = ROOT / "pkg" / "easycore"
PAGES = [*markdown_pages(), ROOT / "ARCHITECTURE.md"]

# First parts that are modules of the package by name but, alone, mean another library.
FOREIGN = {"torch", "ray"}
# Instances named otherwise than their class in lower case.
INSTANCES = {"books": "RunBooks"}
# File names: ``run.py``, ``cache.json``.
SUFFIXES = {"py", "md", "db", "json", "jsonl", "gz", "parquet", "toml", "yaml", "txt", "tar"}

# Deliberate exceptions: the name as written -> why it need not resolve.
ALLOWED: dict[str, str] = {}

DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
CALL = re.compile(r"\([^()]*\)")
# ``x`` or `x` (a Sphinx role's target too: :class:`~easycore.Runner`).
SPAN = re.compile(r"``([^`\n]+)``|`([^`\n]+)`")
# A dotted path written bare in prose: not part of a path, a URL or a string.
BARE = re.compile(r"(?<![\w.'\"/=-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?")
PYFILE = re.compile(r"(?:[\w-]+/)*[\w-]+\.py")
# A Sphinx role's target with no dot: a name of the docstring's own module.
ROLE = re.compile(r":(?:class|meth|func|attr|exc|data|obj):`~?(\w+)`")


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every string statement of a module: its docstrings."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node.lineno, node.value.value


def _prose(page: Path) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of a Markdown page's lines outside fenced code."""
    fenced = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            yield number, line


def mentions() -> Iterator[tuple[str, str, bool]]:
    """``(where, text, in_span)`` for every code span of the docstrings and the pages, and
    every dotted path their prose writes bare."""
    sources = [
        *((path, _docstrings(path)) for path in sorted(PACKAGE.rglob("*.py"))),
        *((page, _prose(page)) for page in PAGES),
    ]
    for path, texts in sources:
        for line, text in texts:
            where = f"{path.relative_to(ROOT)}:{line}"
            for m in SPAN.finditer(text):
                yield where, (m.group(1) or m.group(2)).strip(), True
            for m in BARE.finditer(SPAN.sub(" ", text)):
                yield where, m.group(), False


def dotted_name(span: str) -> str | None:
    """The dotted path a code span names (``~`` and a final argument list dropped), or None
    when it is not one (an expression, a file name, a lone name)."""
    span = span.lstrip("~!")
    m = DOTTED.match(span)
    if not m:
        return None
    if m.end() < len(span):
        return m.group() if CALL.fullmatch(span[m.end() :]) else None
    return None if m.group().rsplit(".", 1)[1] in SUFFIXES else m.group()


def module_file(span: str) -> str | None:
    """The file of the package a span names (``run.py``, ``_exec/runner.py``,
    ``pkg/easycore/_longjobs/sinks.py``), or None when it names no file of the package."""
    if not PYFILE.fullmatch(span):
        return None
    inside = span.removeprefix("pkg/easycore/")
    first, _, rest = inside.partition("/")
    modules, _ = package_index()
    if inside != span or (first in modules if rest else first[:-3] in modules):
        return inside
    return inside if first.startswith("_") else None


def file_exists(span: str) -> bool:
    """Whether the package has a file whose path ends with ``span``."""
    return any(
        f"/{p.relative_to(PACKAGE).as_posix()}".endswith(f"/{span}") for p in PACKAGE.rglob("*.py")
    )


@cache
def package_index() -> tuple[dict[str, list[Any]], dict[str, list[type]]]:
    """Every module of the package (imported) by its last part, and every class it defines by
    its name."""
    modules: dict[str, list[Any]] = {"easycore": [easycore]}
    classes: dict[str, list[type]] = {}
    for info in pkgutil.walk_packages(easycore.__path__, "easycore."):
        module = importlib.import_module(info.name)
        modules.setdefault(info.name.rsplit(".", 1)[1], []).append(module)
    for found in list(modules.values()):
        for module in found:
            for value in vars(module).values():
                if inspect.isclass(value) and value.__module__ == module.__name__:
                    classes.setdefault(value.__name__, []).append(value)
    return modules, classes


def _instance_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``, though the class has no such attribute."""
    for base in cls.__mro__:
        if base is object:
            continue
        fields = getattr(base, "__attrs_attrs__", ())
        if name in {f.name for f in fields} or name in getattr(base, "__slots__", ()):
            return True
        if name in inspect.get_annotations(base):
            return True
        try:
            src = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{name}\s*(?::[^=\n]+)?=[^=]", src):
            return True
    return False


def _member(obj: Any, name: str) -> tuple[bool, Any]:
    """``(found, value)`` of ``obj.name``: a submodule, an attribute, an instance attribute."""
    if isinstance(obj, types.ModuleType):
        try:
            return True, importlib.import_module(f"{obj.__name__}.{name}")
        except ModuleNotFoundError:
            pass
    try:
        return True, getattr(obj, name)
    except AttributeError:
        pass
    if inspect.isclass(obj) and _instance_attribute(obj, name):
        return True, None
    return False, None


def _resolves(root: Any, parts: list[str]) -> bool:
    obj = root
    for part in parts:
        if obj is None:  # past an instance attribute: its type is not known here
            return True
        found, obj = _member(obj, part)
        if not found:
            return False
    return True


def roots(name: str, loose: bool) -> list[Any] | None:
    """What the first part of ``name`` may be in the package; None when it is not a name of
    the package. Not ``loose``, only ``easycore``, a private module and a class are."""
    first = name.split(".", 1)[0]
    if first in FOREIGN:
        return None
    modules, classes = package_index()
    found = classes.get(first, [])
    if loose or first == "easycore" or first.startswith("_"):
        found += modules.get(first, [])
    if loose and first.islower():
        found += classes.get(INSTANCES.get(first, ""), [])
        found += [cls for key, same in classes.items() if key.lower() == first for cls in same]
    return found or None


def resolves(name: str, loose: bool = True) -> bool | None:
    """Whether ``name`` names something of the package; None when it is not one of its names."""
    candidates = roots(name, loose)
    if candidates is None:
        return None
    parts = name.split(".")[1:]
    return any(_resolves(root, parts) for root in candidates)


def role_targets() -> Iterator[tuple[str, str, str]]:
    """``(where, module, target)`` for every role of a docstring whose target has no dot
    (:class:`Blame`, :meth:`start_chunk`)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for line, text in _docstrings(path):
            for m in ROLE.finditer(text):
                where = f"{path.relative_to(ROOT)}:{line}"
                yield where, module.removesuffix(".__init__"), m.group(1)


def local_name(modname: str, target: str) -> bool:
    """Whether ``target`` is a name of the module, a builtin, or a member or an instance
    attribute of a class the module defines."""
    module = importlib.import_module(modname)
    if target in vars(module) or hasattr(builtins, target):
        return True
    classes = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == modname]
    return any(hasattr(c, target) for c in classes) or any(
        _instance_attribute(c, target) for c in classes
    )


def stale_names() -> list[str]:
    """``where: name`` for every name of the package that the docs give and that does not
    resolve."""
    dotted = [
        f"{where}: {text}"
        for where, text, in_span in mentions()
        if text not in ALLOWED and verdict(text, in_span) is False
    ]
    roles = [
        f"{where}: {target} (not in {module})"
        for where, module, target in role_targets()
        if not local_name(module, target)
    ]
    return dotted + roles


def verdict(span: str, in_span: bool = True) -> bool | None:
    """Whether what ``span`` names in the package is there; None when it names nothing of the
    package. Bare prose names an instance's attribute loosely (``actor.run`` of a Ray actor
    handle, ``runner.map`` of a ``Runner``): there a name of the package starts with
    ``easycore``, a private module or a class."""
    name, path = dotted_name(span), module_file(span)
    if path:
        return file_exists(path)
    return resolves(name, in_span) if name else None


# ``(span, written in a code span)`` -> what the check makes of it: the rules above.
CASES = {
    ("easycore.common.config.CfgNode", True): True,
    ("~easycore.RunKwargs", True): True,
    ("easycore.write.parquet(...)", True): True,
    ("_exec.core.books", True): True,
    ("RunBooks.take()", True): True,
    ("runner.stats()", True): True,
    ("books.take()", True): True,
    ("hop.unit", True): True,
    ("_exec/runner.py", True): True,
    ("run.py", True): True,
    ("easycore.Runner.no_such_method", True): False,
    ("books.RunBooks.no_such_method", True): False,
    ("RunBooks.no_such_method()", True): False,
    ("_exec/no_such_module.py", True): False,
    ("_no_such_module.py", True): False,
    ("pkg/easycore/no_such_module.py", True): False,
    ("no_such_module.x", True): None,
    ("torch.load", True): None,
    ("cfg.MODEL.DEPTH", True): None,
    ("run.db", True): None,
    ("imap(..., state=s)", True): None,
    ("data[i]", True): None,
    ("script.py", True): None,
    # Written bare, ``runner.x`` may be anyone's runner; ``Runner.x`` and ``_exec.x`` are ours.
    ("runner.no_such_method", False): None,
    ("Runner.no_such_method", False): False,
    ("_exec.no_such_name", False): False,
    ("_exec.core.books.RunBooks.take()", False): True,
}

# Resolving imports every module of the package, which a test process must not do (the
# forkserver's ``preload`` wraps ``os.fork``): it runs in a fresh interpreter.
RUNNER = """
import json, test_names_resolve as t
cases = [*t.CASES, *((span, True) for span in t.ALLOWED)]
verdicts = [t.verdict(span, in_span) for span, in_span in cases]
written = sorted({text for _, text, _ in t.mentions()} & set(t.ALLOWED))
stages = "easycore._exec.core.stages"
roles = [t.local_name(stages, n) for n in ("PreparedStages", "waits", "no_such")]
print(json.dumps({"stale": t.stale_names(), "verdicts": verdicts, "written": written,
                  "roles": roles}))
"""


@pytest.fixture(scope="module")
def checked() -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", RUNNER],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    cases = [*CASES, *((span, True) for span in ALLOWED)]
    result["verdicts"] = dict(zip(cases, result.pop("verdicts"), strict=True))
    return result


def test_every_name_in_the_docs_resolves(checked):
    """A dotted name of the package, in a docstring, ``ARCHITECTURE.md`` or a page, names a
    module, class, function or attribute that exists (a module's file, a file that exists)."""
    stale = checked["stale"]
    assert not stale, "names that do not resolve (renamed or moved?):\n" + "\n".join(stale)


def test_allowed_names_are_still_needed(checked):
    """Each exception of ``ALLOWED`` has a reason, still occurs and still does not resolve."""
    for span, reason in ALLOWED.items():
        assert reason
        assert span in checked["written"], f"{span} is no longer in the docs: drop it"
        assert checked["verdicts"][span, True] is False, f"{span} resolves now: drop it"


@pytest.mark.parametrize(("case", "expected"), CASES.items(), ids=[s for s, _ in CASES])
def test_what_the_check_sees(checked, case, expected):
    """Which spans are names of the package, and that a missing name is seen."""
    assert checked["verdicts"][case] is expected


def test_a_role_names_its_own_module(checked):
    """:class:`PreparedStages` and :attr:`waits` (an instance attribute) in ``stages``
    resolve, a name missing from the module does not."""
    assert checked["roles"] == [True, True, False]


def test_bare_names_leave_urls_paths_and_strings_alone():
    """A dotted path in prose is a name only outside a URL, a path and quotes."""
    found = BARE.findall("see https://docs.ray.io/x.html, 'a.b' and Run.wait(), or x/y.z")
    assert found == ["Run.wait()"]


def test_the_package_never_mentions_api_md():
    """No docstring or comment of the package points at ``API.md``: users do not have it
    (the site has ``docs/contract.md``)."""
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "API.md" in line
    ]
    assert not found, f"mentions API.md: {found}"
