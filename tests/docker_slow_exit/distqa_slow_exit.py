"""Test-only, installed into a derived image by tests/test_docker_engine.py: rank 1 leaves the run a
few seconds after the others, so node 0's container (and the rendezvous store its torchrun hosts)
is gone before rank 1 stops its PeerWatch: the order in which rank 1 once hung after its checkpoint
(issue 26; a busy host made it slow). Loaded through a .pth file, in workers only."""

import os

if os.environ.get("RANK") == "1" and "TORCHELASTIC_RUN_ID" in os.environ:
    import time

    import distqa.dist

    _stop = distqa.dist.PeerWatch.stop

    def _late_stop(self: distqa.dist.PeerWatch, done: bool = True) -> None:
        time.sleep(float(os.environ.get("DISTQA_SLOW_EXIT_S", "3")))
        _stop(self, done)

    distqa.dist.PeerWatch.stop = _late_stop  # type: ignore[method-assign]
