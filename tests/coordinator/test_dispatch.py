"""Dispatch counts the trainers again while there is work: a worker that joins gets batches too.

``daskps.coordinator.dispatch`` starts from the strategy's trainer names and,
while functions are queued, asks the scheduler every ``TRAINERS_REFRESH``
seconds how many live workers hold the trainers' resource. Here the
dispatcher is told of one trainer while the shared cluster has two, and is
held (``hold()``: nothing is sent), so only the count is seen to change.
"""

import types

from daskps.coordinator import dispatch
from daskps.coordinator.batching import BatchPolicy
from daskps.coordinator.book import Book
from daskps.coordinator.dispatch import Dispatcher
from daskps.coordinator.recovery import Recovery
from tests.helpers.waiting import wait_until


def test_while_work_is_queued_the_trainers_are_counted_again_from_the_scheduler(strategy, monkeypatch):
    client = strategy.client
    monkeypatch.setattr(dispatch, "TRAINERS_REFRESH", 0.0)  # count at every pump
    told = types.SimpleNamespace(trainer_names=["worker-0"], token=strategy.token,
                                 cluster_resolver=types.SimpleNamespace(worker_resource="worker"))
    book = Book()
    recovery = Recovery(book, told, client)
    dispatcher = Dispatcher(book, told, client, "topic", recovery, settler=None, policy=BatchPolicy(),
                            publisher=types.SimpleNamespace(publish=lambda: None))
    assert dispatcher.trainers == 1
    dispatcher.hold()
    with book.lock:
        book.add((b"f", b"args"), [], 0)
    live = len(strategy.trainer_names)
    assert live == 2
    for _ in range(2):  # a second pump counts again (the count's time was kept)
        client.loop.add_callback(dispatcher.pump)
        wait_until(lambda: dispatcher.trainers == live, what="the trainers counted again")
        dispatcher.trainers = 1
    assert len(book.queue) == 1 and not book.batches  # held: nothing was sent
