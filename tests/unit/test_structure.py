"""The package's layering: no import cycles, no module reaching into another's private names,
engine-neutral modules importing no engine, and folders small enough to read.

Read from the source with ``ast`` (nothing is imported), imports inside functions and under
``TYPE_CHECKING`` included: a cycle hidden in a function is still a cycle, and an engine named
in a neutral module's annotations is still a dependency on that engine.

The layers (ARCHITECTURE.md): the engines are ``_exec/process/`` (worker processes),
``_exec/ray/`` (Ray actors) and ``_exec/inline.py`` (the calling process). Every other module
is engine-neutral and imports none of them, except the runner, which picks an engine; an
engine imports no other engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import easycore

ROOT = Path(easycore.__file__).parent

# Where each engine lives (a package, or one module).
ENGINES = {
    "process": "easycore._exec.process",
    "ray": "easycore._exec.ray",
    "inline": "easycore._exec.inline",
}
# The modules that pick an engine for a run: the only neutral ones that may import engines.
PICKERS = {"easycore._exec.runner"}
# Modules per folder at most (``__init__`` not counted): a folder is read as a whole.
MOST_PER_FOLDER = 12


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


def _engine(module: str) -> str | None:
    """The engine a module belongs to, or None for an engine-neutral one."""
    for name, root in ENGINES.items():
        if module == root or module.startswith(f"{root}."):
            return name
    return None


def _layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Imports across the layers: a neutral module (not a picker) importing an engine, an
    engine importing another engine."""
    out = []
    for mod, targets in sorted(graph.items()):
        mine = _engine(mod)
        for target in sorted(targets):
            theirs = _engine(target)
            if theirs is None or theirs == mine or (mine is None and mod in PICKERS):
                continue
            what = "engine-neutral" if mine is None else f"the {mine} engine's"
            out.append(f"{mod} ({what}) imports {target} (the {theirs} engine)")
    return out


def _crowded(modules: dict[str, Path]) -> dict[str, int]:
    """Folders of the package holding more than ``MOST_PER_FOLDER`` modules."""
    count: dict[str, int] = {}
    for path in modules.values():
        if path.name != "__init__.py":
            folder = path.parent.relative_to(ROOT.parent).as_posix()
            count[folder] = count.get(folder, 0) + 1
    return {folder: n for folder, n in count.items() if n > MOST_PER_FOLDER}


class TestLayering:
    def test_the_checker_sees_the_package(self):
        """The analysis finds easycore's modules and their imports (so an empty pass means
        something)."""
        modules = _modules()
        graph, _ = _imports(modules)
        assert "easycore._exec.process.run" in modules
        assert "easycore._exec.core.books" in graph["easycore._exec.process.run"]
        assert {_engine(m) for m in modules} == {None, *ENGINES}

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
        (the runner, and the sharded map of ``distributed=True``) and ``_errors``, whose
        ``surfaced`` its entry points raise through."""
        graph, _ = _imports(_modules())
        allowed = {
            "easycore._inject",
            "easycore._options",
            "easycore._exec.runner",
            "easycore._exec.sharded",
            "easycore._errors",
        }
        assert graph["easycore._pipeline"] <= allowed


class TestArchitecture:
    def test_the_checker_finds_a_breach(self):
        """A made-up graph's imports across the layers are reported, and only those."""
        graph = {
            "easycore._exec.core.books": {"easycore._exec.process.workers"},
            "easycore._exec.ray.run": {"easycore._exec.core.books", "easycore._exec.inline"},
            "easycore._exec.process.run": {"easycore._exec.process.workers"},
            "easycore._exec.runner": {"easycore._exec.ray.engine"},
        }
        assert _layer_breaches(graph) == [
            "easycore._exec.core.books (engine-neutral) imports easycore._exec.process.workers"
            " (the process engine)",
            "easycore._exec.ray.run (the ray engine's) imports easycore._exec.inline"
            " (the inline engine)",
        ]

    def test_neutral_modules_import_no_engine(self):
        """Only the runner picks an engine: the run core, the long-job wrappers, the stages,
        the options import no engine; no engine imports another (a process worker's module
        in a Ray actor, or Ray in the process engine, would be a bug waiting)."""
        graph, _ = _imports(_modules())
        assert _layer_breaches(graph) == []

    def test_no_crowded_folder(self):
        """No folder of the package holds more than ``MOST_PER_FOLDER`` modules."""
        assert _crowded(_modules()) == {}
