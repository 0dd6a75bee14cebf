"""Settling a function from its trainer's report: which trainer it counts on, and reports that come too late.

A trainer's event is ``[batch_key, [FunctionReport rows], trainer_name]``. The
rules, as ``daskps.coordinator.settling`` states them: a report settles a
function still pending in that same batch, counted on the trainer that sent it;
a report for a function settled already, or queued again into another batch
meanwhile (its server was lost), changes nothing. No cluster: the settler is
handed events as the client's event loop would hand them; the batches' ends are real Dask tasks.
"""

import pickle
import types
import uuid

from daskps.coordinator.batching import BatchPolicy
from daskps.coordinator.book import Book
from daskps.coordinator.recovery import Recovery
from daskps.coordinator.remote import CANCELLED, DONE, FAILED, PENDING, RemoteValue
from daskps.coordinator.settling import Settler
from daskps.scheduler.messages import BIG, ERROR, OK
from daskps.trainer.batches import pickled_error
from tests.helpers.books import queued


def _settler(client=None):
    book = Book()
    recovery = Recovery(book, types.SimpleNamespace(closed=False), types.SimpleNamespace(status="running"))
    published, policy = [], BatchPolicy()
    settler = Settler(book, recovery, policy, types.SimpleNamespace(publish=lambda: published.append(1)), client)
    return book, settler, published, policy


def _in_batch(book, n, key):
    closures = queued(book, n)
    with book.lock:
        for c in book.take(n):
            c.batch = key
    return closures


def _report(closure, value, status=OK, generation=0, seconds=0.01):
    payload = pickle.dumps(value) if status == OK else value
    return [closure.id, status, payload, seconds, generation]  # a row, as Dask's event log hands it over


def test_a_report_settles_its_functions_and_counts_them_on_the_trainer_that_sent_it():
    book, settler, published, policy = _settler()
    a, b = _in_batch(book, 2, "batch-0")
    settler.on_event((0.0, ["batch-0", [_report(a, "A", generation=3)], "worker-1"]))
    settler.on_event((0.0, ["batch-0", [_report(b, {"b": 2})], "worker-2"]))
    assert a.outcome.state == b.outcome.state == DONE
    assert RemoteValue(a.outcome).fetch() == "A" and RemoteValue(b.outcome).fetch() == {"b": 2}
    assert (a.trainer, a.generation) == ("worker-1", 3)
    assert {name: dict(c) for name, c in book.counts.by_trainer.items()} == {"worker-1": {"done": 1},
                                                                             "worker-2": {"done": 1}}
    assert book.finished_by_generation() == {3: 1, 0: 1}
    assert not book.pending
    assert len(published) == 2  # the counts go to the scheduler after each event
    assert policy.seconds_per_function == 0.01  # the durations feed the batching policy


def test_an_error_report_fails_the_function_on_its_trainer_and_is_raised_once():
    book, settler, _, _ = _settler()
    (a,) = _in_batch(book, 1, "batch-0")
    settler.on_event((0.0, ["batch-0", [_report(a, pickled_error(ValueError("bad step")), status=ERROR)], "w-1"]))
    assert a.outcome.state == FAILED
    assert isinstance(a.outcome.error, ValueError) and "bad step" in str(a.outcome.error)
    assert dict(book.counts.by_trainer["w-1"]) == {"failed": 1}
    assert book.take_error() is a.outcome.error


def test_a_report_for_a_function_settled_or_queued_again_meanwhile_changes_nothing():
    book, settler, _, _ = _settler()
    a, b, c = _in_batch(book, 3, "batch-0")
    settler.on_event((0.0, ["batch-0", [_report(a, "first")], "worker-1"]))
    with book.lock:
        book.requeue(b)  # its server was lost: it runs again, in a batch of its own
    settler.on_event((0.0, ["batch-0", [_report(a, "again"), _report(b, "stale"), _report(c, "C")], "worker-2"]))
    assert RemoteValue(a.outcome).fetch() == "first"
    assert b.outcome.state == PENDING and list(book.queue) == [b]
    assert c.outcome.state == DONE  # the reports after a late one still count
    assert RemoteValue(c.outcome).fetch() == "C"
    assert book.counts.totals["done"] == 2
    assert dict(book.counts.by_trainer["worker-2"]) == {"done": 1}
    with book.lock:
        book.take(1)
        b.batch = "batch-1"
    settler.on_event((0.0, ["batch-0", [_report(b, "still stale")], "worker-2"]))  # from the old batch
    assert b.outcome.state == PENDING
    settler.on_event((0.0, ["batch-1", [_report(b, "B")], "worker-2"]))
    assert b.outcome.state == DONE and RemoteValue(b.outcome).fetch() == "B"
    assert dict(book.counts.by_trainer["worker-2"]) == {"done": 2}


# -- a batch's task ends: what its reports left unsettled is settled from the task -------------------------
def _big_results(ids):
    return {i: f"big {i}" for i in ids}


def _batch_fails():
    raise ValueError("the batch's task failed")


def _watched(client, book, settler, key, closures, fn, *args):
    """Submit ``fn`` as the batch's Dask task and let the settler watch it end (on the client's loop)."""
    future = client.submit(fn, *args, key=key, pure=False)
    with book.lock:
        book.batches[key] = (future, closures)
    client.sync(settler.watch, key, future)
    return future


def test_a_finished_batch_settles_big_results_and_fails_what_never_reported(client):
    book, settler, _, _ = _settler(client)
    key = f"test-batch-{uuid.uuid4().hex}"
    big, reported, silent = _in_batch(book, 3, key)
    settler.on_event((0.0, [key, [_report(big, None, status=BIG), _report(reported, "R")], "worker-1"]))
    assert big.outcome.state == PENDING  # its value comes with the task
    future = _watched(client, book, settler, key, [big, reported, silent], _big_results, [big.id])
    assert big.outcome.state == DONE and RemoteValue(big.outcome).fetch() == f"big {big.id}"
    assert RemoteValue(reported.outcome).fetch() == "R"
    assert silent.outcome.state == FAILED
    assert isinstance(silent.outcome.error, RuntimeError)
    assert str(silent.outcome.error) == (f"scheduled function {silent.id} of batch {key!r} ended without "
                                         "reporting its result")
    assert not book.pending and key not in book.batches
    assert book.counts.totals["done"] == 2 and book.counts.totals["failed"] == 1
    assert future.key not in client.futures  # released: the cluster keeps no result of it


def test_a_failed_batch_task_fails_its_unreported_functions_with_the_tasks_error(client):
    book, settler, _, _ = _settler(client)
    key = f"test-batch-{uuid.uuid4().hex}"
    first, second = _in_batch(book, 2, key)
    _watched(client, book, settler, key, [first, second], _batch_fails)
    for c in (first, second):
        assert c.outcome.state == FAILED
        assert isinstance(c.outcome.error, ValueError) and "the batch's task failed" in str(c.outcome.error)
    assert book.take_error() is first.outcome.error


def test_functions_behind_a_failed_one_are_cancelled_when_the_batch_ends(client):
    book, settler, _, _ = _settler(client)
    key = f"test-batch-{uuid.uuid4().hex}"
    failing, behind = _in_batch(book, 2, key)
    settler.on_event((0.0, [key, [_report(failing, pickled_error(KeyError("k")), status=ERROR)], "worker-1"]))
    _watched(client, book, settler, key, [failing, behind], _big_results, [])
    assert failing.outcome.state == FAILED and behind.outcome.state == CANCELLED
    assert book.counts.totals["cancelled"] == 1 and book.counts.totals["failed"] == 1
