"""Large replies over the direct channel (partial writev) arrive intact, also under concurrent readers."""

import threading

import numpy as np
import pytest

import daskps as dps


def test_large_replies_intact_under_concurrent_readers(strategy, coordinator):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(3_000_000).astype(np.float32) for _ in range(3)]  # 12 MB each
    with strategy.scope():
        vs = [dps.Variable(x, name=f"big_{i}") for i, x in enumerate(values)]

    def reader():
        got = dps.read_values(vs)
        return all(np.array_equal(g, x) for g, x in zip(got, values))

    results = []
    threads = [threading.Thread(target=lambda: results.append(reader())) for _ in range(3)]
    for t in threads:
        t.start()
    remote = [coordinator.schedule(reader) for _ in range(4)]
    for t in threads:
        t.join()
    coordinator.join()
    assert results == [True] * 3
    assert [r.fetch() for r in remote] == [True] * 4


def test_an_oserror_raised_by_the_server_is_its_answer_not_a_lost_server(strategy, tmp_path):
    from daskps.errors import PSUnavailableError
    from daskps.ps import protocol

    with strategy.scope():
        v = dps.Variable([1.0], name="v")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError) as raised:  # the server cannot make its directory under a file
        protocol.save(str(blocker / "ckpt"), [(v._ref, "v", 0, [])])
    assert not isinstance(raised.value, PSUnavailableError), raised.value
    assert v.numpy().tolist() == [1.0]  # and the channel still answers in step
