"""``dps.data.from_dask``: Dask collections read by the trainers holding their partitions."""

import gc
import re
import subprocess
import sys
import time

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Event, get_worker, wait

import daskps as dps
from daskps.errors import OutOfRangeError
from daskps.scheduler.ledger import assign
from daskps.scheduler.messages import CloseInput, ask
from tests.helpers.cluster import kill_worker, wait_for_worker
from tests.helpers.paths import ROOT
from tests.helpers.waiting import wait_until

ROWS = 100_000


def _where_and_next(iterator):
    batch = next(iterator, None)
    read_at = time.monotonic_ns()  # a trainer runs one function at a time: this orders its reads
    if batch is None:
        time.sleep(0.05)  # a trainer that is done is slow, so the other one gets the next functions
    return get_worker().name, read_at, batch


def _read_all(coordinator, it, per_round=40, rounds=40):
    """Schedule reads until every trainer has said its data is done: ``{trainer: [batch, ...]}``,
    each trainer's batches in the order its iterator gave them."""
    seen: dict[str, list] = {}
    finished: set[str] = set()
    for _ in range(rounds):
        for name, read_at, batch in coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,))
                                                       for _ in range(per_round)]):
            if batch is None:
                finished.add(name)
            else:
                seen.setdefault(name, []).append((read_at, batch))
        if finished == {"worker-0", "worker-1"}:
            return {name: [b for _, b in sorted(reads, key=lambda r: r[0])] for name, reads in seen.items()}
    raise AssertionError(f"only {finished} reached the end")


@pytest.fixture(scope="module")
def frame():
    return dd.from_pandas(pd.DataFrame({"id": np.arange(ROWS), "x": np.arange(ROWS) * 0.5}), npartitions=10)


def _all_ids(seen):
    return np.sort(np.concatenate([b["id"] for batches in seen.values() for b in batches]))


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_id_is_read_once_over_both_trainers(coordinator, frame, shuffle):
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=1000, shuffle=shuffle))
    seen = _read_all(coordinator, iter(ds))
    assert np.array_equal(_all_ids(seen), np.arange(ROWS))
    assert set(seen) == {"worker-0", "worker-1"}  # both trainers read a share
    ordered = all(np.all(np.diff(np.concatenate([b["id"] for b in bs])) > 0) for bs in seen.values())
    assert ordered != shuffle


def test_batches_are_dicts_of_numpy_columns(coordinator, frame):
    it = iter(coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=64)))
    batch = coordinator.schedule(lambda i: next(i), args=(it,)).fetch()
    assert set(batch) == {"id", "x"}
    assert isinstance(batch["id"], np.ndarray) and batch["id"].shape == (64,)
    assert np.array_equal(batch["x"], batch["id"] * 0.5)


def test_a_seed_repeats_the_order(coordinator, frame):
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=1000, shuffle=True, seed=7))
    first, second = _read_all(coordinator, iter(ds)), _read_all(coordinator, iter(ds))
    assert set(first) == set(second) == {"worker-0", "worker-1"}
    for name in first:
        ids = [np.concatenate([b["id"] for b in run[name]]) for run in (first, second)]
        assert np.array_equal(np.sort(ids[0]), np.sort(ids[1])), f"{name} read other rows the second time"
        assert np.array_equal(ids[0], ids[1]), f"{name} read its rows in another order the second time"


def test_shuffle_reads_the_partitions_in_a_shuffled_order_too(coordinator):
    """Rows are shuffled within a buffer of 10,000 (``daskps.data.shuffle-buffer-rows``) and at least a
    partition; the order of the partitions is shuffled as well. With partitions of 10,000 rows each batch
    comes from one or two of them: in partition order a trainer's batch means climb (correlation with the
    batch's place near 1; shuffled, near 0: a random order of 20 partitions reaches 0.9 about once in
    10^5)."""
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(400_000)}), npartitions=40)
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=5000, shuffle=True, seed=5))
    seen = _read_all(coordinator, iter(ds))
    assert np.array_equal(_all_ids(seen), np.arange(400_000))
    for trainer, batches in seen.items():
        means = [b["id"].mean() for b in batches]
        assert len(means) >= 30 and np.corrcoef(np.arange(len(means)), means)[0, 1] < 0.9, (trainer, means)
        assert not any(np.all(np.diff(b["id"]) == 1) for b in batches)  # rows mixed within the buffer


