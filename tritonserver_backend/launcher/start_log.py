"""A line per server start, for the test suite's accounting (issue 64: how many full tritonserver starts and Dynamo
deployments a run pays for). Only when `MOL2_START_LOG` names a file (scripts/test.sh sets it per phase); a start
that cannot write its line never fails because of it."""

from __future__ import annotations

import os
import time

START_LOG_ENV = "MOL2_START_LOG"


def note_start(kind: str, what: str) -> None:
    """Append `kind` (tritonserver: a MoL2 model repository; tritonserver-toy: any other, such as the launcher tests'
    one-model repositories; either with `-heal` when a supervisor starts it in place of a dead server; dynamo) and
    `what` (the repository or run folder) to $MOL2_START_LOG."""
    path = os.environ.get(START_LOG_ENV, "")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{time.time():.3f}\t{kind}\t{what}\n")
    except OSError:
        pass
