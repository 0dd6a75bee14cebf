"""daskps' configuration: every key in daskps/daskps.yaml, read the Dask way, settable per worker."""

from __future__ import annotations

import pathlib
import re

import dask.config
import pytest
import yaml

import daskps as dps
from tests.helpers.cluster import dask_cli_cluster
from tests.helpers.pickles import Expensive, _unpickles
from tests.helpers.waiting import wait_until

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
    "daskps.channel-shared-memory": "16MiB",  # new with shared memory beside the direct channels
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


def test_every_key_is_a_typed_setting_and_read_in_one_module_only():
    from daskps._core import config

    assert {key for key, _ in config.KEYS.values()} == set(EXPECTED)
    for path in PACKAGE.rglob("*.py"):  # everywhere else reads a checked setting("...")
        if path != PACKAGE / "_core" / "config.py":
            assert not re.search(r'config\.get\(\s*"daskps', path.read_text()), path
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    used = set(re.findall(r'\bsetting\("([a-z_]+)"\)', source))
    assert used == set(config.Settings._fields), used ^ set(config.Settings._fields)  # none unread


def test_the_settings_convert_the_defaults():
    from daskps._core.config import settings

    assert settings()._asdict() == {
        "max_batch": 256, "function_cache_size": 64, "connect_timeout": 5.0, "scheduler_timeout": 10.0,
        "workers_timeout": 60.0, "recovery_timeout": 60.0, "recovery_same_worker_wait": 10.0,
        "metrics_interval": 1.0, "display_timeout": 1.0, "progress_bar": "auto", "progress_bytes": 256 * 2**20,
        "large_variable_elements": 1e9, "worker_mmap_threshold": 32 * 2**20, "channel_shared_memory": 16 * 2**20,
        "data_shuffle_buffer_rows": 10_000}
    with dask.config.set({"daskps.max-batch": "7", "daskps.connect-timeout": 2, "daskps.metrics-interval": "250ms"}):
        got = settings()
        assert (got.max_batch, got.connect_timeout, got.metrics_interval) == (7, 2.0, 0.25)


@pytest.mark.parametrize("field, bad, text", [
    ("max_batch", 0, "daskps.max-batch must be a whole number >= 1, got 0"),
    ("max_batch", 2.5, "daskps.max-batch must be a whole number >= 1, got 2.5"),
    ("max_batch", "many", "daskps.max-batch must be a whole number >= 1, got 'many'"),
    ("function_cache_size", -1, "daskps.function-cache-size must be a whole number >= 0, got -1"),
    ("connect_timeout", "soon", "daskps.connect-timeout must be a duration such as '5s' or a number of seconds "
                                ">= 0, got 'soon'"),
    ("metrics_interval", -1, "daskps.metrics-interval must be a duration such as '5s' or a number of seconds "
                             ">= 0, got -1"),
    ("display_timeout", True, "daskps.display-timeout must be a duration"),
    ("progress_bar", "fancy", "daskps.progress-bar must be 'auto' or 'builtin', got 'fancy'"),
    ("progress_bytes", 0, "daskps.progress-bytes must be a positive number, got 0"),
    ("large_variable_elements", "lots", "daskps.large-variable-elements must be a positive number, got 'lots'"),
    ("worker_mmap_threshold", "3GiB", "daskps.worker-mmap-threshold must be a size below 2 GiB"),
    ("channel_shared_memory", "5GiB", "daskps.channel-shared-memory must be a size of at most 4 GiB"),
    ("channel_shared_memory", -1, "daskps.channel-shared-memory must be a size of at most 4 GiB"),
    ("channel_shared_memory", "plenty", "daskps.channel-shared-memory must be a size of at most 4 GiB"),
    ("data_shuffle_buffer_rows", 0, "daskps.data.shuffle-buffer-rows must be a whole number >= 1, got 0"),
])
def test_a_bad_setting_is_refused_naming_its_key(field, bad, text):
    from daskps._core.config import KEYS, setting

    with dask.config.set({KEYS[field][0]: bad}), pytest.raises(ValueError) as info:
        setting(field)
    assert str(info.value).startswith(text), str(info.value)


def test_the_defaults_are_registered_with_dask():
    for key, value in EXPECTED.items():
        assert dask.config.get(key) == value
    with dask.config.set({"daskps.max-batch": 7}):
        assert dask.config.get("daskps.max-batch") == 7


@pytest.mark.cluster
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


@pytest.mark.cluster
def test_a_bad_metrics_interval_is_logged_once_and_the_scheduler_looks_every_second(caplog):
    """The scheduler's refresh loop must not stop on it, nor fall back without a word."""
    import logging
    import time

    from distributed import Client

    with dask.config.set({"daskps.metrics-interval": "soon"}), caplog.at_level(logging.ERROR, "daskps.scheduler.plugin"), \
            dps.LocalPSCluster(num_ps=1, num_workers=1, processes=False) as cluster, Client(cluster) as client:
        strategy = dps.ParameterServerStrategy(client)
        wait_until(lambda: any((f'scheduler at {cluster.scheduler_address} ' in r.getMessage() for r in caplog.records)), 30,
                   failure=lambda: caplog.text, interval=0.1, collect=False)
        time.sleep(2.5)  # two more looks, a second apart: said once (by this scheduler: the suite's own
        # cluster may run one in this process too, which reads the same config)
        here = cluster.scheduler_address
        said = [r.getMessage() for r in caplog.records if f"scheduler at {here} " in r.getMessage()]
        assert said == ["daskps: daskps.metrics-interval must be a duration such as '5s' or a number of seconds "
                        f">= 0, got 'soon'; the scheduler at {here} asks the servers every 1 s meanwhile"]
        assert strategy.summary() is not None  # still answering
        strategy.close()


def test_the_schema_names_every_key_with_a_description():
    schema = yaml.safe_load((PACKAGE / "daskps-schema.yaml").read_text())

    def keys(node, prefix):
        for name, sub in node["properties"].items():
            if sub.get("type") == "object":
                yield from keys(sub, f"{prefix}.{name}")
            else:
                assert sub.get("description"), f"{prefix}.{name} has no description"
                yield f"{prefix}.{name}"

    assert set(keys(schema["properties"]["daskps"], "daskps")) == set(EXPECTED)