@pytest.mark.parametrize("exactly_once", [False, True])
def test_each_iterator_of_a_dataset_reads_all_of_it(coordinator, exactly_once):
    """Each iter() is a new pass with its own ledger: a third reads everything as the first did."""
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(3000)}), npartitions=6)
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=250, exactly_once=exactly_once))
    for _ in range(3):
        assert np.array_equal(_all_ids(_read_all(coordinator, iter(ds))), np.arange(3000))


def test_array_and_labels_tuple(coordinator):
    x = da.arange(2000 * 3, chunks=600 * 3).reshape(2000, 3).rechunk((500, 3))
    y = da.arange(2000, chunks=500)
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask((x, y), batch_size=128, drop_remainder=True))

    out = [batch for batches in _read_all(coordinator, iter(ds)).values() for batch in batches]
    for xb, yb in out:
        assert xb.shape == (128, 3) and yb.shape == (128,)
        assert np.array_equal(xb[:, 0], yb * 3)
    assert len(np.unique(np.concatenate([yb for _, yb in out]))) == 128 * len(out)


def test_the_end_is_stop_iteration_inside_and_out_of_range_outside(coordinator):
    x = da.arange(10, chunks=5)
    it = iter(coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=5, epochs=2)))
    for _ in range(12):
        coordinator.schedule(lambda i: next(i), args=(it,))
    with pytest.raises(OutOfRangeError, match="exhausted"):
        coordinator.join()
    # A trainer's iterator ran out (the error); the other trainer's may still hold its own two batches
    # when the twelve functions did not all reach it. Past them, next() gives the default there too.
    got = [coordinator.schedule(lambda i: next(i, "end"), args=(it,)) for _ in range(8)]
    got = [r.fetch() for r in got]
    batches = [g for g in got if not isinstance(g, str)]
    assert any(isinstance(g, str) and g == "end" for g in got) and len(batches) <= 2, got  # ("in" would compare
    # "end" with a batch array element by element)
    assert all(np.asarray(b).shape == (5,) for b in batches), batches


def _transfers(client):
    return client.run(lambda dask_worker: dask_worker.transfer_outgoing_count_total, workers=None)


def test_persisted_partitions_are_read_where_they_lie(client, coordinator):
    trainers = [addr for _, addr in coordinator.strategy.cluster_resolver.training_workers()]
    parts = [client.persist(da.arange(i * 1000, (i + 1) * 1000, chunks=1000), workers=[trainers[i % 2]])
             for i in range(6)]
    x = client.persist(da.concatenate(parts))
    wait(x)
    before = _transfers(client)
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=500))
    seen = _read_all(coordinator, iter(ds))
    assert np.array_equal(np.sort(np.concatenate([b for bs in seen.values() for b in bs])), np.arange(6000))
    assert _transfers(client) == before  # no worker served a partition to another
    held = client.who_has(x)
    for name, batches in seen.items():
        addr = dict(coordinator.strategy.cluster_resolver.training_workers())[name]
        mine = {int(k[1]) for k, where in held.items() if addr in where}
        assert {int(b[0]) // 1000 for b in batches} <= mine


def test_partitions_held_elsewhere_are_fetched_once(client, coordinator):
    trainers = dict(coordinator.strategy.cluster_resolver.training_workers())
    x = client.persist(da.arange(6000, chunks=1000), workers=[trainers["worker-0"]])  # all on worker-0
    wait(x)
    before = _transfers(client)
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=500, epochs=3))
    seen = _read_all(coordinator, iter(ds))
    ids = np.sort(np.concatenate([b for bs in seen.values() for b in bs]))
    assert np.array_equal(ids, np.repeat(np.arange(6000), 3))
    assert {name: len(bs) for name, bs in seen.items()} == {"worker-0": 18, "worker-1": 18}  # balanced by rows
    after = _transfers(client)
    assert after[trainers["worker-0"]] - before[trainers["worker-0"]] == 3  # 3 partitions moved, each sent once


