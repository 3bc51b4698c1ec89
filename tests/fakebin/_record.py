"""Shared by the stand-in executables in this folder: append one call to $FAKE_LOG.

Each line is a JSON object {"cmd": name, "argv": [...]} so a test can assert on the exact calls
and their order. The stand-ins are put first on PATH by the tests; nothing here talks to a network.
"""

import json
import os
import sys


def record(name: str) -> list[str]:
    argv = sys.argv[1:]
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(json.dumps({"cmd": name, "argv": argv}) + "\n")
    return argv
