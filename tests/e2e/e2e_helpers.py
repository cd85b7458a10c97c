"""Helpers shared by the end-to-end test modules (imported by name: pytest puts this directory on ``sys.path``)."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(pred: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``pred`` (a remote actor's counters, from the test driver) every 50 ms until it holds; fail after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
