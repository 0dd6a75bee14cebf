"""Large replies over the direct channel (partial writev) arrive intact, also under concurrent readers."""

import threading

import numpy as np

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