def _busy_until(started, go):
    Event(started).set()
    assert Event(go).wait(30), "the test never let the task go on"


def test_rows_are_counted_where_the_partitions_lie(client, coordinator):
    """A frame's rows are counted (its partitions' lengths are unknown) on the worker that holds each
    partition, even while that worker is busy: counted by whichever idle worker took the task, a partition
    would be copied there, and stay until Dask drops the replica."""
    import threading
    import uuid

    holder = dict(coordinator.strategy.cluster_resolver.training_workers())["worker-0"]
    frame = client.persist(dd.from_pandas(pd.DataFrame({"id": np.arange(4000)}), npartitions=8), workers=[holder])
    wait(frame)
    tag = uuid.uuid4().hex
    busy = client.submit(_busy_until, f"started-{tag}", f"go-{tag}", workers=[holder], pure=False)
    assert Event(f"started-{tag}", client=client).wait(30), "the holder never got busy"
    # for a second the counts wait behind the busy holder while every other worker is idle (Dask's work
    # stealing looks every 100 ms)
    threading.Timer(1.0, Event(f"go-{tag}", client=client).set).start()
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=500))
    assert busy.status == "finished"  # the counting did wait for the holder
    held = client.who_has(frame)
    assert len(held) == 8 and all(list(where) == [holder] for where in held.values()), held
    del ds


def test_a_dropped_dataset_frees_its_partitions(client, coordinator):
    x = da.random.random((4000, 2), chunks=(1000, 2))
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=100))
    it = iter(ds)
    coordinator.schedule(lambda i: next(i), args=(it,)).fetch()

    def held(dask_scheduler, name=x.name):
        return sum(1 for k in dask_scheduler.tasks if isinstance(k, tuple) and k[0] == name)

    assert client.run_on_scheduler(held) == 4
    dataset_id = ds.dataset_id

    def built(dask_worker):
        from daskps.client.worker_state import existing_part

        state = existing_part(dask_worker, "datasets")
        return state is not None and dataset_id in state.datasets

    assert any(client.run(built).values())
    name = ds.dataset_fn.published  # the ledger's name

    def ledger(dask_scheduler):
        return name in dask_scheduler.plugins["daskps"].inputs.ledgers

    assert client.run_on_scheduler(ledger)
    del ds, it
    gc.collect()
    wait_until(lambda: not (client.run_on_scheduler(held) or any(client.run(built).values()) or client.run_on_scheduler(ledger)), 20,
               failure="the partitions, the trainers' readers or the ledger were not released", interval=0.1, collect=False)


def _held_keys(client, name):
    return client.run_on_scheduler(
        lambda dask_scheduler: sum(1 for k in dask_scheduler.tasks if isinstance(k, tuple) and k[0] == name))


def test_closing_the_strategy_frees_the_partitions(client):
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    x = da.random.random(3000, chunks=1000)
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=100))
    coordinator.schedule(lambda i: next(i), args=(iter(ds),)).fetch()
    assert _held_keys(client, x.name) == 3
    strategy.close()
    wait_until(lambda: not _held_keys(client, x.name), 20,
               failure="closing the strategy did not release the partitions", interval=0.1, collect=False)
    with pytest.raises(dps.errors.ClosedError) as err:  # a collection refused as a function is, before any work
        coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=100))
    assert str(err.value) == ("cannot use create_per_worker_dataset: the ParameterServerStrategy it belongs to "
                              "was closed (strategy.close()), which released its parameter servers and "
                              "everything on them")
    assert _held_keys(client, x.name) == 0


