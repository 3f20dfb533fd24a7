"""One background thread that does the loggers' file and network writes, in order.

A log event costs the training loop only what it takes to copy its values and
append one task to a list; JSON encoding, file writes, TensorBoard protobufs and
``wandb.Run.log`` run on this thread. The list is handed to the thread at most
every ``handover_s`` seconds (and at every flush), so the thread wakes a few
times a second rather than at every log event: a woken thread competes with the
loop for the GIL, which on a busy machine costs the loop more than the write.
There is one thread per process for all loggers, so records keep the order in
which the loop produced them, across loggers too.

When the queue is drained the loggers decide (:class:`hookloop.callbacks.logger.Logger`):
before a checkpoint's state is taken (so a resume's byte offset is exact), at
``on_checkpoint_save``, at the end of training, after an exception, and at
interpreter exit. A logger waits for its own tasks only (:meth:`LogWriter.wait`
with the number :meth:`LogWriter.submit` gave its last one), never for the
disk sync another logger handed over after them. A task that raises does not
kill the thread: the first error is kept and raised on the loop's thread at the
next :meth:`submit`, :meth:`wait` or :meth:`flush`, so a full disk stops
training within one log event.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

#: How long an exit waits for pending writes before giving up on them.
EXIT_TIMEOUT_S = 10.0
#: The longest a task waits on the loop's side before the thread gets it.
HANDOVER_S = 0.25
_NEVER = 1 << 62  # a task number no run reaches

Task = tuple[Callable[..., Any], tuple[Any, ...]]


class LogWriterError(RuntimeError):
    """A background write failed; raised on the training loop's thread."""


class LogWriter:
    """A FIFO of write tasks served by one daemon thread, started on first use."""

    def __init__(self, name: str = "hookloop-log-writer", handover_s: float = HANDOVER_S) -> None:
        self.name = name
        self.handover_s = handover_s
        self._queue: queue.SimpleQueue[list[Task]] = queue.SimpleQueue()
        self._batch: list[Task] = []  # submitted, not yet handed to the thread
        self._next_handover = 0.0
        self._lock = threading.Lock()  # guards _batch, _submitted and the thread's start
        self._thread: threading.Thread | None = None
        self._submitted = 0  # tasks submitted so far: the number of the latest
        self._done = 0  # tasks run so far (in order, so task n has run when _done >= n)
        self._done_changed = threading.Condition(threading.Lock())
        self._waited_for: list[int] = []  # the task numbers wait() waits for
        self._wake_at = _NEVER  # the smallest of them: the thread wakes its waiter there
        self._left_in_batch = 0  # tasks after the running one in the thread's batch
        self._error: BaseException | None = None
        self._failed_task = ""

    def submit(self, fn: Callable[..., Any], *args: Any) -> int:
        """Run ``fn(*args)`` on the writer thread after every task submitted before it.

        Returns the task's number, for :meth:`wait`.
        """
        if self._error is not None:
            self._raise_error()
        with self._lock:
            self._batch.append((fn, args))
            self._submitted += 1
            number = self._submitted
            now = time.monotonic()
            if now >= self._next_handover:
                self._next_handover = now + self.handover_s
                self._hand_over()
        return number

    def _hand_over(self) -> None:
        """Give the pending tasks to the thread (the caller holds the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        if self._batch:
            self._queue.put(self._batch)
            self._batch = []

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every task submitted so far has run; False if ``timeout`` ran out.

        Raises :class:`LogWriterError` if one of them failed.
        """
        return self.wait(self._submitted, timeout)

    def wait(self, number: int, timeout: float | None = None) -> bool:
        """Wait until task ``number`` (what :meth:`submit` returned) and every task before it
        have run, not for those submitted after it; False if ``timeout`` ran out.

        Raises :class:`LogWriterError` if a task failed.
        """
        thread = self._thread
        if self._done >= number or thread is None or threading.current_thread() is thread:
            ok = True  # done already, nothing ever submitted, or called from a task
        elif not thread.is_alive():
            ok = False
        else:
            with self._lock:
                self._hand_over()  # the task may still wait in the batch
            with self._done_changed:
                self._waited_for.append(number)
                self._wake_at = min(self._waited_for)
                try:
                    ok = self._done_changed.wait_for(lambda: self._done >= number, timeout)
                finally:
                    self._waited_for.remove(number)
                    self._wake_at = min(self._waited_for, default=_NEVER)
        if self._error is not None:
            self._raise_error()
        return ok

    def idle(self) -> bool:
        """On the thread: True when the running task is the last one handed over.

        A task may then flush its file to the OS, once per batch.
        """
        return self._left_in_batch == 0 and self._queue.empty()

    # -- the thread -----------------------------------------------------------
    def _run(self) -> None:
        get = self._queue.get
        while True:
            try:
                batch = get(timeout=self.handover_s)
            except queue.Empty:  # no handover lately: take what waits (a quiet loop's last log)
                with self._lock:
                    if not self._queue.empty():
                        continue  # handed over since the wait ran out: that batch comes first
                    batch, self._batch = self._batch, []
            for i, (fn, args) in enumerate(batch):
                self._left_in_batch = len(batch) - i - 1
                try:
                    fn(*args)
                except BaseException as exc:  # kept, and raised on the loop's thread
                    if self._error is None:
                        self._error = exc
                        self._failed_task = getattr(fn, "__qualname__", repr(fn))
                self._done += 1
                if self._done >= self._wake_at:
                    with self._done_changed:
                        self._done_changed.notify_all()

    def _raise_error(self) -> None:
        exc, self._error = self._error, None
        raise LogWriterError(
            f"a background log write ({self._failed_task}) failed: {type(exc).__name__}: {exc}"
        ) from exc

    def _after_fork(self) -> None:
        """A forked child (a DataLoader worker) gets a fresh queue and no thread."""
        self._queue = queue.SimpleQueue()
        self._batch = []
        self._thread = None
        self._lock = threading.Lock()
        self._submitted = self._done = 0
        self._done_changed = threading.Condition(threading.Lock())
        self._waited_for, self._wake_at = [], _NEVER
        self._error = None


_WRITER = LogWriter()


def log_writer() -> LogWriter:
    """The process's shared writer (every logger uses this one, so order holds across them)."""
    return _WRITER


def _flush_at_exit() -> None:
    # The run already ended: an exit handler has no one left to tell of a failed write.
    with contextlib.suppress(LogWriterError):
        _WRITER.flush(timeout=EXIT_TIMEOUT_S)


atexit.register(_flush_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WRITER._after_fork)
