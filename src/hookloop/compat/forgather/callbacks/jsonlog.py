"""Forgather's JSON-array logs in ``args.logging_dir``: the resumable file they are written
through, its reader, and ``JsonLogger`` (``trainer_logs.json``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookloop.compat.forgather.callbacks.common import log
from hookloop.compat.forgather.events import answers_transformers_events
from hookloop.compat.hf.callback import TrainerCallback

__all__ = ["JsonArrayFile", "JsonLogger", "read_json_log"]


def read_json_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-array log, also while it is still open (no closing ``]``)."""
    text = Path(path).read_text(encoding="utf-8").strip()
    if not text:
        return []
    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        records = json.loads(text.rstrip(",\n ") + "\n]")
    if not isinstance(records, list):
        raise ValueError(f"{path} is not a JSON array of records")
    return records


class JsonArrayFile:
    """One JSON array of records in a directory, appended as training goes.

    Each record is ``{"timestamp", "global_step", "epoch", ...}``; the array is
    closed at :meth:`close`. On resume the file is reopened, records after the
    checkpoint's step are dropped, and appending goes on.
    """

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.path: str | None = None
        self._file: Any = None
        self._prefix = ""
        self.last_step = -1
        self._resume_path: str | None = None
        self._resume_step: int | None = None

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def open(self, directory: str) -> None:
        if self._resume_path and os.path.isfile(self._resume_path):
            self.path = self._resume_path
            self._reopen_truncated()
            return
        if self._resume_path:
            log.warning(
                "%s: the log of the checkpointed run (%s) is gone; starting %s afresh",
                self.filename,
                self._resume_path,
                directory,
            )
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, self.filename)
        try:
            self._file = open(self.path, "x", encoding="utf-8")  # noqa: SIM115 - closed at close()
        except FileExistsError:
            raise FileExistsError(
                f"{self.path} exists already: give each run its own logging_dir "
                "(or resume the run that wrote it)"
            ) from None
        self._file.write("[\n")
        self._prefix = ""

    def write(self, step: int, epoch: float, data: Mapping[str, Any]) -> None:
        head = {"timestamp": time.time(), "global_step": step, "epoch": epoch}
        self._file.write(self._prefix + json.dumps(head | dict(data), default=_jsonable))
        self._file.flush()
        self._prefix = ",\n"
        self.last_step = step

    def close(self) -> None:
        if self._file is not None:
            self._file.write("\n]\n")
            self._file.close()
            self._file = None

    def state_dict(self) -> dict[str, Any]:
        return {"log_path": self.path, "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._resume_path = state.get("log_path")
        self._resume_step = state.get("last_step", -1)

    def _reopen_truncated(self) -> None:
        assert self.path is not None
        step = self._resume_step if self._resume_step is not None else -1
        try:
            kept = [r for r in read_json_log(self.path) if r.get("global_step", 0) <= step]
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            backup = self.path + ".bak"
            log.warning("%s unreadable (%s); moved to %s, starting afresh", self.path, err, backup)
            os.replace(self.path, backup)
            kept = []
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed at close()
        self._file.write("[\n")
        self._prefix = ""
        for record in kept:
            self._file.write(self._prefix + json.dumps(record))
            self._prefix = ",\n"
        self._file.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


@answers_transformers_events
class JsonLogger(TrainerCallback):
    """``JsonLogger(**kwargs)``: every log and evaluation in ``<logging_dir>/trainer_logs.json``.

    A JSON array of ``{timestamp, global_step, epoch, **values}``, one record per
    log and evaluation and nothing else: ``kwargs`` are kept (``self.kwargs``) and
    never written, as in Forgather. Nothing is written when ``args.logging_dir`` is unset.
    Resumable: a resumed run continues the same file without the records after the
    checkpoint.
    """

    priority = 100

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self._file = JsonArrayFile("trainer_logs.json")

    @property
    def log_path(self) -> str | None:
        return self._file.path

    def state_dict(self) -> dict[str, Any]:
        return self._file.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._file.load_state_dict(state)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero or getattr(args, "logging_dir", None) is None:
            return
        self._file.open(args.logging_dir)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._file.is_open:
            self._file.write(state.global_step, state.epoch, kwargs.get("logs") or {})

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._file.is_open:
            self._file.write(state.global_step, state.epoch, kwargs.get("metrics") or {})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._file.close()

    def close(self) -> None:
        self._file.close()
