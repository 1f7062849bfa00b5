"""The package's layering: no import cycles, no module reaching into another's private names.

Read from the source with ``ast`` (nothing is imported), imports inside functions and under
``TYPE_CHECKING`` included: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import easycore

ROOT = Path(easycore.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _imports(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> easycore modules it imports, imports of another module's _names)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "easycore":
                        target = _owner(alias.name, modules)
                        if target and target != mod:
                            graph[mod].add(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                if base_name.split(".")[0] != "easycore":
                    continue
                for alias in node.names:
                    full = f"{base_name}.{alias.name}"
                    if full in modules:  # a submodule
                        if full != mod:
                            graph[mod].add(full)
                        continue
                    target = _owner(base_name, modules)
                    if target and target != mod:
                        graph[mod].add(target)
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            private.append(
                                f"{mod}:{node.lineno} imports {alias.name} from {target}"
                            )
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


class TestLayering:
    def test_the_checker_sees_the_package(self):
        """The analysis finds easycore's modules and their imports (so an empty pass means
        something)."""
        modules = _modules()
        graph, _ = _imports(modules)
        assert "easycore._exec.run" in modules
        assert "easycore._exec.scheduler" in graph["easycore._exec.run"]

    def test_the_checker_finds_a_cycle(self):
        """A cycle in a made-up graph is reported."""
        assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]

    def test_no_import_cycles(self):
        """Dependencies point one way: no module imports (even lazily) one that imports it."""
        graph, _ = _imports(_modules())
        assert _cycles(graph) == []

    def test_no_imports_of_private_names(self):
        """No module imports another module's underscore names."""
        _, private = _imports(_modules())
        assert private == []

    def test_pipeline_only_describes(self):
        """``_pipeline`` depends on nothing that runs work but the entry points of ``_exec``
        (and ``_errors``, whose ``surfaced`` its entry points raise through)."""
        graph, _ = _imports(_modules())
        allowed = {"easycore._inject", "easycore._options", "easycore._exec", "easycore._errors"}
        assert graph["easycore._pipeline"] <= allowed
