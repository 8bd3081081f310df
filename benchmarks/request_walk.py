"""Which of openk3's files one request passes through: `POST /v1/chat/completions`, streamed, against `openk3 serve`.

The server runs in a child process whose every thread records the openk3 source files of the functions it calls
(`sys.setprofile` and `threading.setprofile`), but only between two signals the script sends around one request, after a
warm-up request has paid for lazy imports and first-use setup. So the count is the files the request's own code runs in:
HTTP handling, the engine thread's steps while the request is in flight, the model's forward. `--code DIR` runs the server
from another checkout (a before/after of a refactor with the same client).

    .venv/bin/python benchmarks/request_walk.py [--code DIR] [--model tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs `openk3 serve` with a recorder that SIGUSR1 starts and SIGUSR2 stops, writing the files it saw to $WALK_OUT.
SERVER = r"""
import os, signal, sys, threading
root = os.path.join(sys.argv[1], "openk3") + os.sep
seen, on = set(), [False]

def record(frame, event, arg):
    if on[0] and event == "call" and frame.f_code.co_filename.startswith(root):
        seen.add(frame.f_code.co_filename[len(root) - len("openk3") - 1 :])

def start(*_):
    seen.clear()
    on[0] = True

def stop(*_):
    on[0] = False
    with open(os.environ["WALK_OUT"], "w") as f:
        f.write("\n".join(sorted(seen)))


signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
sys.setprofile(record)
threading.setprofile(record)
from openk3.cli import main
sys.exit(main(sys.argv[2:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(url: str) -> str:
    body = {"model": "walk", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8, "stream": True, "temperature": 0}
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", default=ROOT, help="checkout whose openk3 the server runs (default: this one)")
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    port = free_port()
    out = tempfile.mktemp(prefix="openk3-walk-")
    cmd = [sys.executable, "-c", SERVER, args.code, "serve", "--model", args.model, "--served-model-name", "walk", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": args.code, "WALK_OUT": out}
    # cwd too: `python -c` puts the working directory first on sys.path, before PYTHONPATH
    server = subprocess.Popen(cmd, env=env, cwd=args.code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("the server did not start")
            time.sleep(0.5)
        chat(url)  # warm-up: lazy imports, first-use setup
        server.send_signal(signal.SIGUSR1)
        time.sleep(0.5)  # the signal is handled between bytecodes of the main thread: let it land before the request
        chat(url)
        time.sleep(0.5)
        server.send_signal(signal.SIGUSR2)
        while not os.path.exists(out):
            time.sleep(0.1)
        time.sleep(0.2)
        with open(out) as f:
            files = [line for line in f.read().splitlines() if line]
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    by_package: dict[str, list[str]] = {}
    for path in files:
        parts = path.split("/")
        by_package.setdefault("/".join(parts[:2]) if len(parts) > 2 else parts[0], []).append(path)
    print(f"one streamed POST /v1/chat/completions ran code in {len(files)} files of openk3 (server code: {args.code})")
    for package, paths in sorted(by_package.items()):
        print(f"  {package} ({len(paths)}): {', '.join(p.rsplit('/', 1)[-1] for p in paths)}")


if __name__ == "__main__":
    main()
