"""Large replies over the direct channel (partial writev) arrive intact, also under concurrent readers."""

import threading
import time

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
    from daskps.client import protocol
    from daskps.errors import PSUnavailableError

    with strategy.scope():
        v = dps.Variable([1.0], name="v")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="Not a directory") as raised:  # the server cannot make its directory under a file
        protocol.save(str(blocker / "ckpt"), [(v.handle, "v", 0, [])])
    assert not isinstance(raised.value, PSUnavailableError), raised.value
    assert v.numpy().tolist() == [1.0]  # and the channel still answers in step


def test_the_channel_format_keeps_every_array_as_it_was():
    """Small numeric arrays share one frame (``wire.pack_grouped``); everything else pickles as usual."""
    from daskps._core import wire

    cases = [np.arange(3, dtype=np.int8), np.arange(5.0), np.arange(12.0).reshape(3, 4).T, np.zeros((0, 3)),
             np.array(5.0), np.arange(4, dtype=">f4"), np.zeros(3, [("a", "i4"), ("b", "f8")]),
             np.array(["x", None], object), np.zeros(20_000), np.arange(6, dtype=np.complex64), np.ones(3, bool),
             np.arange(10.0)[::2], np.float32(2.5)]
    message = ["op", cases, {"again": cases[1]}]
    for by_value in (False, True):
        frames = [bytearray(f) for f in wire.pack_grouped(message, by_value)]  # as read from a socket
        assert len(frames) == 4  # header, table, the small arrays' data, the one large array
        out = wire.unpack_grouped(frames)
        assert len(out[1]) == len(cases)  # zip below would stop at the shorter
        for sent, got in zip(cases, out[1]):
            assert type(got) is type(sent) and got.dtype == sent.dtype and got.shape == sent.shape
            if sent.dtype.kind != "O":
                np.testing.assert_array_equal(got, sent)
            if isinstance(sent, np.ndarray) and sent.dtype.kind in "biufc":
                assert got.flags.writeable and got.flags.aligned
        assert out[2]["again"] is out[1][1]  # one array sent twice is one array
        out[1][1][0] = 99.0
        assert out[1][0][0] == 0 and out[1][2][0, 0] == 0  # views of one buffer, apart


def test_threads_pruning_channels_to_gone_servers_at_once_forget_each_and_none_raises():
    """Several threads of one process (a coordinator's, or trainers that are threads) meet channels whose
    server has gone at the same moment: each is closed and forgotten, and none raises (one thread used to look
    at a socket another was closing: ``ValueError: file descriptor cannot be a negative integer``)."""
    import socket

    from daskps.client import channel

    listener = socket.create_server(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    errors: list[BaseException] = []
    for _ in range(30):
        chans = {f"server-{i}": channel.Channel(address, 5.0) for i in range(40)}
        for ch in chans.values():
            ch.connect()
            listener.accept()[0].close()  # the server's end goes: each channel is now dead
        barrier = threading.Barrier(6)

        def prune(chans=chans, barrier=barrier):
            barrier.wait()
            try:
                channel.prune(chans)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=prune) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not chans  # every dead channel forgotten
    listener.close()
    assert errors == []


def test_a_server_listening_where_a_released_one_did_gets_a_channel_of_its_own():
    """A server made after another's release may be given the port the old one listened on (the same
    host for every worker of a machine): the old server's channel, still open in a trainer, must not
    carry the new server's requests (they reached the old connection, which closed: "dropped its
    channel", seen once in CI)."""
    import socket

    from daskps.client.routing import ServerRef
    from daskps.client.transport import Channels

    channels = Channels()
    old_listener = socket.create_server(("127.0.0.1", 0))
    port = old_listener.getsockname()[1]
    old = ServerRef("tcp://127.0.0.1:1", "old-server", 0, f"127.0.0.1:{port}")
    old_channel = channels.get(old)
    old_channel.connect()
    old_end = old_listener.accept()[0]  # the old server's end stays open: it has not noticed yet
    old_listener.close()
    new_listener = socket.create_server(("127.0.0.1", port))  # the new server, on the same port
    new = ServerRef("tcp://127.0.0.1:2", "new-server", 1, f"127.0.0.1:{port}")
    new_channel = channels.get(new)
    assert new_channel is not old_channel
    new_channel.connect()
    new_end = new_listener.accept()[0]  # it reached the new server
    assert channels.get(old) is old_channel and channels.get(new) is new_channel
    channels.forget([old])
    assert channels.get(new) is new_channel and not old_channel.connected  # closed; the new one kept
    channels.forget([new])
    for sock in (old_end, new_end, new_listener):
        sock.close()


