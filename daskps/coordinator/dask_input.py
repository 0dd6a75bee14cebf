"""The coordinator's side of a ``dps.data.from_dask`` dataset: persist, count, open the ledger.

``create_per_worker_dataset`` turns a :class:`~daskps.distribute.dask_data.DaskInput`
into a per-worker dataset by :func:`dask_dataset`; the trainers' side (asking
the ledger, reading, batching) is :mod:`daskps.trainer.dask_input`, and the
whole path is described there.
"""

from __future__ import annotations

import random
import uuid
import weakref
from typing import Any

from distributed import Future, wait

from daskps.distribute.dask_data import DaskInput, partition_futures, rows_per_partition, unpublish_later
from daskps.scheduler.messages import CloseInput, OpenInput, ask
from daskps.trainer.messages import Reader


def dask_dataset(client: Any, spec: DaskInput, trainers: list[tuple[str, str]],
                 resource: str = "worker", topic: str | None = None) -> tuple[Reader, Held]:
    """The dataset function for the trainers and what the coordinator must hold while it lives.

    ``trainers`` are ``(name, address)`` of the training workers now, which
    have resource ``resource`` (trainers that join later have it too);
    ``topic`` is where the coordinator's functions report.
    """
    futures = partition_futures(client, spec.parts, [name for name, _ in trainers])
    wait([f for fs in futures for f in fs])  # the scheduler knows where a partition is once it is computed
    rows = rows_per_partition(client, spec, futures)
    name = f"daskps-data-{uuid.uuid4().hex}"
    per_partition = [tuple(fs[i] for fs in futures) for i in range(len(rows))]
    options = {"batch_size": spec.batch_size, "shuffle": spec.shuffle, "seed": spec.seed, "epochs": spec.epochs,
               "drop_remainder": spec.drop_remainder, "exactly_once": spec.exactly_once, "topic": topic}
    client.publish_dataset(per_partition, name=name)
    client.run_on_scheduler(ask, OpenInput(name, [tuple(f.key for f in fs) for fs in per_partition], rows,
                                           sorted(n for n, _ in trainers), resource, options))
    # Exactly once, the rows of a partition are shuffled the same way on every trainer: one seed for all.
    seed = spec.seed if spec.seed is not None or not spec.exactly_once else random.getrandbits(63)
    reader = Reader(name, spec.names, spec.single, spec.batch_size, spec.shuffle, seed, spec.drop_remainder,
                    spec.exactly_once, tuple(rows))
    return reader, Held(client, name, [f for fs in futures for f in fs])


class Held:
    """The coordinator's hold on a dataset's partitions: released (ledger and publication gone) when it dies."""

    def __init__(self, client: Any, name: str, futures: list[Future]):
        self.name, self.futures = name, futures
        self._finalizer = weakref.finalize(self, unpublish_later, client, name, CloseInput(name))

    def __repr__(self) -> str:
        return f"<Held {len(self.futures)} partitions>"
