"""sd_notify with the standard library: addresses, message lines, the watchdog interval, and sends
that fail without raising."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.daemon.sdnotify import Notifier, http_status, watchdog_loop


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify"
    sock.bind(str(path))
    sock.settimeout(2)
    yield str(path), sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_messages_are_the_documented_lines(listener: tuple[str, socket.socket]) -> None:
    address, sock = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": address})
    assert n.enabled
    assert n.status("loading (1/5): tokenizer")
    assert received(sock) == ["STATUS=loading (1/5): tokenizer"]
    n.extend_timeout(300)
    assert received(sock) == ["EXTEND_TIMEOUT_USEC=300000000"]
    n.ready("serving")
    assert received(sock) == ["READY=1", "STATUS=serving"]
    n.watchdog()
    assert received(sock) == ["WATCHDOG=1"]
    n.stopping()
    assert received(sock) == ["STOPPING=1"]
    n.status("two\nlines")  # a newline would start a bogus field
    assert received(sock) == ["STATUS=two lines"]
    n.close()


def test_abstract_socket_names_start_with_at() -> None:
    name = f"strata-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        assert Notifier.from_env({"NOTIFY_SOCKET": "@" + name}).ready()
        assert received(sock) == ["READY=1"]
    finally:
        sock.close()


def test_without_notify_socket_nothing_is_sent() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.ready() is False and n.watchdog() is False
    assert Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled is False


def test_a_failed_send_returns_false_and_does_not_raise(tmp_path: Path) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert n.enabled
    assert n.ready() is False
    assert n.watchdog() is False


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_for_our_pid(
    env: dict[str, str], interval: float | None
) -> None:
    assert Notifier.from_env({"NOTIFY_SOCKET": "/x", **env}).watchdog_interval_s == interval


def test_watchdog_loop_pings_from_the_event_loop(listener: tuple[str, socket.socket]) -> None:
    address, sock = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "100000"})

    async def main() -> None:
        task = asyncio.create_task(watchdog_loop(n))
        await asyncio.sleep(0.17)  # pings at 0, 50, 100 and 150 ms
        task.cancel()

    asyncio.run(main())
    sock.settimeout(0.1)
    pings = []
    with pytest.raises(TimeoutError):
        while True:
            pings += received(sock)
    assert pings == ["WATCHDOG=1"] * len(pings) and 2 <= len(pings) <= 5


def test_http_status_reads_the_status_line() -> None:
    async def main() -> tuple[int | None, int | None]:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        got = await http_status("127.0.0.1", port, "/health")
        server.close()
        await server.wait_closed()
        closed = await http_status("127.0.0.1", port, "/health")
        return got, closed

    assert asyncio.run(main()) == (503, None)
