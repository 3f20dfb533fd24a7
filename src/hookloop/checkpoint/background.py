"""Checkpoint saves that do not stall training (``checkpoint.async_save``).

A save has two parts. The loop's part must see the state of this step, so it
runs on the loop's thread: every named state's ``state_dict()`` is copied into
host memory (:class:`HostCopy`; pinned buffers and non-blocking copies with one
synchronize on a GPU). The rest needs only that copy: serialising, writing,
fsync, manifest, the atomic commit and retention run on a writer thread
(:class:`BackgroundSaves`) while training goes on. The commit protocol is the
synchronous one, line for line (:meth:`hookloop.checkpoint.SaveJob.run`), so a
crash mid-write leaves the previous checkpoint as ``latest`` in both modes.

Rules the loop keeps: at most one save in flight (the next save, and every exit
of ``train()``, first waits for it); ``on_checkpoint_save`` fires on the loop's
thread after the commit, at the next step boundary or when the loop waits, and
its handlers see ``ctx.state`` as it was at the saved step; a failed
background save raises its error on the loop's thread, as a synchronous save
would.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("hookloop.checkpoint")


_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


class Frozen:
    """A named state's ``state_dict()`` as it was copied: what a background save writes."""

    def __init__(self, state: Any, *, per_rank: bool = False) -> None:
        self._state = state
        self.per_rank = per_rank

    def state_dict(self) -> Any:
        return self._state


class HostCopy:
    """Copies named state into host memory, reusing its buffers from one save to the next.

    Tensors on a GPU go into pinned buffers with non-blocking copies and one
    synchronize per device at the end. Tensors that share memory (tied weights)
    stay shared in the copy, so the weights file stores them once, as a
    synchronous save does. Containers are rebuilt; other values are deep-copied.
    The buffers are reused, so a copy must be written before the next is made
    (the loop keeps at most one save in flight).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def __call__(self, state: Mapping[str, Any]) -> dict[str, Frozen]:
        walk = _Walk(self._buffers)
        # One intra-op thread: a copy is bound by memory, and on a busy machine the
        # second OpenMP worker waiting for a core made a 2 ms copy take 100 ms or more.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                frozen = {
                    name: Frozen(
                        walk.copy(obj.state_dict(), (name,)),
                        per_rank=getattr(obj, "per_rank", False),
                    )
                    for name, obj in state.items()
                }
                walk.finish()
        finally:
            torch.set_num_threads(threads)
        return frozen


class _Walk:
    """One copy: rebuilds containers, fills a buffer per tensor, copies in one go."""

    def __init__(self, buffers: dict[tuple[Any, ...], torch.Tensor]) -> None:
        self.buffers = buffers
        self.memo: dict[tuple[Any, ...], torch.Tensor] = {}
        self.dst: list[torch.Tensor] = []  # host tensors copied at finish() (one dispatch)
        self.src: list[torch.Tensor] = []
        self.devices: set[torch.device] = set()

    def copy(self, obj: Any, key: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, key)
        if isinstance(obj, dict):
            pairs = ((k, self.copy(v, (*key, k))) for k, v in obj.items())
            return OrderedDict(pairs) if isinstance(obj, OrderedDict) else dict(pairs)
        if isinstance(obj, (list, tuple)):
            if all(type(v) in _SCALARS for v in obj):  # e.g. the Python RNG's 625 ints
                items = list(obj)
            else:
                items = [self.copy(v, (*key, i)) for i, v in enumerate(obj)]
            if isinstance(obj, list):
                return items
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        if type(obj) in _SCALARS or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        try:
            return copy.deepcopy(obj)
        except Exception:  # not copyable: the save's portability check will name it
            return obj

    def tensor(self, t: torch.Tensor, key: tuple[Any, ...]) -> torch.Tensor:
        if t.layout != torch.strided:
            return t.to("cpu", copy=True)
        ident = (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype)
        if t.numel() and ident in self.memo:  # the same memory under another name: shared
            return self.memo[ident]
        on_gpu = t.device.type == "cuda"
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu)
            self.buffers[key] = buf
        if on_gpu:  # queued on the device's stream; finish() waits once
            buf.copy_(t, non_blocking=True)
            self.devices.add(t.device)
        else:
            self.dst.append(buf)
            self.src.append(t)
        self.memo[ident] = buf
        return buf

    def finish(self) -> None:
        for dst, src in zip(self.dst, self.src, strict=True):
            dst.copy_(src)
        for device in self.devices:  # the one wait for the device-to-host copies
            torch.cuda.synchronize(device)


@dataclass
class PendingSave:
    """One save handed to the writer: where it commits and what the loop saw when it began."""

    path: Path
    #: ``ctx.state`` for ``on_checkpoint_save``: a copy of the TrainState as it was at
    #: the saved step, for a save announced later; None when announced at once (the
    #: handlers then see ``ctx.state`` unchanged).
    state: Any
    started: float  # time.perf_counter() when the save began
    blocked: float  # seconds the loop has waited for this save so far
    done: threading.Event = field(default_factory=threading.Event)
    finished: float = 0.0
    error: BaseException | None = None

    @property
    def seconds(self) -> float:
        """Wall time from the start of the save to the end of its commit."""
        return self.finished - self.started


class BackgroundSaves:
    """At most one checkpoint commit in flight, on one writer thread.

    The loop hands a commit over with :meth:`start` (the thread is started at
    the first save and kept until :meth:`close`, so later saves do not wait for
    a thread to start) and collects it with :meth:`take`; a failure is raised
    there, on the loop's thread.
    """

    def __init__(self) -> None:
        #: A save is in flight or waiting to be collected (read on every step: one attribute).
        self.busy = False
        self._pending: PendingSave | None = None
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def start(self, commit: Callable[[], Any], pending: PendingSave) -> None:
        if self.busy:
            raise RuntimeError("a checkpoint save is already in flight; take() it first")
        if self._thread is None:
            self._thread = threading.Thread(
                target=_serve, args=(self._jobs,), name="hookloop-checkpoint-writer", daemon=True
            )
            self._thread.start()
        self._pending, self.busy = pending, True
        self._jobs.put((commit, pending))

    def take(self, *, wait: bool) -> PendingSave | None:
        """The save in flight once committed, or None (none, or still writing and not
        ``wait``). Waiting counts as time the loop was blocked by that save; the
        save's error, if it failed, is raised here."""
        pending = self._pending
        if pending is None or not (wait or pending.done.is_set()):
            return None
        if not pending.done.is_set():
            began = time.perf_counter()
            pending.done.wait()
            # up to the commit, not up to this thread waking: a save blocks no longer than it lasts
            pending.blocked += max(0.0, min(time.perf_counter(), pending.finished) - began)
        self._pending = None
        self.busy = False
        if pending.error is not None:
            raise pending.error
        return pending

    def finish_quietly(self) -> None:
        """Wait for the save in flight while another error ends the run; log its failure."""
        try:
            self.take(wait=True)
        except Exception as err:  # the run's own error is the one raised
            log.error("hookloop: the checkpoint being written in the background failed: %s", err)

    def close(self) -> None:
        """End the writer thread (after the save in flight, which is then still to take)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    while (job := jobs.get()) is not None:
        _run(*job)


def _run(commit: Callable[[], Any], pending: PendingSave) -> None:
    try:
        commit()
    except BaseException as err:  # re-raised on the loop's thread by take()
        pending.error = err
    finally:
        pending.finished = time.perf_counter()
        pending.done.set()
