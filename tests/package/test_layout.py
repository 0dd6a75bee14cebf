"""The package's shape: no import cycles (function-level imports included), layers respected."""

from __future__ import annotations

import ast
import pathlib

import daskps
from tests.helpers.paths import TESTS

ROOT = pathlib.Path(daskps.__file__).parent

# Each layer may import only from the layers before it (and from itself).
LAYERS = ["errors", "_core", "server", "client", "scheduler", "distribute", "variables", "training", "trainer",
          "coordinator", "keras", "ui"]


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


# -- which process runs what ------------------------------------------------------------------
# A package per process. Code of one process reaches another's only through the modules that
# package offers (its messages and the entry points Dask needs). ``client`` is how any process
# reaches the servers: every process uses it, and it obeys the same rule towards ``server``.
PROCESSES = ("server", "client", "scheduler", "trainer", "coordinator")
OFFERED = {
    "daskps.server.ops": "the operations a server runs, the tables they make, and the records it answers",
    "daskps.server.actor": "the class Dask starts as a server, and how its answers travel through Dask",
    "daskps.server.local": "the server of local variables, run in the caller's own process",
    "daskps.server.compact": "a training step's operations and answers, encoded for a direct channel",
    "daskps.scheduler.messages": "the plugin's handlers, event topics, requests and answers",
    "daskps.trainer.messages": "the task a batch runs, and the dataset function from_dask stores",
}
# Code of another process imported for a reason the messages cannot carry: (importer, imported, why).
CROSSINGS_ALLOWED = [
    ("daskps.coordinator.coordinator", "daskps.trainer.datasets",
     "a PerWorkerDataset is one object in both processes (made here, its iterators resolved on trainers), "
     "as TensorFlow's"),
    ("daskps.coordinator.closures", "daskps.trainer.datasets",
     "schedule() refuses a PerWorkerDataset passed where its iterator belongs, by its class"),
]


