"""Length-prefixed JSON messages over a Unix socket, with optional file descriptors (SCM_RIGHTS) riding on a message.

Used between the host and fork-server processes. JSON rather than pickle: the host must never unpickle what an environment
process sends.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 * 2**20


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    body = json.dumps(message).encode()
    data = HEADER.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it; EOFError when the peer closed the socket."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 4)
    if not data:
        raise EOFError("peer closed the socket")
    while len(data) < HEADER.size:
        more = sock.recv(HEADER.size - len(data))
        if not more:
            raise EOFError("peer closed the socket mid-message")
        data += more
    (size,) = HEADER.unpack(data[: HEADER.size])
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes exceeds the {MAX_MESSAGE}-byte limit")
    body = bytearray(data[HEADER.size :])
    while len(body) < size:
        more = sock.recv(size - len(body))
        if not more:
            raise EOFError("peer closed the socket mid-message")
        body += more
    return json.loads(bytes(body)), list(fds)
