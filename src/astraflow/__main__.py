"""``python -m astraflow`` (and ``torchrun ... -m astraflow train``), and the ``astraflow``
command (:func:`run`): the CLI.

Once the command has returned and no other thread is left to finish, the process ends without
CPython's module teardown: the exit handlers run and the standard streams are flushed, then
``os._exit``. Tearing down the modules of a process that imported torch and transformers costs
about a second of CPU, and a stopping run's components would each pay it in turn; every
component closes what it writes before its command returns, so the teardown frees only memory.
"""

import atexit
import contextlib
import os
import sys
import threading

from astraflow.cli.main import main


def _exit(code: int) -> None:
    """End the process with ``code``, skipping the module teardown when nothing else runs."""
    others = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if others:  # a normal exit waits for them
        sys.exit(code)
    atexit._run_exitfuncs()  # logging flushes its handlers here, trackers close, ...
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing to flush to
            stream.flush()
    os._exit(code)


def run() -> None:
    """The ``astraflow`` command: the CLI, then the exit above."""
    _exit(main())


if __name__ == "__main__":
    run()
