"""The D-Bus edge's connection keeping, without a bus: the reconnection backoff, and the socket
guard under dbus-fast's real message writer (a socket pair stands in for the bus).

The guard exists for two things dbus-fast gets wrong: a full socket buffer (EAGAIN) ended the
connection (python-dbus-next#153 — what dropped Strata off the bus for good under 103 leases
of 1 KB strings), and a message sent after the connection is gone was written to the closed
socket's descriptor, whose number a new connection may already use.
"""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from dbus_fast import Message
from dbus_fast.aio.message_bus import _MessageWriter

from strata.ipc.dbus import RECONNECT_MAX_S, guard_writes, reconnect_delay_s


def test_reconnection_waits_double_from_half_a_second_up_to_30_s() -> None:
    waits = [reconnect_delay_s(n) for n in range(10)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
    assert reconnect_delay_s(10**6) == RECONNECT_MAX_S


def signal(serial: int, text: str) -> Message:
    return Message.new_signal("/org/strata/Strata1", "org.strata.Test", "Big", "s", [text])


class FakeBus(SimpleNamespace):
    """What dbus-fast's writer reads from its bus; ``_finalize`` is how it drops a connection."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(
            _negotiate_unix_fd=False, _sock=sock, _loop=asyncio.get_running_loop(),
            _fd=sock.fileno(), unique_name=":1.1", _user_disconnect=False, _disconnected=False,
            dropped=[],
        )  # fmt: skip
        self._writer = _MessageWriter(self)

    def _finalize(self, err: Exception | None = None) -> None:
        self.dropped.append(err)


async def _read(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < n:
        chunk = await loop.sock_recv(sock, 1 << 16)
        assert chunk, "the writer's end closed"
        got += chunk
    return bytes(got)


def test_a_full_socket_buffer_waits_instead_of_dropping_the_connection() -> None:
    async def scenario() -> None:
        ours, bus_end = socket.socketpair()
        for s in (ours, bus_end):
            s.setblocking(False)
        bus = FakeBus(ours)
        guard_writes(bus)
        big = signal(1, "x" * 2_000_000)  # far beyond the socket's buffer
        small = signal(2, "after")
        big.serial, small.serial = 1, 2
        loop = asyncio.get_running_loop()
        sent = [loop.create_future(), loop.create_future()]
        bus._writer.schedule_write(big, sent[0])
        bus._writer.schedule_write(small, sent[1])  # the buffer is full now: EAGAIN
        assert bus.dropped == []
        want = bytes(big._marshall(False)) + bytes(small._marshall(False))
        got = await asyncio.wait_for(_read(bus_end, len(want)), 60)
        assert got == want  # both whole, in order
        await asyncio.wait_for(asyncio.gather(*sent), 60)
        assert bus.dropped == []
        ours.close()
        bus_end.close()

    asyncio.run(scenario())


def test_what_is_sent_after_the_connection_went_is_dropped_not_written() -> None:
    async def scenario() -> None:
        ours, bus_end = socket.socketpair()
        ours.setblocking(False)
        bus = FakeBus(ours)
        guard_writes(bus)
        guard_writes(bus)  # twice is once
        bus._disconnected = True
        ours.close()  # its descriptor number is free for a new connection to take
        late = signal(3, "too late")
        late.serial = 3
        sent = asyncio.get_running_loop().create_future()
        bus._writer.schedule_write(late, sent)
        await asyncio.wait_for(sent, 10)
        assert bus.dropped == []  # dbus-fast's error path was never entered
        bus_end.close()

    asyncio.run(scenario())