def _process(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in PROCESSES else None


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one process package into another that it does not offer (nor CROSSINGS_ALLOWED)."""
    allowed = {(a, b) for a, b, _ in CROSSINGS_ALLOWED}
    wrong = []
    for module, deps in graph.items():
        mine = _process(module)
        if mine is None:
            continue
        for dep in deps:
            theirs = _process(dep)
            if theirs not in (None, mine, "client") and dep not in OFFERED and (module, dep) not in allowed:
                wrong.append(f"{module} -> {dep}")
    return sorted(wrong)


def test_a_process_reaches_another_only_through_what_it_offers():
    assert crossings(import_graph()) == []
    graph = import_graph()
    assert all(b in graph.get(a, ()) for a, b, _ in CROSSINGS_ALLOWED), "an allowed crossing no longer exists"


def test_a_forbidden_crossing_is_refused():
    graph = import_graph()
    graph["daskps.trainer.batches"] = graph["daskps.trainer.batches"] | {"daskps.coordinator.coordinator"}
    graph["daskps.client.protocol"] = graph["daskps.client.protocol"] | {"daskps.server.tables"}
    assert crossings(graph) == ["daskps.client.protocol -> daskps.server.tables",
                                "daskps.trainer.batches -> daskps.coordinator.coordinator"]


def test_the_server_imports_only_the_core_and_errors():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("daskps.server"):
            wrong = [d for d in deps if not d.startswith(("daskps._core", "daskps.server")) and d != "daskps.errors"]
            assert not wrong, (module, wrong)


def _external_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_no_server_module_imports_dasks_client():
    for path in (ROOT / "server").rglob("*.py"):
        wrong = [m for m in _external_imports(path)
                 if m.startswith(("distributed.client", "distributed.Client", "distributed.get_client",
                                  "distributed.default_client", "distributed.Future"))]
        assert not wrong, (path.name, wrong)


def test_ui_is_imported_only_from_the_top():
    for module, deps in import_graph().items():
        if module.startswith("daskps.ui"):
            continue
        if any(d == "daskps.ui" or d.startswith("daskps.ui.") for d in deps):
            assert _layer(module) is None, f"{module} imports daskps.ui"


def test_only_the_transport_talks_to_dask_comms():
    talkers = [name for name, path in ((_module_name(p), p) for p in ROOT.rglob("*.py"))
               if "send_recv" in path.read_text() or "actor_execute" in path.read_text()]
    assert talkers == ["daskps.client.transport"], talkers


# -- how modules hold each other -------------------------------------------------------------
# Private names read through another object or module where Dask offers nothing public: (module, name, why).
# Keras 3 has no public way to do what dps.keras must do as Keras' own fit does it:
PRIVATE_READS_ALLOWED: list[tuple[str, str, str]] = [
    ("daskps.keras.backend", "_symbolic_build", "Keras builds compiled metrics from a first batch only this way"),
    ("daskps.keras.program", "_update_metrics_variables", "the JAX trainer's stateless metric update"),
    ("daskps.keras.loop", "_initial_epoch", "BackupAndRestore's resume epoch, set in on_train_begin"),
    ("daskps.keras.loop", "_flatten_metrics_in_order", "evaluate's list of results, in Keras' order"),
    ("daskps.keras.optimizer", "_exclude_from_weight_decay", "what exclude_from_weight_decay set (refused)"),
    ("daskps.keras.optimizer", "_exclude_from_weight_decay_pattern", "the same, by name"),
]
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make"}  # public, despite the underscore


def _own_names(cls: ast.ClassDef) -> set[str]:
    """The names a class defines: its methods and class attributes, and what it sets on ``self``."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return names


def _private(name: str) -> bool:
    display_protocol = name.startswith("_repr_") and name.endswith("_")  # IPython's rich display: public
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API and not display_protocol


def private_reads(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each private name read through another object or module.

    Allowed: through ``self``/``cls``; inside a class, names that class defines
    (a class reading its own instances). Counted: ``obj._name``,
    ``getattr(obj, "_name")`` / ``hasattr``, ``from module import _name``.
    """
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, own: frozenset[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own = own | _own_names(node)
        if (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)
              and node.args[1].value not in own
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("daskps"):
            found.extend((node.lineno, f"from {node.module} import {a.name}") for a in node.names if _private(a.name))
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(ast.parse(source), frozenset())
    return found


def test_no_private_reads_through_other_objects():
    allowed = {(module, name) for module, name, _ in PRIVATE_READS_ALLOWED}
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for line, text in private_reads(path.read_text()):
            if (module, text.rsplit(".", 1)[-1]) not in allowed:
                wrong.append(f"{module}:{line}: {text}")
    assert not wrong, "\n".join(wrong)
    assert len(PRIVATE_READS_ALLOWED) <= 20


# Private names the tests read where nothing public gives the same: (file under tests/, name, why).
# Everything of daskps' own a test needs has a public name (a property, a method, a helper).
TEST_PRIVATE_READS_ALLOWED: list[tuple[str, str, str]] = [
    ("tests/conftest.py", "_fixturemanager",
     "pytest offers no public way to the fixture definitions a test uses (to see which start a process)"),
    ("tests/coordinator/test_ctrl_c.py", "_exit",
     "os._exit: a forked child must end at once, running none of pytest's cleanup (sys.exit would)"),
    ("tests/mutation/run_by_lines.py", "_exit", "os._exit: the same, in a mutant's forked child"),
]


def _read_name(text: str) -> str:
    """The private name in a ``private_reads`` text: ``a.b._x``, ``getattr(a, '_x')``, ``from m import _x``."""
    if text.startswith("from "):
        return text.rsplit(" ", 1)[-1]
    node = ast.parse(text, mode="eval").body
    if isinstance(node, ast.Call):
        arg = node.args[1]
        assert isinstance(arg, ast.Constant)
        return str(arg.value)
    assert isinstance(node, ast.Attribute)
    return node.attr


def test_tests_read_no_private_names():
    """Tests check daskps through the names it offers (issue 42): no private attribute of another object,
    nor a private name imported from daskps; the few of other libraries' are listed, each with its reason."""
    allowed = {(path, name) for path, name, _ in TEST_PRIVATE_READS_ALLOWED}
    wrong, used = [], set()
    for path in sorted(TESTS.rglob("*.py")):
        where = path.relative_to(TESTS.parent).as_posix()
        for line, text in private_reads(path.read_text()):
            if (where, _read_name(text)) in allowed:
                used.add((where, _read_name(text)))
            else:
                wrong.append(f"{where}:{line}: {text}")
    assert not wrong, "\n".join(wrong)
    assert used == allowed, f"allowed, but no longer read: {sorted(allowed - used)}"
    assert len(TEST_PRIVATE_READS_ALLOWED) <= 8


def test_read_name_finds_the_name_in_each_form():
    assert [_read_name(t) for t in ("a.b._x", "getattr(a, '_y', None)", "hasattr(a, '_z')",
                                    "from daskps.m import _w")] == ["_x", "_y", "_z", "_w"]


def test_private_read_finder_finds_each_form():
    source = """
import daskps.x
from daskps.y import _hidden
class A:
    def __init__(self):
        self._mine = 1
    def same(self, other):
        return other._mine, self._mine, other._theirs
def outside(a, p):
    return a._mine, getattr(a, "_x", None), hasattr(a, "_y"), p._replace(b=1)
"""
    assert [t for _, t in private_reads(source)] == [
        "from daskps.y import _hidden", "other._theirs", "a._mine", "getattr(a, '_x', None)", "hasattr(a, '_y')"]


# Names that every kind of object has (containers, strings, buffers, files, futures): a call to one
# says nothing about which layer's object it is.
_COMMON = set().union(*(dir(t) for t in (dict, list, set, str, bytes, memoryview, object, type(None))),
                      {"result", "exception", "done", "cancel", "read", "write", "flush", "close", "join",
                       "group", "wait", "get", "items", "values", "keys", "copy", "update", "index"})


def _methods_by_layer() -> dict[str, set[int]]:
    """Each method name defined in a class of a layer, and the layers that define one."""
    found: dict[str, set[int]] = {}
    for path in ROOT.rglob("*.py"):
        layer = _layer(_module_name(path))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.setdefault(item.name, set()).add(-1 if layer is None else layer)
    return found


def upward_calls(source: str, layer: int, methods: dict[str, set[int]]) -> list[str]:
    """Calls ``obj.name(...)`` on an object handed down to a module of ``layer`` where ``name`` is a
    method only classes of later layers define (a lower layer calling up into a higher one)."""
    tree = ast.parse(source)
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    wrong = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, target = node.func.attr, node.func.value
        if name in _COMMON or (isinstance(target, ast.Name) and (target.id in ("self", "cls") or target.id in modules)):
            continue
        layers = methods.get(name, set())
        if layers and min(layers) > layer:
            wrong.append(f"{node.lineno}: {ast.unparse(node.func)}")
    return wrong


def test_no_layer_calls_up_through_objects_handed_down():
    methods = _methods_by_layer()
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        layer = _layer(module)
        if layer is not None:
            wrong += [f"{module}:{w}" for w in upward_calls(path.read_text(), layer, methods)]
    assert not wrong, "\n".join(wrong)


def test_upward_call_finder_finds_one():
    methods = {"schedule": {LAYERS.index("coordinator")}, "numpy": {LAYERS.index("variables")}}
    source = "def save(coordinator, v):\n    coordinator.schedule(f)\n    return v.numpy()\n"
    assert upward_calls(source, LAYERS.index("training"), methods) == ["2: coordinator.schedule"]


def test_no_test_module_imports_another():
    """Helpers the test modules share live in tests/helpers, not in another test module nor in conftest.py
    (which holds fixtures, found by pytest)."""
    import ast
    import pathlib

    here = pathlib.Path(__file__).resolve().parents[1]
    for path in sorted(here.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                last = module.lstrip(".").split(".")[-1]
                assert not last.startswith("test_") and last != "conftest", (path.name, module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.split(".")[-1].startswith(("test_", "conftest")), (path.name, alias.name)
