"""The model at a glance when training starts: parameters per top-level module.

What Lightning's ``ModelSummary`` prints by default, in a table of one row per
top-level child of the model (``named_children``): its class, its parameters, how many
of them train and how many are frozen (``requires_grad=False``), and their bytes. A last
row sums them. A parameter shared by two modules (tied embedding and output weights) is
counted once, in the first module that holds it, so the total is
``sum(p.numel() for p in model.parameters())``; parameters the model holds itself, in
no child, get a row of their own, ``(own)``.

``hookloop train`` prints it once, on rank 0 (``callbacks.model_summary``, on by
default); ``hookloop summary --recipe NAME`` prints it without training.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
>>> model[0].requires_grad_(False)
Linear(in_features=4, out_features=3, bias=True)
>>> print(format_summary(summarize(model)))
  | Name  | Type   | Params | Trainable | Frozen | Bytes
--------------------------------------------------------
0 | 0     | Linear | 15     | 0         | 15     | 60
1 | 1     | ReLU   | 0      | 0         | 0      | 0
2 | 2     | Linear | 8      | 8         | 0      | 32
--------------------------------------------------------
  | Total |        | 23     | 8         | 15     | 92
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TextIO

import torch

from hookloop.callback import Callback
from hookloop.state import CallbackContext

__all__ = ["ModelSummary", "ModuleRow", "format_summary", "summarize"]


@dataclass(frozen=True)
class ModuleRow:
    """One line of the table: a top-level module's parameters (each shared one once)."""

    name: str
    type: str
    params: int
    trainable: int
    bytes: int

    @property
    def frozen(self) -> int:
        return self.params - self.trainable


def summarize(model: torch.nn.Module) -> list[ModuleRow]:
    """A row per top-level child of ``model`` (and ``(own)`` for parameters it holds
    itself); a parameter shared between modules is counted in the first that holds it."""
    model = _unwrap(model)
    seen: set[int] = set()
    rows = [_row(name, child, child.parameters(), seen) for name, child in model.named_children()]
    own = [p for _, p in model.named_parameters(recurse=False)]
    if own:
        rows.append(_row("(own)", model, iter(own), seen))
    return rows


def _row(
    name: str, module: torch.nn.Module, params: Iterable[torch.nn.Parameter], seen: set[int]
) -> ModuleRow:
    count = trainable = size = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        count += p.numel()
        trainable += p.numel() if p.requires_grad else 0
        size += p.numel() * p.element_size()
    return ModuleRow(name, type(module).__name__, count, trainable, size)


def format_summary(rows: list[ModuleRow]) -> str:
    """The rows as a text table with a ``Total`` line."""
    header = ("", "Name", "Type", "Params", "Trainable", "Frozen", "Bytes")
    body = [
        (str(i), r.name, r.type, str(r.params), str(r.trainable), str(r.frozen), str(r.bytes))
        for i, r in enumerate(rows)
    ]
    total = (
        "",
        "Total",
        "",
        str(sum(r.params for r in rows)),
        str(sum(r.trainable for r in rows)),
        str(sum(r.frozen for r in rows)),
        str(sum(r.bytes for r in rows)),
    )
    widths = [max(len(line[i]) for line in (header, *body, total)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *map(line, body), rule, line(total)])


class ModelSummary(Callback):
    """Prints :func:`format_summary` of the model once, at train start, on rank 0.

    ``stream``: a text stream, ``"stdout"`` or ``"stderr"`` (default).
    """

    priority = 1

    def __init__(self, stream: TextIO | str = "stderr") -> None:
        if isinstance(stream, str) and stream not in ("stdout", "stderr"):
            raise ValueError(f"stream must be a text stream, 'stdout' or 'stderr', got {stream!r}")
        self.stream = stream
        self.rows: list[ModuleRow] = []

    def on_train_start(self, ctx: CallbackContext) -> None:
        if not ctx.state.is_rank_zero or ctx.model is None:
            return
        self.rows = summarize(ctx.model)
        out = self.stream
        if isinstance(out, str):
            out = sys.stdout if out == "stdout" else sys.stderr
        print("model summary:\n" + format_summary(self.rows), file=out, flush=True)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a DistributedDataParallel / DataParallel wrapper."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model
