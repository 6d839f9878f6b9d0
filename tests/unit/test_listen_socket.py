"""The HTTP server's listening socket (``daemon/service.bind_socket``): each connection asyncio
accepts on it sends without Nagle's wait. With the protocol left unnamed asyncio kept Nagle's
algorithm on, and on a kept-alive connection a response's body waited for the client's delayed
ACK of its headers: 40 ms a request."""

from __future__ import annotations

import asyncio
import socket

import pytest

from strata.daemon.service import ServiceError, bind_socket


async def accepted_nodelay(host: str) -> int:
    """TCP_NODELAY of the server's side of one connection to a socket ``bind_socket`` made."""
    sock = bind_socket(host, 0)
    got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        got.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connection, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        flag = await asyncio.wait_for(got, 60)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    return flag


def test_connections_on_the_servers_socket_send_without_nagles_wait() -> None:
    assert asyncio.run(accepted_nodelay("127.0.0.1")) != 0


def test_so_do_those_on_ipv6() -> None:
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    try:
        bind_socket("::1", 0).close()
    except ServiceError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    assert asyncio.run(accepted_nodelay("::1")) != 0
