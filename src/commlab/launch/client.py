"""The client side of the warm launcher (:mod:`.server`): ``commlab launch`` hands its job to the
server named by ``COMMLAB_LAUNCH_SERVER`` and waits for its exit status, or says that none answered.

The messages are length-prefixed JSON; the client's standard input, output and error travel as
descriptors (``SCM_RIGHTS``) with the first message, so the served job writes to the job's own log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SERVER_ENV = "COMMLAB_LAUNCH_SERVER"
_LENGTH = struct.Struct("!I")


# ---------------------------------------------------------------------- framing
def send_message(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict | None:
    """One message, or None when the peer closed the connection."""
    head = _recv_exact(sock, _LENGTH.size)
    if head is None:
        return None
    body = _recv_exact(sock, _LENGTH.unpack(head)[0])
    return None if body is None else json.loads(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------- client
def served_launch(argv: list[str], marks: dict) -> int | None:
    """Run ``commlab launch *argv`` in the warm launcher of ``COMMLAB_LAUNCH_SERVER``; its exit status,
    or None when no server answered and nothing was started (the caller launches the job itself)."""
    path = os.environ.get(SERVER_ENV)
    if not path or os.environ.get("SLURM_JOB_ID") or not hasattr(socket, "send_fds"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except FileNotFoundError:  # no server was started (launch_server: false): nothing to say
        sock.close()
        return None
    except OSError as err:
        sock.close()
        print(f"[commlab launch] the warm launcher at {path} does not answer ({err}); launching here",
              file=sys.stderr, flush=True)
        return None
    try:
        socket.send_fds(sock, [b"j"], [0, 1, 2])
        send_message(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "marks": marks})
        started = recv_message(sock)
    except OSError as err:
        sock.close()
        print(f"[commlab launch] the warm launcher at {path} does not answer ({err}); launching here",
              file=sys.stderr, flush=True)
        return None
    if not started or "pid" not in started:
        sock.close()
        print(f"[commlab launch] the warm launcher at {path} closed before it started the job; launching here",
              file=sys.stderr, flush=True)
        return None
    pid = started["pid"]

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        ended = recv_message(sock)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if not ended or "exit" not in ended:
        print(f"[commlab launch] the warm launcher at {path} went away during the job (its launcher, pid {pid}, "
              "was stopped); a launch again resumes from the last checkpoint", file=sys.stderr, flush=True)
        return 1
    return int(ended["exit"])
