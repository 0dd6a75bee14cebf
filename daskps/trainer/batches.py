"""Runs a batch of scheduled functions on a trainer, reporting each as it finishes.

The coordinator packs several scheduled functions into one Dask task (see
:mod:`daskps.coordinator.coordinator`). On the trainer, :func:`run_batch_here` (the task's entry point is
:func:`daskps.trainer.messages.run_batch`)
runs them in schedule order and, as they finish, logs events
``[batch_key, [FunctionReport, ...], trainer_name]`` (:class:`daskps.scheduler.messages.FunctionReport`) to the coordinator's
topic (``generation``: of the re-created servers the trainer knew as the function started):
the result (pickled, when small) or the error reaches the coordinator at
once, through the scheduler. The scheduler plugin notes which functions of a
batch have reported; if the trainer dies and Dask runs the batch again
elsewhere, the new run asks for that list first and skips them, so a
function whose result reached the coordinator never runs again. Results too
big for an event travel as the task's own result instead.

Updates and gradient pushes are pipelined (:mod:`daskps.client.pipeline`): a
step's push rides at the front of the next step's reads, and a function is
reported only once its pushes have been applied. A batch stops at the first
error (the coordinator cancels what is left when it raises it) and when its
task is cancelled (nothing queued starts).
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import threading
import time
import traceback
from typing import Any

import cloudpickle
from distributed.core import Status
from distributed.protocol.pickle import dumps
from distributed.utils import sync
from distributed.worker import get_worker

from daskps._core import trace
from daskps._core.config import setting
from daskps._core.nest import map_structure
from daskps._core.pickling import FunctionCache
from daskps.client import pipeline, protocol, refs
from daskps.client.group import generation_known
from daskps.client.routing import ROUTES, ServerRef
from daskps.distribute.context import scheduled_function
from daskps.errors import OutOfRangeError
from daskps.scheduler.messages import BIG, ERROR, OK, REPORTED_HANDLER, FunctionReport, Reported
from daskps.trainer.datasets import PerWorkerValues, local_worker_index, running_function

_LEAVING = frozenset({Status.closing_gracefully, Status.closing, Status.closed, Status.failed})
# Results up to this size ride in the event; bigger ones come back with the task.
INLINE_BYTES = 64 << 10


def run_batch_here(strategy_blob: bytes, topic: str, batch_key: str, batch: bytes,
                   report_every: float) -> dict[int, Any]:
    """Run the pickled ``[(function id, (pickled fn, pickled (args, kwargs)), staleness), ...]`` in order;
    return big results.

    Pushes are pipelined (:mod:`daskps.client.pipeline`): a function is reported
    once its pushes have been applied, in schedule order. The scheduler's
    plugin also says which parameter servers were re-created after a loss:
    handles here follow them.
    """
    worker = get_worker()
    began = trace.now() if trace.ON else 0.0
    answer = Reported(*sync(worker.loop, getattr(worker.scheduler, REPORTED_HANDLER), key=batch_key))
    if answer.moves:
        refs.follow({old: ServerRef(*new) for old, new in answer.moves.items()})
    strategy = pickle.loads(strategy_blob)
    if ROUTES.moved:  # a view of the strategy made before a server moved
        strategy.follow_moved_servers()
    closures = pickle.loads(batch)
    reported = set(answer.reported)
    big: dict[int, Any] = {}
    with pipeline.pipelined() as pipe, scheduled_function(), strategy.scope():
        reporter = _Reporter(worker, topic, batch_key, pipe, report_every)
        for i, (cid, blob, staleness) in enumerate(closures):
            if cid in reported:
                continue  # ran before this task was moved here, and its result reached the coordinator
            if _cancelled(worker, batch_key):
                break
            # With staleness, reported at once; the batch's last function waits for every push.
            pipe.start(cid, staleness, eager=bool(staleness) and i + 1 < len(closures))
            generation = pipe.generation = generation_known(strategy.token)
            started = time.perf_counter()
            with running_function(cid):
                status, payload, value = _run_one(strategy, blob)
            took = time.perf_counter() - started
            if trace.ON:
                trace.span("function", started, started + took)
            pipe.function = None
            if status == BIG:
                big[cid] = value
            reporter.finished(FunctionReport(cid, status, payload, took, generation))
            if status == ERROR or pipe.errors:
                break
            following = closures[i + 1][1][0] if i + 1 < len(closures) else None
            # Pushes wait for the next message to their server only while the same step repeats:
            # other work next (which might take long, or wait for this result) gets them sent now.
            # Also when a report has waited report_every: the functions since touched no such server.
            # With bounded staleness, pushes wait for a message to their server at most ``staleness`` steps.
            if pipe.pending and (following is not blob[0] or reporter.overdue()
                                 or (staleness and pipe.held_too_long())):
                _settle(reporter)
        _settle(reporter, final=True)
    if trace.ON:
        trace.span("batch", began)
    return big


def _settle(reporter: _Reporter, final: bool = False) -> None:
    """Send the held pushes and report the functions they held back."""
    with contextlib.suppress(Exception):  # a failed push is reported as its function's error
        protocol.flush()
    reporter.send(final=final)


class _Reporter:
    """Reports finished functions in order, once their pushes are applied, a few per event.

    Functions that finish within ``every`` seconds of each other (the coordinator's
    :func:`~daskps.coordinator.batching.report_seconds`: 20 ms, longer with many trainers) share
    one event (one message through the scheduler instead of one each): the
    first one ready sets a timer on the worker's event loop, which sends
    whatever is ready by then, even while the next function runs. An error,
    and the end of the batch, go out at once.
    """

    def __init__(self, worker: Any, topic: str, batch_key: str, pipe: Any, every: float):
        self.worker, self.topic, self.batch_key, self.pipe = worker, topic, batch_key, pipe
        self.every = every  # seconds
        # Finished, pushes not yet applied: (report, when it finished).
        self.waiting: collections.deque[tuple[FunctionReport, float]] = collections.deque()
        self.outbox: list[FunctionReport] = []
        self.lock = threading.Lock()
        self.timer = False

    def finished(self, report: FunctionReport) -> None:
        self.waiting.append((report, time.monotonic()))
        self.send(final=report.status == ERROR)

    def overdue(self) -> bool:
        """Whether a finished function has waited ``every`` seconds for its pushes to be applied.

        Pushes ride with the next message to their server; when the functions
        after it do not talk to that server, the batch sends them itself, so
        a report waits at most about one function.
        """
        return bool(self.waiting) and time.monotonic() - self.waiting[0][1] > self.every

    def send(self, final: bool = False) -> None:
        while self.waiting and self.pipe.settled(self.waiting[0][0].function):
            report, _ = self.waiting.popleft()
            refused = self.pipe.error_for(report.function)
            if refused is not None:  # a push it (or an eager function before it) made was refused
                report = report._replace(status=ERROR, payload=pickled_error(refused))
            with self.lock:
                self.outbox.append(report)
            final = final or report.status == ERROR
        if final:
            self._flush()
            return
        with self.lock:
            start = bool(self.outbox) and not self.timer
            self.timer = self.timer or start
        if start:
            loop = self.worker.loop
            loop.add_callback(loop.call_later, self.every, self._flush)

    def _flush(self) -> None:
        with self.lock:
            outbox, self.outbox, self.timer = self.outbox, [], False
        if outbox:
            started = trace.now() if trace.ON else 0.0
            self.worker.log_event(self.topic, [self.batch_key, outbox, str(self.worker.name)])  # ran by whom
            if trace.ON:
                trace.span("report", started)


def _cancelled(worker: Any, key: str) -> bool:
    """Whether the batch should stop: its task was cancelled, or this worker is leaving.

    A worker retiring (``client.retire_workers``) or closing has its batch
    run again elsewhere; stopping here keeps both from running the same
    functions.
    """
    if worker.status in _LEAVING:
        return True
    ts = worker.state.tasks.get(key)
    return ts is None or ts.state == "cancelled"


_FUNCTIONS: FunctionCache | None = None


def function_cache() -> FunctionCache:
    """This process's unpickled scheduled functions (``daskps.function-cache-size`` of them)."""
    global _FUNCTIONS
    if _FUNCTIONS is None:
        _FUNCTIONS = FunctionCache(setting("function_cache_size"))
    return _FUNCTIONS


