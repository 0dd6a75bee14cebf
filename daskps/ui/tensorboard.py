"""TensorBoard scalars from the coordinator: metrics and throughput every N functions, no TensorFlow needed.

:class:`ScalarLogger` watches a :class:`ClusterCoordinator` from a thread of
the process that schedules (the "chief", in TensorFlow's words) and, each
time another ``every_n_steps`` scheduled functions have completed, writes
the chosen metrics' values and the throughput since the last write as
TensorBoard scalars, at the step ``functions completed``. The event files
are written by ``tensorboardX`` (``pip install ".[tensorboard]"`` in the checkout),
which TensorBoard reads: ``tensorboard --logdir <logdir>``.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
import time
import warnings
from typing import Any

from daskps._core.arrays import is_int
from daskps.coordinator.coordinator import ClusterCoordinator
from daskps.coordinator.recovery import RecoveryState
from daskps.errors import PSUnavailableError
from daskps.scheduler.messages import METRICS_TOPIC

__all__ = ["ScalarLogger", "create_file_writer"]

TENSORBOARD_MISSING = ('writing TensorBoard event files needs tensorboardX: pip install ".[tensorboard]" in the '
                       "daskps checkout, or pip install tensorboardX "
                       "(or pass a writer of your own with an add_scalar(tag, value, step) method)")


def _value(metric: Any) -> float | None:
    """A metric's value, or ``None`` while it has none (``value_if_any``, or a function returning ``None``)."""
    if callable(getattr(metric, "value_if_any", None)):
        return metric.value_if_any()
    value = metric.result() if callable(getattr(metric, "result", None)) else metric()
    return None if value is None else float(value)


