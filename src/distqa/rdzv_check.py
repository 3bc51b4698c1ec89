"""Node 0's checks before torchrun starts: is the rendezvous port free, and does MASTER_ADDR lead here?

    python -m distqa.rdzv_check --addr ADDR --port PORT [--addr-from VAR] [--rank-from VAR] [--timeout S] [--prog NAME]

torchrun's static rendezvous makes node 0 both the store's server (on every interface) and a client
of MASTER_ADDR:MASTER_PORT. When the port is taken, the address does not resolve, or it leads to
another host (a second node 0, a stale address), torchrun fails after tens of seconds with a long
traceback. These checks say the same in one line, in well under a second (standard library only:
no torch import).

1. Listen on PORT on every interface, as the store will. Failing means something else holds it.
2. Resolve ADDR.
3. Connect to ADDR:PORT and read a random nonce that only this process's listener sends. The
   nonce coming back proves the address leads to this host; anything else reaches another host or
   nobody.

The listener is closed before returning, so torchrun can take the port. Exit status 0 when all is
well, 2 with one line `PROG: error: ...` otherwise.
"""

from __future__ import annotations

import argparse
import errno
import secrets
import socket
import sys
import threading
import time

NONCE_BYTES = 16


class CheckFailed(Exception):
    """One line for the user: what is wrong and what to do."""


def listen_everywhere(port: int) -> socket.socket:
    """Listen on PORT on every IPv4 and IPv6 address if the host has IPv6, else every IPv4 one."""
    attempts = []
    if socket.has_ipv6:
        attempts.append((socket.AF_INET6, ("::", port)))
    attempts.append((socket.AF_INET, ("0.0.0.0", port)))
    last: OSError | None = None
    for family, address in attempts:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as err:  # no IPv6 in this container: fall back to IPv4
            last = err
            continue
        try:
            # SO_REUSEADDR as the store sets it: connections of a previous run still in TIME_WAIT do
            # not make the port "in use"; only a live listener does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(address)
            sock.listen(8)
            return sock
        except OSError as err:
            sock.close()
            if err.errno == errno.EADDRINUSE:
                raise CheckFailed(
                    f"port {port} is already in use on this host (another run, or another program): "
                    f"set MASTER_PORT to a free port, e.g. {port + 1}, on every node"
                ) from None
            last = err
    raise CheckFailed(f"cannot listen on port {port} on this host: {last}")


def _lookup(addr: str, port: int, result: list) -> None:
    try:
        result.append(socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM))
    except (OSError, UnicodeError) as err:
        result.append(err)


def resolve(addr: str, port: int, deadline: float) -> list[tuple]:
    """getaddrinfo, retried until the deadline: a scheduler may publish a job's DNS name a few
    seconds after the job starts. Each attempt runs in a thread because a resolver whose servers do
    not answer blocks for a long time and cannot be interrupted."""
    while True:
        result: list = []
        lookup = threading.Thread(target=_lookup, args=(addr, port, result), daemon=True)
        lookup.start()
        lookup.join(max(0.1, deadline - time.monotonic()))
        if result and not isinstance(result[0], BaseException):
            return result[0]
        last = str(getattr(result[0], "strerror", None) or result[0]) if result else "no answer from the name servers"
        if time.monotonic() >= deadline:
            raise CheckFailed(last)
        time.sleep(0.5)


def serve_nonce(listener: socket.socket, nonce: bytes, stop: threading.Event) -> None:
    """Send the nonce to whoever connects, then wait for them to close first, so that the closed
    connection's TIME_WAIT lands on the client's port and not on the rendezvous port."""
    listener.settimeout(0.05)  # how soon the thread notices `stop`
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        with conn:
            try:
                conn.settimeout(5)
                conn.sendall(nonce)
                conn.recv(1)
            except OSError:
                pass


def probe(family: int, sockaddr: tuple, nonce: bytes, timeout: float) -> str | None:
    """None when the address leads to this host; otherwise what is there instead, for the message."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(sockaddr)
            got = b""
            try:
                while len(got) < len(nonce):
                    chunk = sock.recv(len(nonce) - len(got))
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                pass  # a foreign server that sends nothing: timed out waiting for the nonce
            return None if got == nonce else FOREIGN
    except TimeoutError:
        return "nothing answers there from this host"
    except OSError as err:
        return f"nothing answers there from this host ({err.strerror or err})"


FOREIGN = "another host answers there (is a node 0 already running at that address?)"


def check(
    addr: str, port: int, addr_from: str, timeout: float, rank_from: str = "NODE_RANK", knows_self: bool = False
) -> None:
    """`knows_self`: the caller reads MASTER_ADDR=self as this host (worker.sh does, run_local.sh
    does not): only then do the messages offer it."""
    also = ", or to `self`" if knows_self else ""
    listener = listen_everywhere(port)
    nonce = secrets.token_bytes(NONCE_BYTES)
    stop = threading.Event()
    server = threading.Thread(target=serve_nonce, args=(listener, nonce, stop), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + timeout
        try:
            infos = resolve(addr, port, deadline)
        except CheckFailed as err:
            raise CheckFailed(
                f"MASTER_ADDR={addr} (from {addr_from}) does not resolve to an address ({err}): on node 0 "
                f"set it to this host's name or address{also}"
            ) from None
        while True:
            findings = []
            for family, _, _, _, sockaddr in infos:
                found = probe(family, sockaddr, nonce, max(0.5, min(3.0, deadline - time.monotonic())))
                if found is None:
                    return
                findings.append((sockaddr[0], found))
            # Another host answering is final; nobody answering may be a network still coming up.
            foreign = [f for f in findings if f[1] == FOREIGN]
            if foreign or time.monotonic() >= deadline:
                ip, found = (foreign or findings)[0]
                shown = addr if ip == addr else f"{addr} ({ip})"
                raise CheckFailed(
                    f"this is node 0, but MASTER_ADDR={shown} (from {addr_from}) does not lead to this host: "
                    f"{found.replace('there', f'at port {port}', 1)}. " + _remedy(rank_from, knows_self)
                )
            time.sleep(0.5)
    finally:
        stop.set()
        listener.close()
        server.join(timeout=2)


def _remedy(rank_from: str, knows_self: bool) -> str:
    if rank_from == "default":
        # The likeliest cause on a multi-node run: a worker node started without its NODE_RANK
        # took the default 0 and so believes it is node 0.
        return "NODE_RANK is not set on this node, so it took 0: set NODE_RANK (1 to NNODES-1) on every node but node 0"
    also = " (or `self`)" if knows_self else ""
    return f"On node 0, MASTER_ADDR must be this host's own address{also}, and only one node may have {rank_from}=0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distqa.rdzv_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--addr", required=True, help="MASTER_ADDR as torchrun will get it")
    parser.add_argument("--port", required=True, type=int, help="MASTER_PORT")
    parser.add_argument("--addr-from", default="MASTER_ADDR", help="where the address came from, for messages")
    parser.add_argument(
        "--rank-from", default="NODE_RANK", help="where node rank 0 came from ('default': no variable set it)"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for DNS and the network")
    parser.add_argument("--prog", default="distqa.rdzv_check", help="name to start error lines with")
    parser.add_argument("--knows-self", action="store_true", help="the caller reads MASTER_ADDR=self (worker.sh)")
    args = parser.parse_args(argv)
    try:
        check(args.addr, args.port, args.addr_from, args.timeout, args.rank_from, args.knows_self)
    except CheckFailed as err:
        print(f"{args.prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
