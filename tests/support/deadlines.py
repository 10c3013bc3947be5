"""The suite's one wall-clock allowance: ``RR_TEST_STARTUP_TIMEOUT`` seconds (default 420; ``make test`` sets 900).

Every hang guard in a test (a server's start, a child process, a wait for processes to be reaped) derives from it, so
a heavily loaded CI machine is given the same room everywhere and no test assumes a quiet box.
"""

from __future__ import annotations

import os

__all__ = ["STARTUP_TIMEOUT_S"]

STARTUP_TIMEOUT_S = float(os.environ.get("RR_TEST_STARTUP_TIMEOUT", "420"))