def test_a_collection_persisted_by_the_user_stays_persisted(client, coordinator):
    x = client.persist(da.random.random(2000, chunks=1000))
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=100))
    coordinator.schedule(lambda i: next(i), args=(iter(ds),)).fetch()
    del ds
    gc.collect()
    time.sleep(0.5)
    assert _held_keys(client, x.name) == 2
    assert np.asarray(x).shape == (2000,)


def test_epochs_none_repeats_forever(coordinator):
    x = da.arange(100, chunks=50)
    it = iter(coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=50, epochs=None)))
    out = coordinator.fetch([coordinator.schedule(lambda i: next(i), args=(it,)) for _ in range(30)])
    assert len(out) == 30 and all(b.shape == (50,) for b in out)


def test_a_trainer_with_nothing_to_read_ends_even_when_repeating_forever(coordinator):
    x = da.arange(100, chunks=100)  # one partition: one trainer reads nothing
    it = iter(coordinator.create_per_worker_dataset(dps.data.from_dask(x, batch_size=50, epochs=None)))
    seen = {}
    for _ in range(20):
        for name, _, batch in coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,)) for _ in range(20)]):
            seen.setdefault(name, set()).add(batch is None)
        if len(seen) == 2:
            break
    assert sorted(seen.values(), key=lambda v: sorted(v)) == [{False}, {True}]  # one repeats, one always ends


def test_a_dict_of_a_frame_and_an_array(coordinator):
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(1000)}), npartitions=2)
    labels = da.arange(1000, chunks=500) * 2
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask({"x": frame, "y": labels}, batch_size=100))
    batches = [b for bs in _read_all(coordinator, iter(ds)).values() for b in bs]
    assert len(batches) == 10
    for b in batches:
        assert set(b) == {"x", "y"} and np.array_equal(b["y"], b["x"]["id"] * 2)


def test_partitions_go_to_their_holders_balanced_by_rows():
    owners, moved = assign([100, 100, 100, 100], [{"a"}, {"a"}, {"a"}, {"b"}], ["a", "b"])
    assert sorted(len(v) for v in owners.values()) == [2, 2] and moved == 1
    owners, moved = assign([10, 10], [{"a"}, {"b"}], ["a", "b"])
    assert owners == {"a": [0], "b": [1]} and moved == 0


def test_bad_input_is_refused(coordinator):
    pdf = pd.DataFrame({"id": range(10)})
    with pytest.raises(TypeError, match="collection must be a dask DataFrame.*pandas.DataFrame"):
        dps.data.from_dask(pdf, batch_size=2)
    with pytest.raises(ValueError, match=r"collection\[1\] must have the same partitions"):
        dps.data.from_dask((da.ones(10, chunks=5), da.ones(10, chunks=2)), batch_size=2)
    with pytest.raises(ValueError, match=r"collection\['y'\] must have the same rows per partition"):
        dps.data.from_dask({"x": da.ones(10, chunks=(5, 5)), "y": da.ones(10, chunks=(4, 6))}, batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        dps.data.from_dask(da.ones(10, chunks=5), batch_size=0)
    with pytest.raises(ValueError, match="chunked along axis 0 only.*axis 1"):
        dps.data.from_dask(da.ones((10, 4), chunks=(5, 2)), batch_size=2)
    with pytest.raises(ValueError, match="epochs must be"):
        dps.data.from_dask(da.ones(10, chunks=5), batch_size=2, epochs=0)
    with pytest.raises(TypeError, match="shuffle must be True or False, got 'yes'"):
        dps.data.from_dask(da.ones(10, chunks=5), batch_size=2, shuffle="yes")
    with pytest.raises(TypeError, match="exactly_once must be True or False, got 1"):
        dps.data.from_dask(da.ones(10, chunks=5), batch_size=2, exactly_once=1)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 1.5"):
        dps.data.from_dask(da.ones(10, chunks=5), batch_size=1.5)


def test_misaligned_frame_partitions_are_refused_once_counted(coordinator):
    a = dd.from_pandas(pd.DataFrame({"id": range(100)}), npartitions=2)
    b = dd.from_pandas(pd.DataFrame({"y": range(100)}), npartitions=2).repartition(divisions=[0, 30, 99])
    with pytest.raises(ValueError, match=r"collection\[1\] must have the same rows per partition"):
        coordinator.create_per_worker_dataset(dps.data.from_dask((a, b), batch_size=10))


def test_a_restarted_trainer_reads_its_share_again(fresh_cluster):
    cluster, client = fresh_cluster
    coordinator = dps.ClusterCoordinator(dps.ParameterServerStrategy(client))
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(20_000)}), npartitions=4)
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=1000))
    _read_all(coordinator, iter(ds))
    old = kill_worker(client, "worker-1")  # its partitions die with it
    wait_for_worker(client, "worker-1", old)
    seen = _read_all(coordinator, iter(ds))  # Dask recomputes them for the new worker-1
    assert np.array_equal(_all_ids(seen), np.arange(20_000))


