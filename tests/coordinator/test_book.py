"""The coordinator's book on its own: queue order, settling, counts, first error, cancelling, waiting.

The rules checked here are the ones ``ClusterCoordinator`` documents (functions
run in the order scheduled, a re-run goes back before later ones, the first
error is raised once, a cancel settles everything pending); the book knows no
Dask, so these tests start no cluster.
"""

import threading

import pytest

from daskps.coordinator.book import Book
from daskps.coordinator.remote import CANCELLED, DONE, FAILED, PENDING, RemoteValue
from daskps.errors import CancelledError
from tests.helpers.books import queued
from tests.helpers.waiting import wait_until


def _book_with(n):
    book = Book()
    return book, queued(book, n)


def _ran_on(book, closure, trainer, generation=0):
    """What settling does with a function's report: its trainer and generation, its result."""
    closure.trainer, closure.generation = trainer, generation
    closure.outcome.finish(b"", raw=closure.id)
    book.done(closure)


def test_functions_are_queued_and_taken_in_the_order_scheduled():
    book, closures = _book_with(5)
    assert [c.id for c in closures] == [0, 1, 2, 3, 4]
    assert book.counts.totals["scheduled"] == 5
    assert set(book.pending) == {0, 1, 2, 3, 4}
    assert book.take(2) == closures[:2]
    assert list(book.queue) == closures[2:]
    assert set(book.pending) == {0, 1, 2, 3, 4}  # taken into a batch is still pending
    assert book.take(0) == []


def test_a_rerun_goes_back_before_the_functions_scheduled_after_it():
    book, closures = _book_with(6)
    with book.lock:  # the book is changed under its lock, as the coordinator does
        first = book.take(3)
        book.requeue(first[1])
        assert [c.id for c in book.queue] == [1, 3, 4, 5]
        book.requeue(first[0])
        book.requeue(first[2])
        assert [c.id for c in book.queue] == [0, 1, 2, 3, 4, 5]
        assert book.counts.totals["rerun"] == 3


def test_a_rerun_is_counted_on_the_trainer_it_failed_on_and_forgets_it():
    book, closures = _book_with(2)
    with book.lock:  # the book is changed under its lock, as the coordinator does
        a, b = book.take(2)
        a.trainer, a.batch = "trainer-1", "batch-key"
        book.requeue(a)
        assert (a.trainer, a.batch) == ("", None)
        book.requeue(b)  # never ran (behind a failed one in its batch): no trainer to count it on
        assert book.counts.totals["rerun"] == 2
        assert {name: dict(c) for name, c in book.counts.by_trainer.items()} == {"trainer-1": {"rerun": 1}}


def test_a_function_done_leaves_pending_and_counts_on_its_trainer_and_generation():
    book, (a, b, c) = _book_with(3)
    with book.lock:  # the book is changed under its lock, as the coordinator does
        book.take(3)
        _ran_on(book, a, "t0", generation=0)
        _ran_on(book, b, "t1", generation=2)
        assert set(book.pending) == {c.id}
        assert book.counts.totals["done"] == 2 and book.counts.totals["failed"] == 0
        assert dict(book.counts.by_trainer["t0"]) == {"done": 1}
        assert book.finished_by_generation() == {0: 1, 2: 1}
        assert RemoteValue(a.outcome).fetch() == a.id


def test_a_failure_is_counted_as_failed_not_done_and_its_error_raised_once():
    book, (a, b, c) = _book_with(3)
    with book.lock:  # the book is changed under its lock, as the coordinator does
        book.take(3)
        first, second = ValueError("first"), KeyError("second")
        a.trainer = "t0"
        book.fail(a, first)
        book.fail(b, second)
        assert a.outcome.state == FAILED and a.outcome.error is first
        assert book.counts.totals["failed"] == 2 and book.counts.totals["done"] == 0
        assert dict(book.counts.by_trainer["t0"]) == {"failed": 1}
        assert book.finished_by_generation() == {}  # failures count in no generation
        assert book.last_error is second
        assert book.take_error() is first
        assert book.take_error() is None  # raised once
        assert set(book.pending) == {c.id}


def test_functions_not_run_behind_a_failed_one_are_cancelled_not_failed():
    book, (a, b) = _book_with(2)
    with book.lock:  # the book is changed under its lock, as the coordinator does
        book.take(2)
        book.not_run(b)
        assert b.outcome.state == CANCELLED
        assert book.counts.totals["cancelled"] == 1 and book.counts.totals["failed"] == 0
        assert set(book.pending) == {a.id}
        assert book.error is None
        with pytest.raises(CancelledError):
            RemoteValue(b.outcome).fetch()


def test_cancel_all_settles_every_pending_function_and_hands_back_the_batches_in_flight():
    book, closures = _book_with(4)
    with book.lock:  # the book is changed under its lock, as the coordinator does
        book.take(2)
        _ran_on(book, closures[0], "t0")
        book.batches["k1"] = ("future-1", closures[1:2])
        book.batches["k2"] = ("future-2", [])
        n, futures = book.cancel_all()
        assert n == 3
        assert futures == ["future-1", "future-2"]
        assert not book.pending and not book.queue
        assert [c.outcome.state for c in closures] == [DONE, CANCELLED, CANCELLED, CANCELLED]
        assert book.counts.totals["cancelled"] == 3


def test_wait_for_returns_once_another_thread_settles_the_function():
    book, (a, b) = _book_with(2)
    book.take(2)
    fetched = []
    waiter = threading.Thread(target=lambda: fetched.append(RemoteValue(b.outcome).fetch()))
    waiter.start()
    wait_until(lambda: book.fetching == 1, what="the fetch waiting on the book")
    with book.lock:
        _ran_on(book, a, "t0")  # another function's result wakes the waiter, which waits on
    assert waiter.is_alive() and b.outcome.state == PENDING
    with book.lock:
        _ran_on(book, b, "t0")
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert fetched == [b.id]
    assert book.fetching == 0


def test_join_is_woken_when_the_last_function_settles_or_on_an_error():
    """``join`` waits on the condition until nothing is pending or an error is recorded."""
    for settle in ("all done", "an error"):
        book, (a, b) = _book_with(2)
        book.take(2)
        waiting, woke = threading.Event(), threading.Event()

        def join(book=book, waiting=waiting, woke=woke):
            with book.lock:
                waiting.set()  # under the lock: taking it below means this thread is in wait()
                while book.pending and book.error is None:
                    book.lock.wait()  # no timeout: only a notify ends this wait
            woke.set()

        waiter = threading.Thread(target=join, daemon=True)
        waiter.start()
        assert waiting.wait(timeout=10)
        with book.lock:
            _ran_on(book, a, "t0")
        if settle == "all done":
            with book.lock:
                _ran_on(book, b, "t0")
        else:
            with book.lock:
                book.fail(b, RuntimeError("boom"))
        assert woke.wait(timeout=10), settle
