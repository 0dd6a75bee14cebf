"""``SidecarEvaluator``: evaluate each new checkpoint while training goes on.

It watches a checkpoint directory (any fsspec URL) and, whenever a newer
committed checkpoint appears, calls ``eval_fn(checkpoint_path)``, which
restores what it needs (``dps.Checkpoint(...).read(path)`` into local
variables) and returns a dict of metrics. The call runs on a worker with
resource ``evaluator`` when the cluster has one (``dask worker ...
--resources evaluator=1``, or ``LocalPSCluster(num_evaluators=1)``), so
evaluation never slows the coordinator; otherwise it runs in this process.

With ``data=dps.data.from_dask(collection, batch_size)`` it calls
``eval_fn(checkpoint_path, batches)`` instead: ``batches`` iterates over
one pass of the collection (``epochs`` passes if given), which is persisted
on the evaluator worker once and read there from memory (or fetched from
wherever it was persisted already), so every row is read exactly once per
evaluation.

Like TensorFlow's sidecar evaluator it evaluates the latest checkpoint each
time, skipping any it fell behind on, and stops after the checkpoint
numbered ``until`` (save with ``manager.save(checkpoint_number=step)`` to
make that a training step) or after ``max_evaluations``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import fsspec
import numpy as np
from distributed import get_client, get_worker

from daskps._core.arrays import is_int
from daskps.distribute.cluster import cluster_workers
from daskps.distribute.dask_data import (
    DaskInput,
    one_pass,
    partition_futures,
    read_partition,
    rows_per_partition,
    to_numpy,
    unpublish_later,
)
from daskps.training.manifest import committed_numbers

__all__ = ["SidecarEvaluator"]

logger = logging.getLogger("daskps.sidecar")


class SidecarEvaluator:
    """Run ``eval_fn(path) -> dict`` on every new checkpoint in ``checkpoint_dir``.

    Parameters
    ----------
    eval_fn : callable
        Takes a checkpoint path (and, with ``data``, an iterable of batches),
        returns a dict of metric values.
    checkpoint_dir : str
        The directory a ``CheckpointManager`` writes to.
    client : distributed.Client, optional
        Where to look for an ``evaluator`` worker; ``None`` evaluates here.
    until : int, optional
        Stop after evaluating a checkpoint numbered ``until`` (>= 1) or higher.
    max_evaluations : int, optional
        Stop after this many evaluations (>= 1).
    poll_interval : float
        Seconds between looks at the directory (> 0; default 1).
    timeout : float, optional
        Give up (``TimeoutError``) after this many seconds without a new checkpoint.
    checkpoint_name : str
        As given to the ``CheckpointManager`` (default ``"ckpt"``).
    log : callable, optional
        Called with one line per evaluation (default: the ``daskps.sidecar`` logger).
    data : ``dps.data.from_dask(...)`` input, optional
        Evaluate on this Dask collection: ``eval_fn(path, batches)``. Needs ``client``.

    Examples
    --------
    >>> def evaluate(path):                                          # doctest: +SKIP
    ...     w = dps.Variable(np.zeros(3, np.float32))
    ...     dps.Checkpoint(w=w).read(path)
    ...     return {"norm": float(np.linalg.norm(w.numpy()))}
    >>> sidecar = dps.SidecarEvaluator(evaluate, "ckpts", client, until=10).start()  # doctest: +SKIP
    >>> # ... train, saving with manager.save(checkpoint_number=step) ...
    >>> sidecar.join()                                               # doctest: +SKIP
    """

    def __init__(self, eval_fn: Callable[..., dict], checkpoint_dir: str, client: Any = None, *,
                 until: int | None = None, max_evaluations: int | None = None, poll_interval: float = 1.0,
                 timeout: float | None = None, checkpoint_name: str = "ckpt", log: Callable[[str], Any] | None = None,
                 data: DaskInput | None = None):
        if not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable, got {type(eval_fn).__name__}")
        if data is not None:
            if not isinstance(data, DaskInput):
                raise TypeError(f"data must be made by dps.data.from_dask(...), got {type(data).__name__}")
            if client is None:
                raise ValueError("data needs client: the Dask client of the cluster that reads the collection")
            if data.epochs is None:
                raise ValueError("data must have a number of epochs (an evaluation is one pass), got epochs=None")
        checkpoint_dir = _checked_args(checkpoint_dir, until, max_evaluations, poll_interval, timeout,
                                       checkpoint_name, log)
        if until is None and max_evaluations is None and timeout is None:
            raise ValueError("give until, max_evaluations or timeout, or the evaluator never stops")
        self._eval_fn = eval_fn
        self._url = checkpoint_dir.rstrip("/")
        self._fs, self._root = fsspec.core.url_to_fs(checkpoint_dir)
        self._client = client
        self._until, self._max = until, max_evaluations
        self._poll, self._timeout = float(poll_interval), timeout
        self._name = checkpoint_name
        self._log = log or logger.info
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.results: list[tuple[str, dict]] = []
        self._data = data
        self._published: str | None = None  # the name of the data's partitions, published on the scheduler
        self._held: list[Any] = []  # their futures: kept while this evaluator lives

    def _evaluators(self) -> list[str]:
        """The names of the workers with resource ``evaluator``."""
        if self._client is None:
            return []
        return [str(w.get("name")) for w in cluster_workers(self._client).values()
                if w.get("resources", {}).get("evaluator")]

    def evaluate(self, path: str) -> dict:
        """Evaluate one checkpoint (on an evaluator worker if there is one)."""
        evaluators = self._evaluators()
        if self._data is None:
            if evaluators:
                future = self._client.submit(self._eval_fn, path, resources={"evaluator": 1}, pure=False)
                return future.result()
            return self._eval_fn(path)
        name, spec = self._publish(evaluators), dataclasses.replace(self._data, parts=())
        if evaluators:
            return self._client.submit(_evaluate_on_worker, self._eval_fn, path, spec, name,
                                       resources={"evaluator": 1}, pure=False).result()
        futures = self._client.get_dataset(name)
        return self._eval_fn(path, one_pass(spec, futures, self._gathered))

    def _gathered(self, futures: tuple[Any, ...]) -> list[Any]:
        return [to_numpy(v) for v in self._client.gather(list(futures))]

    def _publish(self, evaluators: list[str]) -> str:
        """Persist the data (on the evaluators) and publish its partitions, once."""
        if self._published is None:
            assert self._data is not None
            client = self._client
            futures = partition_futures(client, self._data.parts, evaluators or None)
            rows_per_partition(client, self._data, futures)  # refuses misaligned components
            name = f"daskps-sidecar-{uuid.uuid4().hex}"
            client.publish_dataset([tuple(fs[i] for fs in futures) for i in range(len(futures[0]))], name=name)
            self._held = [f for fs in futures for f in fs]
            self._published = name
            weakref.finalize(self, unpublish_later, client, name)
        return self._published

    def run(self) -> list[tuple[str, dict]]:
        """Watch and evaluate until done; return ``[(path, metrics), ...]``."""
        last, waited_since = 0, time.monotonic()
        while not self._stop.is_set():
            numbers = committed_numbers(self._fs, self._root, self._name)
            if numbers and numbers[-1] > last:
                last = numbers[-1]
                path = f"{self._url}/{self._name}-{last}"
                metrics = self.evaluate(path)
                self.results.append((path, metrics))
                shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
                self._log(f"sidecar: {self._name}-{last}: {shown}")
                waited_since = time.monotonic()
                if (self._until is not None and last >= self._until) or (
                    self._max is not None and len(self.results) >= self._max
                ):
                    break
            elif self._timeout is not None and time.monotonic() - waited_since > self._timeout:
                raise TimeoutError(f"no new checkpoint in {self._url!r} for {self._timeout}s")
            self._stop.wait(self._poll)
        return self.results

    def start(self) -> SidecarEvaluator:
        """Run in a background thread; see :meth:`join`."""
        def target() -> None:
            try:
                self.run()
            except BaseException as exc:  # handed to join()
                self._error = exc

        self._thread = threading.Thread(target=target, name="daskps-sidecar", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> list[tuple[str, dict]]:
        """Wait for the background run to finish; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return self.results

    def stop(self) -> None:
        """Ask the background run to stop after the current evaluation."""
        self._stop.set()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread :meth:`start` runs the evaluator in (``None`` before it is started)."""
        return self._thread

    @property
    def published_dataset(self) -> str | None:
        """The name ``data``'s partitions are published under on the scheduler (``None`` before the first
        evaluation with ``data``)."""
        return self._published


def _checked_args(checkpoint_dir: Any, until: Any, max_evaluations: Any, poll_interval: Any, timeout: Any,
                  checkpoint_name: Any, log: Any) -> str:
    """Refuse what the evaluator's loop could not use (naming the argument); return the directory as a str."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a str (a path or an fsspec URL), got {type(checkpoint_dir).__name__}")
    for arg, count in (("until", until), ("max_evaluations", max_evaluations)):
        if count is None:
            continue
        if not is_int(count):
            raise TypeError(f"{arg} must be a positive int or None, got {type(count).__name__}")
        if count < 1:
            raise ValueError(f"{arg} must be a positive int or None, got {count!r}")
    for arg, seconds, optional in (("poll_interval", poll_interval, False), ("timeout", timeout, True)):
        if seconds is None and optional:
            continue
        what = "a positive finite number of seconds" + (" or None" if optional else "")
        if isinstance(seconds, (bool, np.bool_)) or not isinstance(seconds, numbers.Real):
            raise TypeError(f"{arg} must be {what}, got {type(seconds).__name__}")
        if not 0 < float(seconds) < math.inf:  # 0 would poll without pause; NaN and inf never wait as meant
            raise ValueError(f"{arg} must be {what}, got {seconds!r}")
    if not isinstance(checkpoint_name, str):
        raise TypeError(f"checkpoint_name must be a str, got {type(checkpoint_name).__name__}")
    if not checkpoint_name or "/" in checkpoint_name:
        raise ValueError(f"checkpoint_name must be the CheckpointManager's checkpoint_name (a non-empty str "
                         f"without '/'), got {checkpoint_name!r}")
    if log is not None and not callable(log):
        raise TypeError(f"log must be callable or None, got {type(log).__name__}")
    return os.fspath(checkpoint_dir)


def _evaluate_on_worker(eval_fn: Callable[..., dict], path: str, spec: DaskInput, name: str) -> dict:
    """On the evaluator: ``eval_fn(path, batches)``, the partitions read from this worker's memory."""
    worker = get_worker()
    futures = get_client().get_dataset(name)
    return eval_fn(path, one_pass(spec, futures, lambda fs: read_partition(worker, fs)[0]))