def test_the_parquet_example_runs_and_its_loss_falls(cluster):
    script = ROOT / "examples" / "train_from_parquet.py"
    cmd = [sys.executable, str(script), "--rows", "8000", "--test-rows", "2000", "--epochs", "3", "--batch-size", "64",
           "--scheduler", cluster.scheduler_address]  # the shared cluster: starting one would take most of the time
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    held_out = [float(v) for v in re.findall(r"^held-out \w+ training: loss ([\d.]+)", out.stdout, flags=re.M)]
    rounds = [float(v) for v in re.findall(r"^train round \d+: \d+ steps, mean loss ([\d.]+)$", out.stdout, flags=re.M)]
    assert len(held_out) == 2 and len(rounds) >= 3, out.stdout
    assert held_out[1] < 0.5 * held_out[0], out.stdout  # log(4) = 1.386 before
    assert rounds[2] < rounds[0], out.stdout


def _trainer_and_ids(iterator):
    batch = next(iterator, None)
    return get_worker().name, None if batch is None else batch["id"]


def _exactly_once_batches(coordinator, rows, shuffle, seed=3, keep=None):
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(rows)}), npartitions=7)
    data = dps.data.from_dask(frame, batch_size=700, shuffle=shuffle, seed=seed, epochs=2, exactly_once=True)
    dataset = coordinator.create_per_worker_dataset(data)
    it = iter(dataset)
    if keep is not None:  # the dataset lives on (dropped, its ledger goes from the scheduler)
        keep.extend([dataset, it])
    return coordinator.fetch([coordinator.schedule(_trainer_and_ids, args=(it,)) for _ in range(70)])


@pytest.mark.parametrize("shuffle", [False, True])
def test_exactly_once_without_failures_hands_every_row_out_once_per_epoch(coordinator, shuffle):
    rows = 20_000
    kept: list = []
    out = _exactly_once_batches(coordinator, rows, shuffle, keep=kept)
    batches = [ids for _, ids in out if ids is not None]
    assert np.array_equal(np.sort(np.concatenate(batches)), np.repeat(np.arange(rows), 2))
    assert all(len(b) <= 700 for b in batches) and sum(len(b) == 700 for b in batches) >= len(batches) - 14
    assert {name for name, _ in out} == {"worker-0", "worker-1"}
    ordered = all(np.all(np.diff(b) == 1) for b in batches)
    assert ordered != shuffle
    if shuffle:  # the order is the seed's: the same batches again, another order each epoch, another seed's
        as_set = sorted(tuple(b.tolist()) for b in batches)
        assert len(set(as_set)) == len(as_set)  # no batch of the second epoch repeats one of the first
        again = sorted(tuple(ids.tolist()) for _, ids in _exactly_once_batches(coordinator, rows, True) if ids is not None)
        other = sorted(tuple(ids.tolist()) for _, ids in _exactly_once_batches(coordinator, rows, True, seed=4)
                       if ids is not None)
        assert again == as_set and other != as_set

    name = kept[0].dataset_fn.published  # this dataset's ledger (the shuffled case's other two may be there too)

    def remembered(dask_scheduler):  # batches the scheduler keeps for functions that might run again
        ledger = dask_scheduler.plugins["daskps"].inputs.ledgers.get(name)
        return None if ledger is None else (len(ledger.queues), sum(len(q.given) for q in ledger.queues.values()))

    found = coordinator.strategy.client.run_on_scheduler(remembered)
    assert found is not None and found[0] == 1 and found[1] == 0, found  # its ledger, all reported: none kept