def create_file_writer(logdir: str | os.PathLike[str]) -> Any:
    """A ``tensorboardX.SummaryWriter`` for ``logdir``: ``add_scalar(tag, value, step)``, ``flush()``, ``close()``."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as exc:
        raise ImportError(TENSORBOARD_MISSING) from exc
    return SummaryWriter(logdir=os.fspath(logdir))


class ScalarLogger:
    """Write ``metrics`` and throughput as TensorBoard scalars every ``every_n_steps`` completed functions.

    Parameters
    ----------
    coordinator : ClusterCoordinator
    logdir : str, os.PathLike, a writer, or None
        A directory for the event files (made if missing), or any object
        with ``add_scalar(tag, value, step)`` (a ``tensorboardX`` or
        ``torch.utils.tensorboard`` ``SummaryWriter``; it is flushed, not
        closed, when the logger stops), or None: no event files. Either way
        the values also go to the scheduler, whose dashboard plots them
        (``/individual-daskps-metrics``).
    metrics : dict, optional
        Tag -> a ``dps.metrics`` object (its ``result()``) or a function of
        no arguments returning a number. A metric with no value yet (a
        ``Mean`` of nothing, as after ``reset_state()``; a function returning
        ``None``) is left out of that write, not written as 0: the plot
        shows a gap.
    every_n_steps : int
        Scheduled functions completed between two writes (the step of a
        write is the number completed then).
    examples_per_step : number, optional
        Examples one scheduled function trains on: adds ``examples_per_second``.
    interval : float
        Seconds between two looks at the coordinator's counts.
    step : callable, optional
        A function of no arguments returning the step to write at. By
        default a write's step is the number of functions completed (by
        this coordinator: it starts again at 0 in a new run). Pass
        ``lambda: int(optimizer.iterations.numpy())`` to write at the
        optimizer's step instead, as Keras' ``TensorBoard`` callback does:
        it goes on across runs resumed from a checkpoint, and it is the step
        a training script prints.

    Tags written besides ``metrics``: ``daskps/functions_per_second`` and
    ``daskps/examples_per_second`` (since the previous write),
    ``daskps/failed`` (functions failed for good so far) and ``daskps/rerun``
    (functions queued again after a parameter server was lost): the
    coordinator's ``summary()`` counts, as the dashboard and ``/metrics``
    show them. Use it as a context manager,
    or call :meth:`start` and :meth:`stop`; stopping writes the last step.
    A write at the step written last (with ``step=``, when no optimizer
    step was taken since) is skipped: each step has one point, with the
    values of the first write at that step (reports that arrive after it
    show at the next step written, if there is one).
    A metric that cannot be read is skipped with one warning: a log must
    not stop training.
    """

    coordinator: ClusterCoordinator
    metrics: dict[str, Any]
    every_n_steps: int
    examples_per_step: float | None
    interval: float
    _stop: threading.Event
    _lock: threading.Lock
    _thread: threading.Thread | None
    _own: bool
    step_fn: Any

    def __init__(self, coordinator: ClusterCoordinator, logdir: Any, metrics: dict[str, Any] | None = None,
                 every_n_steps: int = 100, examples_per_step: float | None = None, interval: float = 0.2,
                 step: Any = None):
        if not isinstance(coordinator, ClusterCoordinator):
            raise TypeError(f"coordinator must be a ClusterCoordinator, got {type(coordinator).__name__}")
        if not is_int(every_n_steps) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
        if examples_per_step is not None and (isinstance(examples_per_step, bool) or not isinstance(
                examples_per_step, numbers.Real) or not examples_per_step > 0):
            raise ValueError(f"examples_per_step must be a positive number or None, got {examples_per_step!r}")
        if isinstance(interval, bool) or not isinstance(interval, numbers.Real) or not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        if step is not None and not callable(step):
            raise TypeError(f"step must be a function of no arguments returning the step (such as lambda: "
                            f"int(optimizer.iterations.numpy())) or None, got {type(step).__name__}")
        metrics = dict(metrics or {})
        for tag, metric in metrics.items():
            if not isinstance(tag, str) or not (callable(getattr(metric, "result", None)) or callable(metric)):
                raise TypeError(f"metrics must map tags (str) to dps.metrics objects or functions of no "
                                f"arguments; got {tag!r}: {type(metric).__name__}")
        self._own = isinstance(logdir, (str, os.PathLike))
        if self._own:
            self.writer: Any = create_file_writer(logdir)
        elif logdir is None or callable(getattr(logdir, "add_scalar", None)):
            self.writer = logdir
        else:
            raise TypeError(f"logdir must be a directory, a writer with add_scalar(tag, value, step) or None, "
                            f"got {type(logdir).__name__}")
        self.coordinator = coordinator
        self.metrics = metrics
        self.every_n_steps = int(every_n_steps)
        self.examples_per_step = examples_per_step
        self.interval = float(interval)
        self.step_fn = step
        self.steps: list[int] = []  # the steps written at so far
        self._last: tuple[int, float] = (coordinator.summary()["done"], time.monotonic())
        self._unreadable: set[str] = set()
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()

    def start(self) -> ScalarLogger:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="daskps-scalar-logger", daemon=True)
            self._thread.start()
        return self

    @property
    def thread(self) -> threading.Thread | None:
        """The daemon thread :meth:`start` runs the logger in (``None`` before it is started)."""
        return self._thread

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._guarded(self.poll)

    def _guarded(self, action: Any) -> None:
        """``action()``; an error is one warning, not the end of logging (a log must not stop training)."""
        try:
            action()
        except Exception as exc:
            if "writer" not in self._unreadable:
                self._unreadable.add("writer")
                warnings.warn(f"ScalarLogger: could not write scalars ({type(exc).__name__}: {exc}); "
                              "it goes on trying", RuntimeWarning, stacklevel=2)

    def _recovering(self) -> bool:
        """Whether a lost server is (or is about to be) re-created: the coordinator has a checkpoint manager
        and no recovery of it failed. A read may fail before the coordinator hears of the loss."""
        return (self.coordinator.checkpoint_manager is not None
                and self.coordinator.recovery_state is not RecoveryState.HALTED)

    def poll(self) -> bool:
        """Write now if another ``every_n_steps`` functions have completed since the last write."""
        done = self.coordinator.summary()["done"]
        if done // self.every_n_steps > self._last[0] // self.every_n_steps:
            self.write(done)
            return True
        return False

    def write(self, step: int) -> None:
        """Write every scalar now; ``step``: the functions completed (the step written, without ``step=``)."""
        with self._lock:
            now = time.monotonic()
            s = self.coordinator.summary()
            before, then = self._last
            rate = (step - before) / max(now - then, 1e-9)
            scalars = {"daskps/functions_per_second": rate, "daskps/failed": float(s["failed"]),
                       "daskps/rerun": float(s["rerun"])}
            if self.examples_per_step is not None:
                scalars["daskps/examples_per_second"] = rate * float(self.examples_per_step)
            for tag, metric in self.metrics.items():
                try:
                    value = _value(metric)
                    if value is None:  # no value yet (a mean of nothing since its reset): left out, not 0
                        continue
                    scalars[tag] = value
                except Exception as exc:
                    if isinstance(exc, PSUnavailableError) and self._recovering():
                        continue  # its server is being re-created from the checkpoint: a gap at this step, quietly
                    if tag not in self._unreadable:
                        self._unreadable.add(tag)
                        warnings.warn(f"ScalarLogger: metric {tag!r} could not be read ({type(exc).__name__}: "
                                      f"{exc}); it is left out", RuntimeWarning, stacklevel=2)
            try:
                at = step if self.step_fn is None else int(self.step_fn())
            except PSUnavailableError:
                if not self._recovering():
                    raise  # lost for good: one warning (see _guarded)
                return  # its server is being re-created: the next look writes
            if self.steps and at == self.steps[-1]:
                # The step has not moved since the last write (``step=`` counts optimizer steps, which can
                # be all applied before the last functions' reports arrive): one point per step.
                self._last = (step, now)
                return
            if self.writer is not None:
                for tag, value in scalars.items():
                    self.writer.add_scalar(tag, value, at)
                self.writer.flush()
            self._tell_scheduler(at, scalars)
            self.steps.append(at)
            self._last = (step, now)

    def _tell_scheduler(self, step: int, scalars: dict[str, float]) -> None:
        """The values, for the dashboard's plots (best effort: a log must not stop training)."""
        strategy = self.coordinator.strategy
        client = strategy.client
        if client is not None:
            with contextlib.suppress(Exception):
                client.log_event(METRICS_TOPIC, {"strategy": strategy.token, "step": int(step), "values": scalars})

    def stop(self) -> None:
        """Stop watching; write the last step if it was not written; close a writer made here."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        done = self.coordinator.summary()["done"]
        if done > self._last[0]:  # functions completed since the last write
            self._guarded(lambda: self.write(done))
        if self._own:
            self._guarded(self.writer.close)
        elif self.writer is not None:
            self._guarded(self.writer.flush)

    def __enter__(self) -> ScalarLogger:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