def _run_one(strategy: Any, blob: tuple[bytes, bytes]) -> tuple[str, bytes | None, Any]:
    """Run one scheduled function: ``(status, payload for the event, the value if too big)``."""
    made: list[Any] = []  # the handles its unpickling made: those it leaves behind are acquired here
    failed = None
    try:
        # Outside borrowing: the handles a kept function captured live with it, borrowed (the
        # coordinator keeps their objects alive while it schedules those same bytes).
        fn = function_cache().load(blob[0])
        with refs.borrowing(made):
            args, kwargs = pickle.loads(blob[1])
            if any(type(x) is PerWorkerValues for x in (*args, *kwargs.values())):
                index = local_worker_index(strategy.trainer_names)
                local = lambda x: x.on_worker(index) if type(x) is PerWorkerValues else x  # noqa: E731
                args, kwargs = map_structure(local, args), map_structure(local, kwargs)
            try:
                value = fn(*args, **kwargs)  # inside the strategy's scope, entered once per batch
            finally:
                del fn, args, kwargs
    except StopIteration as exc:  # an input's end, uncaught: TensorFlow's OutOfRangeError
        failed = pickled_error(OutOfRangeError(f"{str(exc) or 'an iterator is exhausted'}; create a new one with "
                                               "iter(dataset), or catch the end with next(iterator, None)"))
        refs.drop_traceback(exc)
    except Exception as exc:
        failed = pickled_error(exc)
        refs.drop_traceback(exc)  # its frames would keep the function's handles alive, as if left behind
    refs.keep_escaped(made)
    if failed is not None:
        return ERROR, failed, None
    if value is None:
        return OK, _NONE, None
    try:
        payload = _quiet_dumps(value)
    except Exception as exc:
        return ERROR, pickled_error(TypeError(f"the result of a scheduled function cannot be pickled: {exc}")), None
    if len(payload) > INLINE_BYTES:
        return BIG, None, value
    return OK, payload, None


_NONE = dumps(None)


def _quiet_dumps(value: Any) -> bytes:
    """``value`` pickled as Dask's ``dumps`` does it (pickle; cloudpickle for what pickle cannot do or
    what names ``__main__``), without the ERROR log and tracebacks Dask's prints when neither can:
    the caller turns that failure into one line of its own."""
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in payload:
            return payload
    except Exception:  # a lambda, a local function, ...: cloudpickle pickles it by value
        pass
    return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def pickled_error(exc: BaseException) -> bytes:
    """``exc``, its traceback and its text: the text survives an exception that cannot be rebuilt."""
    where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    text = f"{type(exc).__name__}: {exc}"
    try:
        blob = _quiet_dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but do not unpickle (extra __init__ arguments)
    except Exception:
        blob = dumps(RuntimeError(text))
    return dumps((blob, where, text))
