import daskps as dps
from daskps import errors

SPEC_NAMES = {
    "LocalPSCluster", "DaskClusterResolver", "ParameterServerStrategy", "get_strategy",
    "has_strategy", "in_cross_replica_context", "get_replica_context", "ReplicaContext",
    "ReduceOp", "InputContext", "ValueContext", "RunOptions", "InputOptions", "Variable",
    "read_values", "ClusterCoordinator", "RemoteValue", "PerWorkerValues", "errors",
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
