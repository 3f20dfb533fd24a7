"""Weights & Biases logging (the HPO trainer's ``WandbLoggingCallback``) and an offline reader.

One ``run.log`` call per log event carries everything in ``ctx.logs`` at that
step: the losses, the learning rate, the gradient norm and every value that
producer callbacks added in ``on_before_log`` (they run before any ``on_log``
handler, so priority 80 sees all of them). Keys are ``train/<key>``.
Evaluation results are logged by a second call with the *same* step as
``eval/<key>`` (``eval_loss`` becomes ``eval/loss``); W&B merges calls with an
equal step into one history row, so a step that was both logged and evaluated
is one row with both. The ``run.log`` calls run on the shared background
writer (:mod:`hookloop.callbacks._writer`), in order; the queue is drained at
``on_checkpoint_save``, before the run's state is saved and before it finishes.

The run is created at ``on_train_start`` on rank 0 with
``wandb.init(project=..., dir=..., mode=..., config=<resolved config>)`` and
finished at ``on_train_end`` (with exit code 1 after an exception). ``dir``
defaults to the run directory (``ctx.run.dir``), so offline runs land in
``<run>/wandb/``. ``mode=None`` means ``$WANDB_MODE`` if set, else ``"offline"``:
a training job never waits on a login prompt or a network; upload with
``wandb sync <run>/wandb/offline-run-*``, or pass ``mode="online"``.

Resume: the W&B run id is part of the checkpoint. A resumed training continues
the same W&B run *rewound* to the checkpoint step (``resume_from="<id>?_step=S"``),
so steps logged after the checkpoint by the killed process are replaced, as in
the JSON and TensorBoard logs. Pass ``rewind=False`` to continue the run
without rewinding (``resume="allow"``) where a W&B server lacks run rewind.
A rewind after a divergence (:mod:`hookloop.checkpoint.rewind`) does the same in the
running process: the run is finished and continued from the restored step.

:func:`offline_history` reads what an offline run wrote (wandb 0.31 ships no
Python reader for its ``.wandb`` files: they are a LevelDB-style log of
``wandb_internal_pb2.Record`` protobufs, which :func:`read_wandb_records` decodes).
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hookloop._optional import require
from hookloop.callbacks.jsonlog import metric_tag, numeric_metrics
from hookloop.callbacks.logger import Logger, Record, run_status
from hookloop.state import CallbackContext

_MODES = (None, "online", "offline", "disabled", "shared")


def import_wandb() -> Any:
    """The wandb module, or an ImportError naming the extra to install."""
    return require("wandb", extra="wandb", feature="WandbLoggingCallback")


class WandbLoggingCallback(Logger):
    """Logs every log event and evaluation to one W&B run (rank 0 only).

    The events, the resume and the flushes are those of every logger
    (:class:`~hookloop.callbacks.logger.Logger`); this is the W&B backend: the run
    opens at train start, a cut continues it rewound to the step, and it finishes
    when training ends.
    """

    priority = 80

    def __init__(
        self,
        project: str = "hookloop",
        *,
        name: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        dir: str | Path | None = None,
        mode: str | None = None,
        rewind: bool = True,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(project, str) or not project:
            raise ValueError(f"project must be a non-empty string, got {project!r}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if tags is not None and not all(isinstance(t, str) for t in tags):
            raise ValueError(f"tags must be a list of strings, got {tags!r}")
        if init_kwargs is not None and not isinstance(init_kwargs, dict):
            raise ValueError(f"init_kwargs must be a dict, got {init_kwargs!r}")
        import_wandb()  # fail now, naming the extra, rather than after the model is built
        super().__init__()
        self.project = project
        self.run_name = name
        self.entity = entity
        self.group = group
        self.tags = tags
        self.dir = None if dir is None else Path(dir)
        self.mode = mode
        self.rewind = rewind
        self.init_kwargs = dict(init_kwargs or {})
        self.run: Any = None
        self._resume_id: str | None = None
        self._run_kwargs: dict[str, Any] = {}  # wandb.init's, but for the resume
        self._exit_code = 0

    # -- the backend ------------------------------------------------------------------
    def prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        return numeric_metrics(values)  # a tensor is read now; strings and the like left out

    def open(self, ctx: CallbackContext) -> None:
        if self.run is not None:
            return
        # wandb.init(dir=D) writes under D/wandb: D is the parent of the run's wandb part.
        run_dir = ctx.run.dir
        directory = self.dir or (run_dir.wandb.parent if run_dir is not None else None)
        kwargs: dict[str, Any] = {
            "project": self.project,
            "name": self.run_name,
            "entity": self.entity,
            "group": self.group,
            "tags": self.tags,
            "mode": self.mode or os.environ.get("WANDB_MODE") or "offline",
            "reinit": "create_new",  # never take over another run active in this process
        }
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(directory)
        to_dict = getattr(ctx.config, "to_dict", None)
        if to_dict is not None:
            kwargs["config"] = to_dict()
        self._run_kwargs = kwargs
        self._start(ctx.state.step)

    def _start(self, step: int) -> None:
        """``wandb.init``, continuing the checkpointed run from ``step`` if there is one."""
        kwargs = dict(self._run_kwargs)
        if self._resume_id is not None and step > 0:
            if self.rewind:
                kwargs["resume_from"] = f"{self._resume_id}?_step={step}"
            else:
                kwargs["id"], kwargs["resume"] = self._resume_id, "allow"
        kwargs.update(self.init_kwargs)
        self.run = import_wandb().init(**{k: v for k, v in kwargs.items() if v is not None})

    def write(self, record: Record) -> None:
        """On the writer thread: a log's or an evaluation's numbers as one ``run.log`` at
        the record's step (``train/<key>``, ``eval/<key>``); the status at the end."""
        run = self.run
        if run is None:
            return
        kind, values = record.kind, record.values
        if kind in ("train", "eval", "test"):
            data = {metric_tag(kind, k): v for k, v in numeric_metrics(values).items()}
            if data:
                run.log(data, record.step)
        elif kind == "end":
            if "error" in values:  # ended by an exception
                run.summary["status"] = "failed"
                self._exit_code = 1
            else:
                reason = values.get("stop_reason")
                run.summary["status"] = run_status(reason)
                run.summary["stop_reason"] = reason or "finished"

    def position(self) -> dict[str, Any]:
        return {"run_id": self.run.id if self.run is not None else self._resume_id}

    def cut(self, step: int, saved: dict[str, Any] | None) -> None:
        """Remember the checkpoint's run; a rewind in training continues the open run from
        ``step`` as a resume does (at a resume the run is not open yet, and :meth:`open`
        continues it so)."""
        if saved is not None:
            run_id = saved.get("run_id")
            self._resume_id = run_id if isinstance(run_id, str) and run_id else None
        if self.run is not None:
            self._finish(0)
            self._start(step)

    def release(self) -> None:
        exit_code, self._exit_code = self._exit_code, 0
        self._finish(exit_code)

    def _finish(self, exit_code: int) -> None:
        if self.run is not None:
            self._resume_id = self.run.id
            self.run.finish(exit_code=exit_code)
            self.run = None