class _Answers:
    """A stand-in server for the serving end: answers every request."""

    def execute(self, message, shared_reads=False):
        return ["answered"]


@pytest.mark.parametrize("over", ["tcp", "local"])
def test_a_caller_that_connected_as_the_server_closed_is_answered_or_closed_never_left_waiting(over):
    """A caller that connected just as the server's listener closed (its actor dropped) and then sends a
    request gets an answer or a closed connection at once. asyncio's own server dropped a connection it had
    accepted just before closing, unclosed: the caller waited about a minute, until the garbage collector
    closed that socket (seen as a 50-80 s read of a released server in the suite)."""
    import asyncio
    import socket

    from daskps._core import shared, wire
    from daskps.server import serving

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    request = b"".join(bytes(p) for p in shared.place(wire.pack_grouped([("read",)], False), None))
    outcomes = {"answered": 0, "closed": 0, "waiting": 0}
    try:
        for _ in range(300):  # the old listener left about one in 30 of these waiting
            server = _Answers()
            address, close = serving.open_channel(server, "127.0.0.1", loop)
            tcp, _, local = address.partition("|")
            if over == "tcp":
                host, port = tcp.rsplit(":", 1)
                caller = socket.create_connection((host, int(port)))
            else:  # the server's Unix socket, in Linux' abstract namespace
                caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                caller.connect("\0" + local)
            closer = threading.Thread(target=close)  # as the caller's connection is being accepted
            closer.start()
            caller.settimeout(5)
            try:
                caller.sendall(request)
                outcomes["answered" if caller.recv(8) else "closed"] += 1
            except TimeoutError:
                outcomes["waiting"] += 1
            except OSError:  # reset: refused once the listener closed
                outcomes["closed"] += 1
            finally:
                closer.join()
                caller.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
    assert outcomes["waiting"] == 0, f"callers left waiting 5 s for an answer or a close: {outcomes}"
    assert outcomes["answered"] + outcomes["closed"] == 300


def test_a_traced_round_trip_records_each_hop_at_each_end_in_the_order_they_happen(monkeypatch):
    """With tracing on (``profile_step.py --trace``), one request through a real channel records the caller's
    send, wait and receive, and the server's read-in, execute and write: each once, each ending after it
    starts, the server's work inside the caller's round trip."""
    import asyncio

    from daskps._core import trace
    from daskps.client.channel import Channel
    from daskps.server import serving

    monkeypatch.setattr(trace, "ON", True)
    trace.collect()
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    server = _Answers()  # held here: the channel holds it weakly
    address, close = serving.open_channel(server, "127.0.0.1", loop)
    caller = Channel(address, 5)
    try:
        caller.send([("read",)])
        assert caller.receive() == ["answered"]
    finally:
        caller.close()
        close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
    # The server records its write once the answer is out: maybe just after the caller has it.
    deadline = time.monotonic() + 10
    while "write" not in {hop for hop, _, _ in trace.collect(clear=False)} and time.monotonic() < deadline:
        time.sleep(0.01)
    rows = trace.collect()
    spans = {hop: (start, end) for hop, start, end in rows}
    assert sorted(hop for hop, _, _ in rows) == sorted(["send", "wait", "receive", "read in", "execute", "write"])
    assert all(start <= end for start, end in spans.values()), spans
    assert spans["send"][0] <= spans["read in"][0] <= spans["execute"][0] <= spans["execute"][1]
    assert spans["execute"][1] <= spans["write"][0] and spans["execute"][1] <= spans["wait"][1]
    assert spans["wait"][1] <= spans["receive"][0] and spans["send"][1] <= spans["wait"][0]
    assert not trace.collect()  # collected once
