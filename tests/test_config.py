"""daskps' configuration: every key in daskps/daskps.yaml, read the Dask way, settable per worker."""

from __future__ import annotations

import pathlib
import re

import dask.config
import pytest
import yaml

import daskps as dps

from .conftest import dask_cli_cluster
from .test_function_cache import Expensive, _unpickles

PACKAGE = pathlib.Path(dps.__file__).resolve().parent
YAML = PACKAGE / "daskps.yaml"

# The defaults the code used when each read carried its own (written out here, not read from daskps).
EXPECTED = {
    "daskps.max-batch": 256,
    "daskps.function-cache-size": 64,
    "daskps.connect-timeout": "5s",
    "daskps.scheduler-timeout": "10s",  # how long ParameterServerStrategy("tcp://...") tries
    "daskps.workers-timeout": "60s",  # how long a new strategy waits for ps and worker resources
    "daskps.recovery-timeout": "60s",
    "daskps.recovery-same-worker-wait": "10s",
    "daskps.display-timeout": "1s",
    "daskps.metrics-interval": "1s",  # new with the dashboard's plots and /metrics
    "daskps.progress-bar": "auto",  # new with tqdm
    "daskps.progress-bytes": 256 * 2**20,
    "daskps.large-variable-elements": 1e9,
    "daskps.worker-mmap-threshold": "32MiB",
    "daskps.data.shuffle-buffer-rows": 10_000,
}


def _leaves(tree, prefix="daskps"):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}.{key}")
        else:
            yield f"{prefix}.{key}", value


def test_every_key_has_its_default_and_a_comment():
    tree = yaml.safe_load(YAML.read_text())
    keys = dict(_leaves(tree["daskps"]))
    assert keys == EXPECTED
    for line in YAML.read_text().splitlines():
        if re.match(r"\s+[a-z-]+:\s*\S", line):  # a key with a value
            assert "#" in line, f"no comment: {line!r}"


def test_every_key_the_code_reads_is_in_the_file_and_read_without_a_default():
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    read = set(re.findall(r'config\.get\(\s*"(daskps\.[a-z.-]+)"', source))
    assert read == set(EXPECTED), read ^ set(EXPECTED)
    with_default = re.findall(r'config\.get\(\s*"daskps\.[a-z.-]+"\s*,', source)
    assert not with_default, with_default


def test_the_defaults_are_registered_with_dask():
    for key, value in EXPECTED.items():
        assert dask.config.get(key) == value
    with dask.config.set({"daskps.max-batch": 7}):
        assert dask.config.get("daskps.max-batch") == 7


@pytest.mark.timeout(180)
def test_an_environment_variable_takes_effect_on_the_worker(tmp_path):
    env = {"DASK_DASKPS__FUNCTION_CACHE_SIZE": "0", "DASK_DASKPS__DATA__SHUFFLE_BUFFER_ROWS": "123"}
    with dask_cli_cluster(tmp_path, ["ps=1", "worker=1"], worker_env=env) as client:
        assert dask.config.get("daskps.function-cache-size") == 64  # not set in this process
        seen = client.run(lambda: (dask.config.get("daskps.function-cache-size"),
                                   dask.config.get("daskps.data.shuffle-buffer-rows")))
        assert set(seen.values()) == {(0, 123)}
        coordinator = dps.ClusterCoordinator(dps.ParameterServerStrategy(client))
        client.run(_unpickles)
        captured = Expensive()

        def step():
            return isinstance(captured, Expensive)

        assert all(coordinator.fetch([coordinator.schedule(step) for _ in range(20)]))
        # The trainer's cache is off: the function is unpickled for every call (64 kept it to a few).
        assert sum(client.run(_unpickles).values()) == 20
