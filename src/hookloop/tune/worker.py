"""A trial process: ``python -m hookloop.tune.worker STUDY_DIR INDEX``.

The driver (``hookloop tune --workers K``) starts K of these. Each one dies
with the driver: on Linux the kernel sends it SIGKILL when its parent goes
(``PR_SET_PDEATHSIG``, set before the worker runs any Python of its own);
elsewhere a thread watches the parent's process id.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Make this process end when process ``parent`` does (SIGKILL on Linux, else polled)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="hookloop-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m hookloop.tune.worker STUDY_DIR INDEX PARENT_PID", file=sys.stderr)
        return 2
    study_dir, index, parent = args[0], int(args[1]), int(args[2])
    die_with_parent(parent)
    threads = os.environ.get("HOOKLOOP_TUNE_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "none")
        print(
            f"hookloop tune worker {index}: {torch.get_num_threads()} CPU threads, GPU {gpu}",
            file=sys.stderr,
            flush=True,
        )
    from hookloop.tune.console import apply_worker_verbosity
    from hookloop.tune.driver import work
    from hookloop.tune.interrupts import StudyInterrupted
    from hookloop.tune.spec import TuneError

    apply_worker_verbosity()  # the driver's Optuna verbosity (quiet for `hookloop tune`)
    try:
        deadline = os.environ.get("HOOKLOOP_TUNE_DEADLINE")
        ran = work(study_dir, worker=index, deadline=float(deadline) if deadline else None)
    except StudyInterrupted as stop:
        print(f"hookloop tune worker {index}: {stop}", file=sys.stderr)
        return stop.exit_code
    except TuneError as err:
        print(f"hookloop tune worker {index}: {err}", file=sys.stderr)
        return 1
    print(f"hookloop tune worker {index}: ran {ran} trials", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
