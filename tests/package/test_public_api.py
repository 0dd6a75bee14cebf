import daskps as dps
from daskps import errors
from tests.helpers.paths import ROOT

SPEC_NAMES = {
    "LocalPSCluster", "DaskClusterResolver", "ParameterServerStrategy", "get_strategy",
    "has_strategy", "in_cross_replica_context", "get_replica_context", "ReplicaContext",
    "ReduceOp", "InputContext", "ValueContext", "RunOptions", "InputOptions", "Variable",
    "read_values", "ClusterCoordinator", "RemoteValue", "PerWorkerValues", "errors",
    "IndexedSlices", "ShardedVariable", "embedding_lookup", "partitioners", "create_partitioned_variables",
    "create_variables",
}


def test_all_is_sorted():
    assert dps.__all__ == sorted(dps.__all__)


def test_all_names_exist():
    for name in dps.__all__:
        assert hasattr(dps, name), name


def test_spec_names_are_exported():
    assert SPEC_NAMES <= set(dps.__all__)


def test_errors_share_one_base():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DaskPSError)
    assert errors.__all__ == sorted(errors.__all__)


def test_partitioners_module_exports():
    for name in ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner",
                 "fixed_size_partitioner", "min_max_variable_partitioner", "variable_axis_size_partitioner"]:
        assert name in dps.partitioners.__all__
    assert dps.partitioners.__all__ == sorted(dps.partitioners.__all__)


def test_each_example_names_the_extra_its_imports_need():
    """An example that imports an optional library says in its docstring which extra installs it."""
    import ast

    extras = {"keras": "keras", "jax": "jax", "torch": "torch", "pandas": "data", "pyarrow": "data"}
    root = ROOT / "examples"
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        names |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        needed = {extras[n] for n in names if n in extras}
        if "keras" in needed:
            needed.discard("jax")  # the keras extra installs JAX too (Keras runs on its JAX backend here)
        doc = ast.get_docstring(tree) or ""
        for extra in sorted(needed):
            assert f'".[{extra}' in doc or f",{extra}" in doc, f"{path.name} imports what .[{extra}] installs"