def test_exactly_once_with_drop_remainder_hands_out_only_full_batches(coordinator):
    """Exactly once, batches lie within a partition: each partition's last rows short of a batch are left."""
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(20_000)}), npartitions=7)
    sizes = frame.map_partitions(len).compute().tolist()  # 2,858 or 2,857: four batches of 700 and a rest
    data = dps.data.from_dask(frame, batch_size=700, epochs=1, exactly_once=True, drop_remainder=True)
    it = iter(coordinator.create_per_worker_dataset(data))
    out = coordinator.fetch([coordinator.schedule(_trainer_and_ids, args=(it,)) for _ in range(40)])
    batches = [ids for _, ids in out if ids is not None]
    assert [len(b) for b in batches] == [700] * sum(n // 700 for n in sizes) == [700] * 28
    assert len(np.unique(np.concatenate(batches))) == 28 * 700


def _ledgers(dask_scheduler):
    return list(dask_scheduler.plugins["daskps"].inputs.ledgers)


def _ledger_ahead(name, dask_scheduler):
    """The partitions the streaming ledger ``name`` handed each trainer that it has not said it started."""
    ledger = dask_scheduler.plugins["daskps"].inputs.ledgers[name]
    return {it: {trainer: sorted(parts) for trainer, parts in st.ahead.items()} for it, st in ledger.streams.items()}


def test_a_trainer_tells_the_ledger_what_it_started_without_being_asked(client, coordinator):
    """So that a trainer that dies leaves to the others only what it had not started (read ahead, held)."""
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(2000)}), npartitions=20)  # 100 rows a partition
    before = set(client.run_on_scheduler(_ledgers))
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=100))
    (name,) = set(client.run_on_scheduler(_ledgers)) - before
    it = iter(ds)
    started: dict[str, set] = {}
    for trainer, _, batch in coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,)) for _ in range(6)]):
        started.setdefault(trainer, set()).update((batch["id"] // 100).tolist())  # one partition a batch
    # no more reads: only the notes (every 50 ms) can tell it
    def ledger_ahead():
        return client.run_on_scheduler(_ledger_ahead, name)[1]

    wait_until(lambda: not any(set(ledger_ahead()[t]) & parts for t, parts in started.items()), 10,
               failure=lambda: (started, ledger_ahead()), collect=False)
    ahead = ledger_ahead()
    for trainer, parts in started.items():
        assert not set(ahead[trainer]) & parts, (trainer, parts, ahead)  # started: told
        assert ahead[trainer], ahead  # handed ahead, not started yet: held for it


def _count_requests():
    """On a worker: record each request its trainers make to the ledger, waited for (``Source.ask``) or not
    (``Source.ask_ahead``): ``(trainer, "wait", partitions handed?)`` or ``(trainer, "ahead", how many)``
    (0: only notes of the partitions it started)."""
    from daskps.scheduler.messages import Handed
    from daskps.trainer import dask_input

    source = dask_input.Source
    if hasattr(source.ask, "calls"):  # thread workers share one module
        return
    calls, ask, ask_ahead = [], source.ask, source.ask_ahead

    def counted_ask(self, iterator_id, **extra):
        answer = ask(self, iterator_id, **extra)
        calls.append((str(self.worker.name), "wait", bool(Handed.of(answer).partitions)))
        return answer

    def counted_ask_ahead(self, iterator_id, **extra):
        calls.append((str(self.worker.name), "ahead", extra.get("want", 1)))  # the ledger's default: 1
        return ask_ahead(self, iterator_id, **extra)

    counted_ask.calls, counted_ask.originals = calls, (ask, ask_ahead)
    source.ask, source.ask_ahead = counted_ask, counted_ask_ahead


def _requests_counted():
    from daskps.trainer import dask_input

    source = dask_input.Source
    if not hasattr(source.ask, "calls"):
        return []
    calls = source.ask.calls
    source.ask, source.ask_ahead = source.ask.originals
    return calls


def test_a_trainer_waits_for_the_ledger_only_at_its_start_and_its_end(client, coordinator):
    """The rest is asked for ahead, many partitions at once, without waiting: when a quarter of what it
    holds is left, and the next epoch's share while this one is read (a round trip to the scheduler per
    partition would cost more than batching the partition)."""
    # 100 partitions a trainer an epoch: more than one answer holds (LOOKAHEAD, 64)
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(4000)}), npartitions=200)
    it = iter(coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=150, epochs=3)))
    client.run(_count_requests)
    ids, ends = [], {"worker-0": 0, "worker-1": 0}
    try:
        while min(ends.values()) < 2:
            for name, _, batch in coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,))
                                                     for _ in range(20)]):
                if batch is None:
                    ends[name] += 1
                else:
                    ids.append(batch["id"])
    finally:
        calls = [call for calls in client.run(_requests_counted).values() for call in calls]
    assert np.array_equal(np.sort(np.concatenate(ids)), np.repeat(np.arange(4000), 3))  # each row once an epoch
    for name, n_ends in ends.items():
        waits = [handed for trainer, kind, handed in calls if trainer == name and kind == "wait"]
        asked = [want for trainer, kind, want in calls if trainer == name and kind == "ahead" and want]
        # Waited for: its first request, and one at each end reached (asked afresh: a trainer that died
        # meanwhile may have left partitions to read here), which hands nothing.
        assert waits.count(True) == 1 and waits.count(False) == n_ends, (name, n_ends, calls)
        # 300 partitions, up to 64 an answer: 5 answers, and an epoch's end may cut one short.
        assert len(asked) <= 8, (name, calls)