# -- reading offline runs back ---------------------------------------------------

_BLOCK = 32 * 1024
_HEADER = 7  # checksum (4 bytes), length (2), record type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: str | Path) -> Iterator[Any]:
    """Yield the ``wandb_internal_pb2.Record`` messages of one ``.wandb`` file, in order.

    The file is a ``:W&B`` header and then LevelDB-log framing: 32 KiB blocks of
    chunks, each with a CRC-32 over its type and payload. A torn tail (a killed
    writer) ends the iteration; a bad checksum raises ``ValueError``.
    """
    pb = require("wandb.proto.wandb_internal_pb2", extra="wandb", feature="read_wandb_records")
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (no ':W&B' header)")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # the rest of a block too short for a chunk header is padding
            pos += room
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += room
            continue
        payload = data[pos + _HEADER : pos + _HEADER + length]
        if len(payload) < length:
            return  # torn tail
        if zlib.crc32(bytes([kind]) + payload) != checksum:
            raise ValueError(f"{path}: chunk at byte {pos} fails its checksum")
        pos += _HEADER + length
        if kind == _FULL:
            pending, whole = b"", payload
        elif kind == _FIRST:
            pending, whole = payload, None
        elif kind == _MIDDLE:
            pending, whole = pending + payload, None
        elif kind == _LAST:
            pending, whole = b"", pending + payload
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {pos}")
        if whole is not None:
            record = pb.Record()
            record.ParseFromString(whole)
            yield record


def _history_row(history: Any) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for item in history.item:
        key = item.key or "/".join(item.nested_key)
        try:
            row[key] = json.loads(item.value_json)
        except json.JSONDecodeError:
            row[key] = item.value_json
    return row


_OFFLINE_DIR = re.compile(r"^offline-run-(\d{8}_\d{6})-[^-]+(?:-(\d+))?$")


def offline_run_files(path: str | Path) -> list[Path]:
    """The ``.wandb`` files under ``path``, oldest first.

    A run directory is ``offline-run-<YYYYmmdd_HHMMSS>-<id>``, with ``-1``,
    ``-2``, ... appended when a resume starts within the same second; plain
    name order would put ``…-<id>-1`` before ``…-<id>``.
    """
    path = Path(path)
    if path.is_file():
        return [path]

    def order(file: Path) -> tuple[str, int, str]:
        match = _OFFLINE_DIR.match(file.parent.name)
        if match is None:
            return ("", 0, str(file))
        return (match.group(1), int(match.group(2) or 0), str(file))

    return sorted(path.glob("**/run-*.wandb"), key=order)


def offline_history(path: str | Path, *, wait_s: float = 0.0) -> list[dict[str, Any]]:
    """History rows (``{"_step": n, key: value, ...}``) of the offline runs under ``path``.

    ``path`` is a ``.wandb`` file, an ``offline-run-*`` directory, or a directory
    holding them (e.g. ``<run>/wandb``). Several files are read in order
    (see :func:`offline_run_files`) and joined the way W&B joins them on sync: a
    file that resumes with a rewind to step ``S`` replaces every earlier row after ``S``.

    wandb-core writes the file in the background, and ``run.finish()`` can
    return before it has: ``wait_s`` waits up to that long for every file to
    end with its run's exit record (``TimeoutError`` if one does not).
    """
    files = offline_run_files(path)
    deadline = time.monotonic() + wait_s
    while wait_s and not all(_finished(f) for f in files):
        if time.monotonic() > deadline:
            raise TimeoutError(f"W&B files under {path} were not complete within {wait_s} s")
        time.sleep(0.05)
    rows: list[dict[str, Any]] = []
    for file in files:
        for record in read_wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run" and record.run.HasField("branch_point"):
                rewind_to = record.run.branch_point.value
                rows = [r for r in rows if r.get("_step", 0) <= rewind_to]
            elif kind == "history":
                rows.append(_history_row(record.history))
    return rows


def _finished(file: Path) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in read_wandb_records(file))
    except ValueError:  # a chunk being written as we read
        return False
