"""The import layering, read from the source (every import statement, function-level ones too):

- `asyncinfer/` (shared code, the SDK, the client CLI) never imports `services/`;
- the three services never import one another (they talk through NATS and gRPC only);
- no service imports what launches the services (`asyncinfer up`, the command, the apps by name);
- the pure core (the job and batch lifecycle, the domain's forms, the queue snapshots and their
  merge, the contract and the codecs) reaches no adapter, not even through others: no NATS, gRPC
  server, protobuf, HTTP, SDK, CLI or service;
- no module imports itself back through others (no import cycle at all).

Generated stubs (asyncinfer/v1) are leaves: they are not parsed, imports of them are kept.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("asyncinfer", "services")
GENERATED = ROOT / "asyncinfer" / "v1"
GENERATED_PACKAGE = "asyncinfer.v1"
SERVICES = ("services.gateway", "services.scheduler", "services.batcher", "services.console")
# What starts the services: the `asyncinfer` command, `asyncinfer up` and the apps it makes by name.
LAUNCHERS = (
    "services.apps",
    "services.cli",
    "services.entry",
    "services.up",
    "services.dev_ca",
    "services.server_extras",
)
# Functions of their inputs, no I/O: what the services decide with, tested without a server.
PURE_CORE = (
    "asyncinfer.lifecycle",
    "asyncinfer.jobs",
    "asyncinfer.job_errors",
    "asyncinfer.batches",
    "asyncinfer.batch_plans",
    "asyncinfer.errors",
    "asyncinfer.tensors",
    "asyncinfer.contract",
    "asyncinfer.drain_orders",
    "asyncinfer.pipelines",
    "asyncinfer.queues",
    "asyncinfer.snapshot_merge",
    "asyncinfer.snapshot_freshness",
    "asyncinfer.codecs",
)
# Ours: the NATS adapter, the generated protobuf and gRPC stubs, the gRPC server's pieces, the SDK,
# the CLI and the services. Theirs (a dotted prefix of what is imported): the same kinds of I/O.
ADAPTERS = (
    "asyncinfer.nats",
    "asyncinfer.v1",
    "asyncinfer.grpc_server",
    "asyncinfer.grpc_errors",
    "asyncinfer.grpc_handlers",
    "asyncinfer.client",
    "asyncinfer.commands",
    "asyncinfer.cli",
    "services",
)
IO_PACKAGES = ("nats", "aiohttp", "google.protobuf", "grpc.aio", "grpc_health")


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
    (`services.batcher.backends.Arrays` is the package); a generated stub by its own name (its
    package is not read, so the longest prefix would be `asyncinfer`)."""
    if _in(name, GENERATED_PACKAGE):
        return name
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
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        for name in names:
            if _is_internal(name):
                imported = _resolve(name, modules)
                if imported != module:
                    yield Edge(module, imported, where)


def _external_imports(path: Path) -> Iterator[tuple[str, int]]:
    """Each absolute import of a package not ours, as the dotted names it takes (`from grpc import
    aio`: grpc.aio), with its line."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if not _is_internal(name):
                yield name, node.lineno


def _reached(edges: Iterable[Edge], roots: set[str]) -> dict[str, Edge | None]:
    """Every module the roots import, straight or through others, each with the import that first
    reached it (None for a root)."""
    successors: dict[str, list[Edge]] = {}
    for edge in edges:
        successors.setdefault(edge.importer, []).append(edge)
    reached: dict[str, Edge | None] = dict.fromkeys(roots)
    work = sorted(roots)
    while work:
        for edge in successors.get(work.pop(), []):
            if edge.imported not in reached:
                reached[edge.imported] = edge
                work.append(edge.imported)
    return reached


def _path_to(reached: dict[str, Edge | None], module: str) -> str:
    chain = []
    edge = reached[module]
    while edge is not None:
        chain.append(str(edge))
        edge = reached[edge.importer]
    return " <- ".join(chain)


@functools.cache
def _graph() -> tuple[Edge, ...]:
    """Read once per test process, the tests sharing it (each took seconds of CPU to parse every module)."""
    sources = _sources()
    modules = set(sources)
    edges = {edge for module, path in sources.items() for edge in _imports(module, path, modules)}
    return tuple(sorted(edges, key=str))


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _strongly_connected(edges: Iterable[Edge]) -> list[set[str]]:
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
    # An import of a generated stub is kept by the stub's name.
    assert any(e.importer == "asyncinfer.blobs" and e.imported == "asyncinfer.v1.tensor_pb2" for e in edges)
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


def test_the_services_never_import_their_launchers() -> None:
    upward = [
        e
        for e in _graph()
        for service in SERVICES
        for launcher in LAUNCHERS
        if _in(e.importer, service) and _in(e.imported, launcher)
    ]
    assert not upward, "a service imports what launches it:" + _report(upward)


def test_the_pure_core_reaches_no_adapter() -> None:
    sources = _sources()
    core = {m for m in sources for package in PURE_CORE if _in(m, package)}
    assert core >= set(PURE_CORE), f"not modules: {sorted(set(PURE_CORE) - core)}"
    reached = _reached(_graph(), core)
    adapters = {module for module in reached if any(_in(module, adapter) for adapter in ADAPTERS)}
    found = [f"{module}: {_path_to(reached, module)}" for module in sorted(adapters)]
    # The I/O packages an adapter imports are its business; a core module's, or a helper's, are not.
    found += [
        f"{name} ({sources[module].relative_to(ROOT)}:{line}){' <- ' + _path_to(reached, module) if reached[module] else ''}"
        for module in sorted(set(reached) - adapters)
        if module in sources
        for name, line in _external_imports(sources[module])
        if any(_in(name, package) for package in IO_PACKAGES)
    ]
    assert not found, "the pure core reaches an adapter:\n  " + "\n  ".join(found)


def test_the_reach_is_followed_through_other_modules() -> None:
    edges = [Edge("core", "middle", "x:1"), Edge("middle", "asyncinfer.nats.kv", "x:2"), Edge("other", "core", "x:3")]
    reached = _reached(edges, {"core"})
    assert set(reached) == {"core", "middle", "asyncinfer.nats.kv"}
    assert _path_to(reached, "asyncinfer.nats.kv") == "middle -> asyncinfer.nats.kv (x:2) <- core -> middle (x:1)"


def test_there_is_no_import_cycle() -> None:
    edges = _graph()
    cycles = [component for component in _strongly_connected(edges) if len(component) > 1]
    in_cycles = [e for e in edges for c in cycles if e.importer in c and e.imported in c]
    assert not cycles, f"{len(cycles)} import cycle(s); the edges inside them:" + _report(in_cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    edges = [Edge("a", "b", "x:1"), Edge("b", "c", "x:2"), Edge("c", "a", "x:3"), Edge("c", "d", "x:4")]
    assert sorted(map(sorted, _strongly_connected(edges))) == [["a", "b", "c"], ["d"]]