def test_a_trainer_whose_ledger_is_gone_ends_its_iterator(client, coordinator):
    """The scheduler forgets a dataset's ledger when the coordinator drops it; a trainer still reading
    (a function that was running) reads what it holds and then ends, as at the end of the data."""
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(2000)}), npartitions=20)
    before = set(client.run_on_scheduler(_ledgers))
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=100, epochs=None))
    (name,) = set(client.run_on_scheduler(_ledgers)) - before
    it = iter(ds)
    read = coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,)) for _ in range(4)])
    assert all(batch is not None for _, _, batch in read)
    client.run_on_scheduler(ask, CloseInput(name))
    ended: set[str] = set()
    for _ in range(10):  # repeating forever, the data would never end: only the ledger's going ends it
        for trainer, _, batch in coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,))
                                                    for _ in range(10)]):
            if batch is None:
                ended.add(trainer)
        if ended == {"worker-0", "worker-1"}:
            break
    assert ended == {"worker-0", "worker-1"}


def _holders_of(name, dask_scheduler=None):
    return sorted({ws.address for key, ts in dask_scheduler.tasks.items() if name in str(key) for ws in ts.who_has})


def test_a_collection_not_persisted_is_persisted_on_the_trainers_only(client, coordinator):
    """docs/user-guide/datasets.md, Locality: restricted to the trainers by name (never a ps worker)."""
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(4800)}), npartitions=16)
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=300))
    assert np.array_equal(_all_ids(_read_all(coordinator, iter(ds))), np.arange(4800))
    trainers = dict(coordinator.strategy.cluster_resolver.training_workers())
    name = frame.__dask_keys__()[0][0]  # the collection's key name: its partitions are (name, i)
    holders = client.run_on_scheduler(_holders_of, name)
    assert holders and set(holders) <= set(trainers.values()), (holders, trainers)
