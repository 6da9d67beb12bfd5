"""How the tests' spawned worker processes end."""

import os
import sys


def leave_process() -> None:
    """End a spawned worker once its result is saved, without the interpreter's teardown.

    gloo's threads, torn down at interpreter exit, abort a process now and then with "terminate called
    without an active exception" after it has saved its result, which fails a test whose work passed
    (2 of 12 runs of one such test, 0 of 46 once its workers left this way)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
