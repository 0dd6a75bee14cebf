"""daskps' configuration defaults, registered with Dask's config as ``daskps.*``.

Every key with its default and a comment is in ``daskps/daskps.yaml``, as
``distributed/distributed.yaml`` is Dask's; importing daskps registers them
with ``dask.config.update_defaults``, and code reads them through
:func:`setting` (one key) or :func:`settings` (all), which convert and check
each value in this one place, and the usual ways of setting Dask config apply
(a YAML file, ``dask.config.set``, ``DASK_DASKPS__...`` environment variables,
which worker processes inherit).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import dask.config
from dask.utils import parse_bytes, parse_timedelta

PATH = pathlib.Path(__file__).resolve().parent.parent / "daskps.yaml"

# Dask's own YAML reader, as for its config files.
(DEFAULTS,) = dask.config.collect_yaml([str(PATH)])

dask.config.update_defaults(DEFAULTS)


# -- typed settings: every key converted and checked in one place -------------------------------------------


def _seconds(key: str, value: Any) -> float:
    try:
        seconds = parse_timedelta(value, default="seconds")
    except (TypeError, ValueError, KeyError):
        seconds = None
    if seconds is None or isinstance(value, bool) or not seconds >= 0:
        raise ValueError(f"{key} must be a duration such as '5s' or a number of seconds >= 0, got {value!r}")
    return float(seconds)


def _count(low: int) -> Callable[[str, Any], int]:
    def convert(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{key} must be a whole number >= {low}, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (number == int(number) if math.isfinite(number) else False) or number < low:
            raise ValueError(f"{key} must be a whole number >= {low}, got {value!r}")
        return int(number)
    return convert


def _positive(key: str, value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not number > 0 or not math.isfinite(number):
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return number


def _size(below: int, must: str) -> Callable[[str, Any], int]:
    """A size in bytes (``'32MiB'`` or a number) from 0 up to, not including, ``below``."""
    def convert(key: str, value: Any) -> int:
        try:
            if value is None or isinstance(value, bool):
                raise ValueError
            size = parse_bytes(value) if isinstance(value, str) else int(value)
        except (TypeError, ValueError):
            size = -1
        if not 0 <= size < below:
            raise ValueError(f"{key} must be {must}; got {value!r}")
        return size
    return convert


_mmap_bytes = _size(2**31, "a size below 2 GiB such as '32MiB', or 0 to leave malloc as Dask set it")
_shared_bytes = _size(2**32 + 1, "a size of at most 4 GiB such as '16MiB', or 0 for the socket alone")


def _progress_bar(key: str, value: Any) -> str:
    if value not in ("auto", "builtin"):
        raise ValueError(f"{key} must be 'auto' or 'builtin', got {value!r}")
    return str(value)


class Settings(NamedTuple):
    """Every ``daskps.*`` key, converted and checked (see ``daskps/daskps.yaml`` for what each does)."""

    max_batch: int
    function_cache_size: int
    connect_timeout: float
    scheduler_timeout: float
    workers_timeout: float
    recovery_timeout: float
    recovery_same_worker_wait: float
    metrics_interval: float
    display_timeout: float
    progress_bar: str
    progress_bytes: float
    large_variable_elements: float
    worker_mmap_threshold: int
    channel_shared_memory: int
    data_shuffle_buffer_rows: int


# field -> (the Dask config key, its converter)
KEYS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_batch": ("daskps.max-batch", _count(1)),
    "function_cache_size": ("daskps.function-cache-size", _count(0)),
    "connect_timeout": ("daskps.connect-timeout", _seconds),
    "scheduler_timeout": ("daskps.scheduler-timeout", _seconds),
    "workers_timeout": ("daskps.workers-timeout", _seconds),
    "recovery_timeout": ("daskps.recovery-timeout", _seconds),
    "recovery_same_worker_wait": ("daskps.recovery-same-worker-wait", _seconds),
    "metrics_interval": ("daskps.metrics-interval", _seconds),
    "display_timeout": ("daskps.display-timeout", _seconds),
    "progress_bar": ("daskps.progress-bar", _progress_bar),
    "progress_bytes": ("daskps.progress-bytes", _positive),
    "large_variable_elements": ("daskps.large-variable-elements", _positive),
    "worker_mmap_threshold": ("daskps.worker-mmap-threshold", _mmap_bytes),
    "channel_shared_memory": ("daskps.channel-shared-memory", _shared_bytes),
    "data_shuffle_buffer_rows": ("daskps.data.shuffle-buffer-rows", _count(1)),
}
assert tuple(KEYS) == Settings._fields


def checked(field: str, value: Any) -> Any:
    """``value`` converted and checked as the setting ``field`` is (a ``ValueError`` naming its key)."""
    key, convert = KEYS[field]
    return convert(key, value)


def setting(field: str) -> Any:
    """One setting, as Dask's config holds it now (``dask.config.set`` applies), converted and checked:
    a ``ValueError`` naming the key for a value it cannot be."""
    key, convert = KEYS[field]
    return convert(key, dask.config.get(key))


def settings() -> Settings:
    """Every setting at once, each checked as :func:`setting` does."""
    return Settings(*(setting(field) for field in Settings._fields))
