"""A direct channel to a server on the caller's own machine goes over a Unix socket, elsewhere over TCP.

The server listens on both: its TCP port and a Unix socket under a random
name in Linux' abstract namespace, given in its address after ``|``. A
caller on the same machine reaches the name; one on another machine (here:
a name no server of this machine has) does not, and uses TCP. Both carry the
same messages, large frames through shared memory included.
"""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest

from daskps.client.channel import Channel
from tests.helpers.servers import serving_end
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the abstract namespace is Linux'")


class _Echo:
    """A stand-in server: answers each message with what it got."""

    def __init__(self):
        self.messages = 0

    def execute(self, message, shared_reads=False):
        self.messages += 1
        return list(message)


@pytest.fixture
def served():
    server = _Echo()  # held here: the channel holds it weakly
    with serving_end(server) as (address, close):
        yield server, address, close


def _round_trips(ch: Channel) -> None:
    small = [("read", 3)]
    large = [np.arange(300_000, dtype=np.float32)]  # 1.2 MB: through shared memory where it can
    for message in (small, large, small):
        ch.send(message)
        got = ch.receive()
        assert len(got) == len(message)
        for g, m in zip(got, message):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(m))


def test_the_address_names_a_tcp_port_and_a_random_local_socket(served):
    _, address, _ = served
    tcp, sep, local = address.partition("|")
    host, port = tcp.rsplit(":", 1)
    assert sep and host == "127.0.0.1" and int(port) > 0
    assert local.startswith("daskps-") and len(local) == len("daskps-") + 32  # 128 random bits
    listening = open("/proc/net/unix").read()
    assert f"@{local}" in listening  # in the abstract namespace: no file anywhere


def test_a_caller_on_the_servers_machine_talks_over_the_unix_socket(served):
    server, address, _ = served
    ch = Channel(address, 5, shared_bytes=16 << 20)
    try:
        _round_trips(ch)
        assert ch.local and ch.connected
        assert server.messages == 3
    finally:
        ch.close()


def test_a_caller_that_cannot_reach_the_name_uses_tcp(served):
    """As a caller on another machine: no socket of that name where it looks, so TCP."""
    server, address, _ = served
    tcp = address.partition("|")[0]
    for elsewhere in (f"{tcp}|daskps-{'0' * 32}", tcp):  # a name not served here; an address without one
        ch = Channel(elsewhere, 5, shared_bytes=16 << 20)
        try:
            _round_trips(ch)
            assert ch.connected and not ch.local
        finally:
            ch.close()
    assert server.messages == 6


def _refused(name: str) -> bool:
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        caller.connect("\0" + name)
        return False
    except ConnectionRefusedError:
        return True
    finally:
        caller.close()


def test_a_closed_channel_stops_listening_on_its_unix_socket_too(served):
    _, address, close = served
    local = address.partition("|")[2]
    assert not _refused(local)
    close()  # as when Dask drops the server's actor
    wait_until(lambda: _refused(local), timeout=10, what="the local socket refused")
    assert f"@{local}" not in open("/proc/net/unix").read()
