"""The process side of `kind="process"` snapshots: a Python environment that can fork frozen templates and live copies.

Run as `python -m openk3.sandbox.process.forkserver module:factory <socket fd>`; the first message on the socket carries the
factory's kwargs (not the command line, which every host user can read). The process builds the environment once and serves
requests on its socket:

  call      run env.<method>(*args, **kwargs) and reply with its JSON result (live copies only);
  snapshot  fork a *template*: a child that keeps this exact memory and only waits for `spawn` (the snapshot);
  spawn     (to a template) fork a *live copy* of the template's memory, reseed its RNGs, hand it the socket that came with
            the message; restore and fork(n) are spawns.

Every copy shares memory with its template copy-on-write, so a snapshot costs one fork (page tables, not pages) and a later
change in the parent is invisible to the copies. Only this process's memory is captured: open sockets, threads other than the
main one and external state are not (see docs/sandbox.md). Forked children are reaped automatically (SIGCHLD ignored).
"""

from __future__ import annotations

import importlib
import os
import random
import signal
import socket
import sys
import traceback
from typing import Any

from openk3.sandbox.process import wire


def reseed(env: Any, seed: int) -> None:
    """A copy must not replay its siblings' random streams: reseed Python's RNG, numpy's if loaded, and the env's own."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    if hasattr(env, "reseed"):
        env.reseed(seed)


def _fork_child(sock: socket.socket, fds: list[int]) -> tuple[int, socket.socket | None]:
    """Fork; the child switches to the socket it was handed. Returns (pid, None) in the parent and (0, new socket) in the child."""
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid, None
    sock.close()
    return 0, socket.socket(fileno=fds[0])


def serve_template(sock: socket.socket, env: Any) -> None:
    while True:
        try:
            msg, fds = wire.recv(sock)
        except EOFError:
            os._exit(0)
        if msg["op"] == "spawn" and fds:
            pid, child = _fork_child(sock, fds)
            if pid == 0 and child is not None:
                reseed(env, int(msg.get("seed", 0)))
                wire.send(child, {"ok": True, "pid": os.getpid()})
                serve_live(child, env)
            wire.send(sock, {"ok": True, "pid": pid})
        elif msg["op"] == "exit":
            os._exit(0)
        else:
            wire.send(sock, {"ok": False, "error": f"op={msg['op']!r}: a template accepts only spawn and exit"})


def serve_live(sock: socket.socket, env: Any) -> None:
    while True:
        try:
            msg, fds = wire.recv(sock)
        except EOFError:
            os._exit(0)
        op = msg.get("op")
        if op == "snapshot" and fds:
            pid, child = _fork_child(sock, fds)
            if pid == 0 and child is not None:
                serve_template(child, env)
            wire.send(sock, {"ok": True, "pid": pid})
        elif op == "call":
            try:
                method = getattr(env, msg["method"])
                if msg["method"].startswith("_") or not callable(method):
                    raise AttributeError(f"method={msg['method']!r}: not a public method of the environment")
                result = method(*msg.get("args", []), **msg.get("kwargs", {}))
                wire.send(sock, {"ok": True, "result": result})
            except Exception as e:  # the environment's own error goes back to the caller, the server keeps running
                wire.send(sock, {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=5)})
        elif op == "exit":
            os._exit(0)
        else:
            wire.send(sock, {"ok": False, "error": f"op={op!r}: expected call, snapshot or exit"})


def load_factory(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"factory={spec!r}: expected 'package.module:callable'")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str]) -> None:
    factory, fd = argv[0], int(argv[1])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    kwargs = wire.recv(sock)[0]["kwargs"]  # from the host, not argv: a command line is readable by every host user
    env = load_factory(factory)(**kwargs)
    wire.send(sock, {"ok": True, "pid": os.getpid()})
    serve_live(sock, env)


if __name__ == "__main__":
    main(sys.argv[1:])
