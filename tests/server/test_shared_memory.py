"""Large frames of a direct channel through shared memory (``daskps.channel-shared-memory``).

A caller and a server on one machine copy a message's large frames through a
file in ``/dev/shm`` that both map; the socket carries the rest. Checked: the
values arrive exact and stay the caller's own (not views of a region the
next answer overwrites); frames that do not fit go on the socket; a machine
without ``/dev/shm`` uses the socket alone; the server maps only the region
offered; nothing is left in ``/dev/shm``; and in a real cluster the trainers
and servers do map a region while training gives numpy's numbers.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import daskps as dps
from daskps._core import shared
from daskps.client.channel import Channel
from tests.helpers.servers import serving_end

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")


class _Echo:
    """A stand-in server: answers each message with what it got."""

    def execute(self, message, shared_reads=False):
        return list(message)


def _mapped_regions() -> list[str]:
    """The shared regions this process maps (their files' names)."""
    return sorted(_region_sizes())


def _region_sizes() -> dict[str, int]:
    """Bytes mapped of each region, by file name, read from the kernel's map of this process."""
    sizes: dict[str, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/daskps-" in line:
                span, name = line.split()[0], line.split(None, 5)[-1].strip()
                start, end = (int(x, 16) for x in span.split("-"))
                sizes[name] = sizes.get(name, 0) + end - start
    return sizes


@pytest.fixture
def echo():
    """A serving end on its own event loop, and a way to open channels to it."""
    server = _Echo()  # held here: the channel holds it weakly
    end = serving_end(server)
    address, _ = end.__enter__()
    opened = []
    already = set(_region_sizes())  # this test process's own channels to clusters of other tests

    class Echo:
        @staticmethod
        def channel(shared_bytes: int) -> Channel:
            opened.append(Channel(address, 5, shared_bytes))
            return opened[-1]

        @staticmethod
        def sizes() -> dict[str, int]:
            """Bytes mapped of each region this test made."""
            return {name: n for name, n in _region_sizes().items() if name not in already}

        @staticmethod
        def regions() -> list[str]:
            return sorted(Echo.sizes())

    try:
        yield Echo
    finally:
        for ch in opened:
            ch.close()
        end.__exit__(None, None, None)


def _round_trip(ch: Channel, message: list) -> list:
    ch.send(message)
    return ch.receive()


def test_large_frames_cross_through_a_mapped_region_exact_and_stay_the_callers_own(echo):
    mine = f"/dev/shm/daskps-{os.getpid()}-*"  # (other test processes make regions of their own meanwhile)
    before = set(glob.glob(mine))
    ch = echo.channel(16 << 20)
    rng = np.random.default_rng(0)
    first = [rng.normal(size=n).astype(np.float32) for n in (10, 6_000, 300_000, 1_000_000)] + ["a name", 3]
    got = _round_trip(ch, first)
    regions = echo.regions()
    assert len(regions) == 1 and regions[0].endswith("(deleted)"), regions  # both ends map the one file
    for sent, back in zip(first[:4], got[:4]):
        np.testing.assert_array_equal(back, sent)
        assert back.flags.writeable and not np.shares_memory(back, sent)
    assert got[4:] == ["a name", 3]
    # The next answer goes through the same region: the first answer's arrays must not change with it.
    second = [-a for a in first[:4]]
    again = _round_trip(ch, second)
    for sent, back in zip(second, again):
        np.testing.assert_array_equal(back, sent)
    for sent, back in zip(first[:4], got[:4]):
        np.testing.assert_array_equal(back, sent)
    # The caller removed the file once the server had mapped it: /dev/shm holds nothing of this channel.
    assert set(glob.glob(mine)) == before
    ch.close()
    deadline_ok = _wait_for(lambda: not echo.regions())
    assert deadline_ok, f"still mapped after both ends closed: {echo.regions()}"


def test_frames_beyond_the_area_go_on_the_socket_and_a_bigger_message_gets_a_bigger_region(echo):
    ch = echo.channel(1 << 20)  # at most 1 MiB each way
    rng = np.random.default_rng(1)
    message = [rng.normal(size=150_000).astype(np.float32) for _ in range(3)]  # 600 KB each: one fits
    for _ in range(2):
        got = _round_trip(ch, message)
        for sent, back in zip(message, got):
            np.testing.assert_array_equal(back, sent)
    assert len(echo.regions()) == 1
    roomy = echo.channel(64 << 20)
    big = [rng.normal(size=n).astype(np.float32) for n in (100_000, 2_000_000)]
    np.testing.assert_array_equal(_round_trip(roomy, big[:1])[0], big[0])  # a 1 MiB region
    assert max(echo.sizes().values()) < 8 << 20  # 1 MiB areas, mapped by both ends
    got = _round_trip(roomy, big)  # 8.4 MB: offered a larger region, which replaces the first
    for sent, back in zip(big, got):
        np.testing.assert_array_equal(back, sent)
    assert len(echo.regions()) == 2  # one per channel: the first's region was let go by both ends
    assert max(echo.sizes().values()) >= 2 * 2 * 8_000_000  # both ends, each area held the 8 MB frame


def test_without_dev_shm_the_channel_keeps_to_the_socket(echo, monkeypatch, tmp_path):
    monkeypatch.setattr(shared, "DIRECTORY", str(tmp_path / "no-such-directory"))
    ch = echo.channel(16 << 20)
    value = np.arange(500_000, dtype=np.float64)
    for _ in range(2):
        np.testing.assert_array_equal(_round_trip(ch, [value])[0], value)
    assert echo.regions() == []
    assert ch.shared_bytes == 0  # it stopped offering


def test_zero_shared_bytes_keeps_every_frame_on_the_socket(echo):
    ch = echo.channel(0)
    value = np.arange(500_000, dtype=np.float64)
    np.testing.assert_array_equal(_round_trip(ch, [value])[0], value)
    assert echo.regions() == []


def test_a_server_maps_only_the_region_it_was_offered(tmp_path):
    made = shared.create(1 << 20)
    assert made is not None
    region, path, token = made
    try:
        assert shared.attach(path, bytes(16), 1 << 20) is None  # another token
        assert shared.attach(path, token, 2 << 20) is None  # another size
        assert shared.attach(path + "-gone", token, 1 << 20) is None
        outside = tmp_path / "region"
        outside.write_bytes(open(path, "rb").read())
        assert shared.attach(str(outside), token, 1 << 20) is None  # not in /dev/shm
        link = f"/dev/shm/daskps-test-link-{os.getpid()}"
        os.symlink(path, link)
        try:
            assert shared.attach(link, token, 1 << 20) is None  # a link, even to the region itself
        finally:
            os.unlink(link)
        assert shared.attach("/dev/shm/../" + os.path.basename(path), token, 1 << 20) is None
        other = shared.attach(path, token, 1 << 20)
        assert other is not None
        region.requests[:5] = b"hello"
        assert bytes(other.requests[:5]) == b"hello"  # one file, two mappings
        other.close()
    finally:
        os.unlink(path)
        region.close()


def _wait_for(condition, seconds: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _regions_here() -> list[str]:
    return _mapped_regions()


@pytest.mark.cluster
def test_trainers_and_servers_of_a_local_cluster_share_memory_and_train_to_numpys_numbers(client, strategy):
    rng = np.random.default_rng(2)
    w0 = rng.normal(size=(512, 300)).astype(np.float32)  # 600 KB: a large frame each way
    grads = [rng.normal(size=w0.shape).astype(np.float32) for _ in range(4)]
    with strategy.scope():
        w = dps.Variable(w0, name="shared_w")
        opt = dps.optimizers.SGD(0.1)
    coordinator = dps.ClusterCoordinator(strategy)

    def step(g):
        before = w.numpy()
        opt.apply_gradients([(g, w)])
        return float(before.sum())

    sums = [coordinator.schedule(step, args=(g,)) for g in grads]
    coordinator.join()
    expected = w0.copy()
    for g in grads:
        expected -= np.float32(0.1) * g
    # A caller offers a region once it has seen a large answer: the first read teaches it, the second uses it.
    for _ in range(2):
        np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6, atol=1e-6)
    # Each step read w0 less some of the other steps' updates (two trainers run at once): the ones that ran
    # first read w0 itself.
    assert any(s.fetch() == pytest.approx(float(w0.sum()), rel=1e-5) for s in sums)
    # The server maps a region made by this process (the coordinator's reads of w) and one made by a trainer:
    # each region file is named after the process that made it.
    server = w.handle.server.address
    makers = {int(name.split("daskps-")[1].split("-")[0]) for name in client.run(_regions_here)[server]}
    trainers = {pid for address, pid in client.run(os.getpid).items() if address != server}  # (ps call no ps)
    assert os.getpid() in makers, f"the coordinator's reads of w went by the socket: {makers}"
    assert makers & trainers, f"no trainer's channel to the server has a region: {makers}, trainers {trainers}"


def test_a_region_file_left_by_a_killed_process_is_removed_by_the_next_process_that_makes_one(tmp_path):
    """A region's file lives only for its handshake; a caller killed in that moment leaves it behind. The
    next process of the same user that makes a region removes the files of processes that have ended,
    and leaves the others' alone."""
    import subprocess
    import sys

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    left = f"/dev/shm/daskps-{ended.pid}-0123456789abcdef"
    alive = f"/dev/shm/daskps-{os.getpid()}-0123456789abcdef"
    other = f"/dev/shm/not-daskps-{ended.pid}"
    for path in (left, alive, other):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
    try:
        made = subprocess.run([sys.executable, "-c", "from daskps._core import shared\n"
                               "region, path, token = shared.create(1 << 20)\n"
                               "shared.unlink(path)\nprint('made')"],
                              capture_output=True, text=True, timeout=60)
        assert made.stdout.strip() == "made", made.stderr
        assert not os.path.exists(left), "the file of an ended process is still there"
        assert os.path.exists(alive) and os.path.exists(other)
    finally:
        for path in (left, alive, other):
            if os.path.exists(path):
                os.unlink(path)


def test_a_channel_opened_again_names_its_keys_anew_to_the_new_connection(echo):
    """Compact messages name each key once per connection (:mod:`daskps.server.compact`): after the
    channel closes (as after an interrupt) its next connection must learn them again."""
    from daskps.server import ops

    ch = echo.channel(16 << 20)
    grad = np.arange(50_000, dtype=np.float32)  # 200 KB: through the region once there is one
    message = [ops.Isolate(1), ops.ApplyGradients("opt", [("w", "dense", grad)], None), ops.Read(["w"])]
    for reopen in (False, False, True, False):
        if reopen:
            ch.close()
        back = _round_trip(ch, message)
        assert back[0] == ops.Isolate(1) and back[2] == ops.Read(["w"])
        assert back[1].opt_key == "opt" and back[1].items[0][0] == "w"
        np.testing.assert_array_equal(back[1].items[0][2], grad)
