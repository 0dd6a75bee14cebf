"""The package's shape: no import cycles (function-level imports included), layers respected."""

from __future__ import annotations

import ast
import pathlib

import daskps

ROOT = pathlib.Path(daskps.__file__).parent

# Each layer may import only from the layers before it (and from itself).
LAYERS = ["errors", "_core", "ps", "ui", "distribute", "variables", "training", "coordinator"]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str) -> set[str]:
    """Every daskps module ``path`` imports, anywhere in it (functions included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in _imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_import_graph_has_no_cycle():
    assert _cycle(import_graph()) is None, " -> ".join(_cycle(import_graph()) or [])


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_only_layers_below():
    wrong = []
    for module, deps in import_graph().items():
        mine = _layer(module)
        if mine is None:
            continue  # the package itself, its public facades, the demo and the CLI sit on top
        wrong += [f"{module} -> {d}" for d in deps if (_layer(d) is None and d != "daskps") or (_layer(d) or 0) > mine]
    assert not wrong, wrong


# What both ends of a message share: the operations and the table kinds (numpy and the core only).
SHARED = {"daskps.ps", "daskps.ps.ops", "daskps.ps.tables"}


def _server_side(module: str) -> bool:
    return module.startswith("daskps._core") or module == "daskps.errors" or module in SHARED


def test_the_server_imports_nothing_from_the_client_side():
    graph = import_graph()
    for module in ("daskps.ps.server", "daskps.ps.ops", "daskps.ps.tables"):
        assert all(_server_side(d) for d in graph[module]), (module, graph[module])


def test_only_the_transport_talks_to_dask_comms():
    talkers = [name for name, path in ((_module_name(p), p) for p in ROOT.rglob("*.py"))
               if "send_recv" in path.read_text() or "actor_execute" in path.read_text()]
    assert talkers == ["daskps.ps.transport"], talkers
