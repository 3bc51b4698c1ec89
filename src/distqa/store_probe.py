"""Does MASTER_ADDR:MASTER_PORT answer as node 0's rendezvous store? worker.sh asks on every other
node once something accepts connections there, before torchrun starts:

    python -m distqa.store_probe ADDR PORT SECONDS

Accepting is not answering: a program that accepts and never replies (the port taken on node 0's
host by another program, which node 0's own check refuses at once) held torchrun's rendezvous on
the other nodes for ever, RDZV_TIMEOUT or not, since the store's handshake waits for its reply
without a limit; one that replies in another protocol (a proxy) ended it in a DistNetworkError
traceback. So the probe bounds itself, and worker.sh says which in one line.

SECONDS count from after torch's import, by the probe's own alarm: on a busy CPU the import alone
can take minutes (118 s at the lowest priority beside three busy processes on two cores, as CI runs
its torch-floor step), and an outer `timeout` that counted it called a store that answered late
"not node 0's store".

A client of torch's own TCPStore does the handshake (its wire format is torch's to change); it
connects without counting itself among the workers the store waits for (`wait_for_workers=False`),
and retries within SECONDS while node 0 is still starting: its checks' listener answers the first
tries with bytes of its own. Exit status 0 when the store answered, 1 when it did not, 142 when the alarm ended a wait.
"""

from __future__ import annotations

import math
import signal
import sys
from datetime import timedelta


def answers(addr: str, port: int, seconds: float) -> bool:
    """Whether a TCPStore server at `addr`:`port` completes a client's handshake within `seconds`
    (a server that never replies is left to the caller's `timeout`)."""
    from torch.distributed import TCPStore

    try:
        TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=seconds), wait_for_workers=False)
    except (RuntimeError, ValueError, OSError):  # DistNetworkError and DistStoreError are RuntimeErrors
        return False
    return True


def main(argv: list[str]) -> int:
    addr, port, seconds = argv[0], int(argv[1]), float(argv[2])
    import torch.distributed  # noqa: F401  (imported before the clock starts: its time is not the store's)

    # The store's handshake waits for a reply without a limit: the alarm's default action ends the
    # process (exit status 142) however it waits. Set here, not inherited: a parent may ignore it.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C ends it too, not only worker.sh's trap
    signal.alarm(max(1, math.ceil(seconds)))
    return 0 if answers(addr, port, seconds) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
