"""The import layering, read from the source (every import statement, function-level ones too):

- `asyncinfer/` (shared code, the SDK, the client CLI) never imports `services/`;
- the three services never import one another (they talk through NATS and gRPC only);
- no module imports itself back through others (no import cycle at all).

Generated stubs (asyncinfer/v1) are leaves: they are not parsed, imports of them are kept.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("asyncinfer", "services")
GENERATED = ROOT / "asyncinfer" / "v1"
SERVICES = ("services.gateway", "services.scheduler", "services.batcher", "services.console")


@dataclass(frozen=True, slots=True)
class Edge:
    importer: str
    imported: str
    where: str  # path:line of the import statement

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.where})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GENERATED not in path.parents:
                found[_module_name(path)] = path
    return found


def _is_internal(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _resolve(name: str, modules: set[str]) -> str:
    """The module an imported dotted name stands for: the longest prefix that is a module of ours
    (`services.batcher.backends.Arrays` is the package)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return name  # a generated stub, or a module that does not exist (the import would fail anyway)


def _imports(module: str, path: Path, modules: set[str]) -> Iterator[Edge]:
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if _is_internal(name):
                imported = _resolve(name, modules)
                if imported != module:
                    yield Edge(module, imported, where)


def _graph() -> list[Edge]:
    sources = _sources()
    modules = set(sources)
    edges = {edge for module, path in sources.items() for edge in _imports(module, path, modules)}
    return sorted(edges, key=str)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _strongly_connected(edges: list[Edge]) -> list[set[str]]:
    """Tarjan's algorithm, iterative."""
    successors: dict[str, set[str]] = {}
    for edge in edges:
        successors.setdefault(edge.importer, set()).add(edge.imported)
        successors.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(successors):
        if root in index:
            continue
        work = [(root, iter(sorted(successors[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(successors[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _report(edges: list[Edge]) -> str:
    return "\n  " + "\n  ".join(sorted(str(edge) for edge in edges))


def test_the_graph_is_read_from_the_source() -> None:
    edges = _graph()
    # A known import at module level and one inside a function: the walk sees both.
    assert any(e.importer == "services.scheduler.app" and e.imported == "services.scheduler.dispatcher" for e in edges)
    assert any(e.importer == "services.apps" and e.imported == "services.batcher.app" for e in edges)
    assert len({e.importer for e in edges}) > 50


def test_asyncinfer_never_imports_services() -> None:
    upward = [e for e in _graph() if _in(e.importer, "asyncinfer") and _in(e.imported, "services")]
    assert not upward, "asyncinfer/ imports services/:" + _report(upward)


def test_the_services_never_import_one_another() -> None:
    across = [
        e
        for e in _graph()
        for importer in SERVICES
        for imported in SERVICES
        if importer != imported and _in(e.importer, importer) and _in(e.imported, imported)
    ]
    assert not across, "one service imports another:" + _report(across)


def test_there_is_no_import_cycle() -> None:
    edges = _graph()
    cycles = [component for component in _strongly_connected(edges) if len(component) > 1]
    in_cycles = [e for e in edges for c in cycles if e.importer in c and e.imported in c]
    assert not cycles, f"{len(cycles)} import cycle(s); the edges inside them:" + _report(in_cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    edges = [Edge("a", "b", "x:1"), Edge("b", "c", "x:2"), Edge("c", "a", "x:3"), Edge("c", "d", "x:4")]
    assert sorted(map(sorted, _strongly_connected(edges))) == [["a", "b", "c"], ["d"]]
