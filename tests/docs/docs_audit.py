"""What the documentation promises about the code, checked without building the site.

``public_objects()`` lists every public name of the public modules (their ``__all__``) and
the public methods and properties of the public classes; ``docstring_problems()`` says, for
one of them, what its docstring lacks (Google style: ``Args:`` naming every parameter,
``Returns:``/``Yields:`` when it returns something, ``Raises:`` when its body raises);
``reference_targets()`` collects the ``::: name`` directives of the Markdown pages.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

PUBLIC_MODULES = [
    "easycore",
    "easycore.distributed",
    "easycore.common",
    "easycore.common.config",
    "easycore.common.parallel",
    "easycore.common.registry",
    "easycore.torch",
    "easycore.torch.parallel",
]

# Names that are data, not code: nothing to document beyond the page that lists them.
DATA_NAMES = {"easycore.__version__"}

SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Yields|Raises|Attributes)\s*:\s*$")


def public_names() -> list[tuple[str, Any]]:
    """``(dotted name, object)`` for every name of a public module's ``__all__``."""
    out = []
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        for name in module.__all__:
            qual = f"{modname}.{name}"
            if qual not in DATA_NAMES:
                out.append((qual, getattr(module, name)))
    return out


def public_objects() -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted name, object)`` for every public module and name, and the public
    methods and properties of public classes (a class exported twice: once)."""
    names = public_names()
    public_classes = {id(obj) for _, obj in names if inspect.isclass(obj)}
    for modname in PUBLIC_MODULES:
        yield modname, importlib.import_module(modname)
    seen: set[int] = set()
    for qual, obj in names:
        yield qual, obj
        if inspect.isclass(obj) and id(obj) not in seen:
            seen.add(id(obj))
            yield from class_members(qual, obj, public_classes)


def class_members(qual: str, cls: type, public_classes: set[int]) -> Iterator[tuple[str, Any]]:
    """The public methods and properties ``cls`` defines, or inherits from easycore's private
    bases (a public base documents its own members, and the reference renders them there)."""
    names: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        if not base.__module__.startswith("easycore"):
            continue
        if base is not cls and id(base) in public_classes:
            continue
        for name, value in vars(base).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, (types.FunctionType, property)):
                names[name] = value
    for name, value in sorted(names.items()):
        yield f"{qual}.{name}", value


def own_doc(obj: Any) -> str:
    """The object's own docstring (never a base class's)."""
    if isinstance(obj, property):
        doc = obj.__doc__ or (obj.fget.__doc__ if obj.fget else None)
    elif inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
    else:
        doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if doc else ""


def sections(doc: str) -> dict[str, str]:
    """Google-style sections of a docstring: ``{"Args": body, ...}``."""
    out: dict[str, str] = {}
    current = None
    for line in doc.splitlines():
        m = SECTION.match(line)
        if m and not line.startswith(" "):
            current = {"Arguments": "Args", "Parameters": "Args"}.get(m.group(1), m.group(1))
            out[current] = ""
        elif current is not None:
            if line and not line.startswith(" "):
                current = None
            else:
                out[current] += line + "\n"
    return out


def documented_params(body: str) -> set[str]:
    """The parameter names an ``Args:`` section describes."""
    names = set()
    for line in body.splitlines():
        m = re.match(r"^    (\**\w+)\s*(\([^)]*\))?\s*:", line)
        if m:
            names.add(m.group(1).lstrip("*"))
    return names


def _function(obj: Any) -> types.FunctionType | None:
    if isinstance(obj, property):
        return None
    fn = inspect.unwrap(obj) if callable(obj) else obj
    return fn if isinstance(fn, types.FunctionType) else None


def _raises(fn: types.FunctionType) -> bool:
    """Whether the function's own body raises an exception it names (not a bare re-raise)."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    todo = list(ast.iter_child_nodes(ast.parse(src).body[0]))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue  # a nested function raises in its own calls
        if isinstance(node, ast.Raise) and node.exc is not None:
            return True
        todo.extend(ast.iter_child_nodes(node))
    return False


def params_of(fn: types.FunctionType, *, skip_first: bool) -> list[str]:
    """The parameters a caller passes (``self``/``cls`` left out)."""
    params = list(inspect.signature(fn).parameters.values())
    if skip_first and params and params[0].name in ("self", "cls"):
        params = params[1:]
    return [p.name for p in params if not p.name.startswith("_")]


def docstring_problems(qual: str, obj: Any) -> list[str]:
    """What the docstring of ``obj`` lacks; empty when it is complete."""
    doc = own_doc(obj)
    if not doc:
        return ["no docstring"]
    if isinstance(obj, (types.ModuleType, property)):
        return []
    problems = []
    secs = sections(doc)
    if inspect.isclass(obj):
        init = obj.__dict__.get("__init__")
        if isinstance(init, types.FunctionType) and init.__module__.startswith("easycore"):
            wanted = params_of(init, skip_first=True)
            described = documented_params(secs.get("Args", "") + secs.get("Attributes", ""))
            missing = set(wanted) - described
            if missing:
                problems.append(f"Args: lacks {sorted(missing)}")
        return problems
    fn = _function(obj)
    if fn is None:
        return problems
    wanted = params_of(fn, skip_first="." in fn.__qualname__)
    missing = set(wanted) - documented_params(secs.get("Args", ""))
    if missing:
        problems.append(f"Args: lacks {sorted(missing)}")
    ret = inspect.signature(fn).return_annotation
    returns_something = ret not in (inspect.Signature.empty, None, "None", "NoReturn")
    if returns_something and "Returns" not in secs and "Yields" not in secs:
        problems.append("no Returns:")
    if _raises(fn) and "Raises" not in secs:
        problems.append("no Raises:")
    return problems


def markdown_pages() -> list[Path]:
    """Every Markdown page of the site, and the README."""
    return [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]


def reference_targets() -> set[str]:
    """The dotted names the pages render with mkdocstrings' ``::: name``."""
    names = set()
    for page in sorted(DOCS.rglob("*.md")):
        for m in re.finditer(r"^::: ([\w.]+)\s*$", page.read_text(), re.MULTILINE):
            names.add(m.group(1))
    return names


if __name__ == "__main__":
    bad = 0
    for qual, obj in public_objects():
        for problem in docstring_problems(qual, obj):
            print(f"{qual}: {problem}")
            bad += 1
    print(bad, "problems")
