"""Small values of the distribution API: reduce ops, input and value contexts, options."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from daskps._core.arrays import is_int

__all__ = ["InputContext", "InputOptions", "ReduceOp", "RunOptions", "ValueContext"]


def _check_count(value: Any, arg: str, low: int) -> None:
    if not is_int(value):
        raise TypeError(f"{arg} must be an int >= {low}, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")


class ReduceOp(enum.Enum):
    """How values are combined across replicas: ``SUM`` or ``MEAN``.

    Anywhere daskps takes a ``reduce_op``, the strings ``"SUM"`` and
    ``"MEAN"`` (in any case) work as well.

    >>> ReduceOp.coerce("mean")
    <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def coerce(cls, value: ReduceOp | str) -> ReduceOp:
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str):
            try:
                return cls(value.upper())
            except ValueError:
                pass
        raise ValueError(
            "reduce_op must be ReduceOp.SUM, ReduceOp.MEAN, 'SUM' or 'MEAN', "
            f"got {value!r}"
        )


class InputContext:
    """What a dataset function needs to know about where it runs.

    Parameters
    ----------
    num_input_pipelines : int
        Number of input pipelines (one per training worker).
    input_pipeline_id : int
        This pipeline's index, in ``[0, num_input_pipelines)``.
    num_replicas_in_sync : int
        Replicas whose gradients are combined per step (1 for asynchronous
        parameter-server training).

    Examples
    --------
    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1)
    >>> ctx.get_per_replica_batch_size(64)
    64
    """

    __slots__ = ("_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync")

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ):
        _check_count(num_input_pipelines, "num_input_pipelines", 1)
        _check_count(input_pipeline_id, "input_pipeline_id", 0)  # a trainer that joined may be past the count
        _check_count(num_replicas_in_sync, "num_replicas_in_sync", 1)
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size each replica should use for ``global_batch_size``."""
        _check_count(global_batch_size, "global_batch_size", 0)
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by "
                f"num_replicas_in_sync ({self._num_replicas_in_sync})"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(input_pipeline_id={self._input_pipeline_id}, "
            f"num_input_pipelines={self._num_input_pipelines})"
        )


class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` sees.

    >>> ctx = ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    >>> ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync
    0.5
    """

    __slots__ = ("_replica_id_in_sync_group", "_num_replicas_in_sync")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        _check_count(num_replicas_in_sync, "num_replicas_in_sync", 1)
        _check_count(replica_id_in_sync_group, "replica_id_in_sync_group", 0)
        if replica_id_in_sync_group >= num_replicas_in_sync:
            raise ValueError(f"replica_id_in_sync_group must be in [0, num_replicas_in_sync={num_replicas_in_sync}), "
                             f"got {replica_id_in_sync_group}")
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for ``strategy.run``; accepted for compatibility.

    With one replica per worker and plain Python functions none of these
    change what ``run`` does.
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributing datasets; accepted for compatibility.

    Datasets live in worker memory as Python iterables, so there is no
    device prefetching to configure.
    """

    experimental_fetch_to_device: bool | None = None
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1
