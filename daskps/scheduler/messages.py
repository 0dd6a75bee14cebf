"""What crosses into and out of the scheduler's daskps plugin: names, events, requests and answers.

Other processes know the plugin (:mod:`daskps.scheduler.plugin`) only through
this module:

- **Handlers** a worker calls over its scheduler connection
  (``getattr(worker.scheduler, REPORTED_HANDLER)(key=...)``): answers travel as
  Dask's msgpack lists and are rebuilt as the named tuples below
  (``Reported(*answer)``).
- **Events** on topics: each batch's :class:`FunctionReport` rows on its
  coordinator's ``BATCH_TOPIC_PREFIX + token`` topic, ``[LOST, keys]`` there
  when a server's worker left, metric values and checkpoint writes.
- **Requests** a client makes with ``client.run_on_scheduler(ask, request)``:
  the named tuples under "requests", each answered by the plugin's job that
  owns it.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

PLUGIN_NAME = "daskps"

# -- handlers on the scheduler's connection ----------------------------------------------------------
REPORTED_HANDLER = "daskps_reported"  # (key=batch key) -> Reported
TRAINERS_HANDLER = "daskps_trainers"  # (resource=...) -> how many live workers hold it
CLEANUP_HANDLER = "daskps_run_cleanup"  # (server_key=..., cleanup_id=...): run a cleanup now
INPUT_HANDLER = "daskps_input_claim"  # a trainer's next partitions or batch of a dps.data dataset: Handed or Slice
STATS_HANDLER = "daskps_coordinator_stats"  # (token=..., stats=...): a coordinator's counts

# -- event topics -----------------------------------------------------------------------------------
BATCH_TOPIC_PREFIX = "daskps-batches-"  # + strategy token: [batch_key, [FunctionReport rows], trainer name]
METRICS_TOPIC = "daskps-metrics"  # metric values a ScalarLogger took: {"strategy", "step", "values": {tag: value}}
CHECKPOINT_TOPIC = "daskps-checkpoints"  # an event per checkpoint written: {"seconds", "bytes", "path"}
# Logged on a strategy's batch topic when the worker of one of its servers leaves: [LOST, [actor keys]].
LOST = "daskps-lost-servers"


OK, BIG, ERROR = "ok", "big", "error"  # a FunctionReport's status


class FunctionReport(NamedTuple):
    """How one scheduled function ended, as its batch reports it on the coordinator's topic.

    Events carry ``[batch_key, [report, ...], trainer_name]``; Dask's event log turns the
    records into lists on the way, so receivers rebuild them with
    ``FunctionReport(*row)``.
    """

    function: int  # the function's id on its coordinator
    status: str  # "ok", "big" (its value comes back with the batch's task) or "error"
    payload: bytes | None  # the pickled value (ok) or error (error)
    seconds: float  # how long it ran
    generation: int  # the generation of re-created servers its trainer knew as it started


def load_error(payload: bytes) -> BaseException:
    """The exception a function raised on a worker, with the worker's traceback as a note.

    One that cannot be rebuilt here (its class unpickles only on the
    workers, say) arrives as a ``RuntimeError`` with its text.
    """
    blob, where, text = pickle.loads(payload)
    try:
        exc = pickle.loads(blob)
    except Exception as why:
        exc = RuntimeError(text)
        where = f"{where}(it cannot be rebuilt here: {type(why).__name__}: {why})\n"
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"raised in a scheduled function on a worker:\n{where}")
    return exc


# What follows the partitions of an input claim's answer ("" : nothing yet, ask again).
EPOCH_END = "epoch-end"  # this trainer's share of the epoch is all handed out
END = "end"  # nothing more for this trainer, ever
GONE = "gone"  # the dataset was dropped


class Handed(NamedTuple):
    """``INPUT_HANDLER``'s answer to a streaming claim: partitions to read, then what follows them."""

    partitions: list[list[int]]  # [partition, epoch, number] each; number seeds the trainer's shuffle
    then: str = ""  # "", EPOCH_END, END or GONE
    epoch: int = -1  # with EPOCH_END: the epoch whose share is handed out

    @classmethod
    def of(cls, answer: Any) -> Handed:
        """The answer as it arrives (a msgpack list, or ``GONE`` for a dropped dataset), rebuilt."""
        return cls([], GONE) if answer == GONE else cls(*answer)


class Slice(NamedTuple):
    """``INPUT_HANDLER``'s answer to an exactly-once claim: the rows of one batch, or the end."""

    partition: int = -1
    start: int = 0
    stop: int = 0
    epoch: int = 0
    then: str = ""  # "": a batch; END or GONE: no batch

    @classmethod
    def of(cls, answer: Any) -> Slice:
        """The answer as it arrives (a msgpack list, or ``GONE`` for a dropped dataset), rebuilt."""
        return cls(then=GONE) if answer == GONE else cls(*answer)


class Reported(NamedTuple):
    """``REPORTED_HANDLER``'s answer to a batch as it starts."""

    reported: list[int]  # functions of the batch whose results went out (a batch that runs again skips them)
    moves: dict[str, tuple]  # actor key of a lost server -> the new server (a ServerRef's fields)


# -- requests (client.run_on_scheduler(ask, request)) ---------------------------------------------------
class AddCleanup(NamedTuple):
    """Run the pickled ``function(*args)`` on every worker once the server ``server_key`` is gone."""

    server_key: str
    cleanup_id: str
    function: bytes
    args: bytes


class MoveCleanups(NamedTuple):
    """Server ``old_key`` was lost and ``new_key`` took its place: its cleanups wait for the new one."""

    old_key: str
    new_key: str


class RecordMoves(NamedTuple):
    """Lost servers were re-created and restored: batches starting from now on follow them."""

    moves: dict[str, tuple]  # old actor key -> the new server's fields


class OpenInput(NamedTuple):
    """Keep a ledger of who reads what for a new ``dps.data`` dataset (its partitions' keys and rows)."""

    dataset: str
    keys: list[tuple]  # per partition: the keys of its copies
    rows: list[int]
    trainers: list[str]  # the trainers' names now
    resource: str
    options: dict[str, Any]  # batch_size, shuffle, seed, epochs, drop_remainder, exactly_once, topic


class CloseInput(NamedTuple):
    """Forget a dropped ``dps.data`` dataset's ledger."""

    dataset: str


Request = AddCleanup | MoveCleanups | RecordMoves | OpenInput | CloseInput


def ask(request: Request, dask_scheduler: Any = None) -> Any:
    """On the scheduler (``client.run_on_scheduler(ask, request)``): the plugin answers ``request``.

    Without the plugin (a scheduler closing) a ``CloseInput`` has nothing to close; anything else raises.
    """
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None and isinstance(request, CloseInput):
        return None
    if plugin is None:
        raise RuntimeError(f"the scheduler at {dask_scheduler.address} runs no daskps plugin")
    return plugin.answer(request)
