"""Test doubles for users testing their own callbacks: a tiny model, toy data,
a callback that records every event it sees, a bitwise comparison of two
checkpoints (for tests of exact resume), and :func:`count_sync_points`, which counts
the collectives and host reads a block of code makes (per training step, with
:class:`SyncCounts`).

>>> from hookloop import Config, DataConfig, Trainer, TrainConfig
>>> rec = RecordingCallback()
>>> cfg = Config(train=TrainConfig(max_steps=2, log_every=0), data=DataConfig(batch_size=4))
>>> trainer = Trainer(TinyModel(), train_data=ToyData(n=16), loss_fn=TinyModel.loss_fn,
...                   config=cfg, callbacks=[rec])
>>> _ = trainer.train()
>>> [e for e, step, micro in rec.events][:3]
['on_init_end', 'on_data_init_start', 'on_train_start']
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from hookloop.callback import Callback
from hookloop.events import EVENT_NAMES
from hookloop.safeload import load
from hookloop.state import CallbackContext


class TinyModel(torch.nn.Module):
    """Linear(4 → 8) → ReLU → Linear(8 → 1), deterministic for a given seed."""

    def __init__(self, inputs: int = 4, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @staticmethod
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(outputs, targets)


class ToyData(Dataset):
    """``n`` samples of ``(x, y)`` with ``y = sum(x) / 2``: learnable in a few steps."""

    def __init__(self, n: int = 64, inputs: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, inputs, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) / 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class RecordingCallback(Callback):
    """Records ``(event, step, micro_step)`` for every event (or only ``events``)."""

    priority = 0

    def __init__(self, events: list[str] | None = None) -> None:
        self.only = set(events) if events is not None else None
        self.events: list[tuple[str, int, int]] = []
        self.contexts: list[dict[str, Any]] = []

    def _record(self, event: str, ctx: CallbackContext) -> None:
        if self.only is None or event in self.only:
            self.events.append((event, ctx.state.step, ctx.state.micro_step))

    def names(self) -> list[str]:
        return [e for e, _, _ in self.events]


def _make_recorder(event: str) -> Any:
    def handler(self: RecordingCallback, ctx: CallbackContext) -> None:
        self._record(event, ctx)

    handler.__name__ = event
    return handler


for _event in EVENT_NAMES:
    setattr(RecordingCallback, _event, _make_recorder(_event))
del _event


def assert_same_checkpoint(a: str | Path, b: str | Path) -> None:
    """Assert that two single-process checkpoint directories hold bitwise-equal model
    weights (``model.safetensors``) and optimizer state (``optimizer.pt``): what a test of
    exact resume compares between a stopped-and-resumed run and an uninterrupted one."""
    from safetensors.torch import load_file

    a, b = Path(a), Path(b)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys(), f"weights differ in keys: {sorted(wa.keys() ^ wb.keys())}"
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"weight {key} differs"
    oa, ob = load(a / "optimizer.pt"), load(b / "optimizer.pt")
    for pid, state in oa["state"].items():
        for key, value in state.items():
            other = ob["state"][pid][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"optimizer state {pid}.{key} differs"
            else:
                assert value == other, f"optimizer state {pid}.{key} differs"


# -- counting sync points --------------------------------------------------------------
#: The ``torch.distributed`` collectives :func:`count_sync_points` counts, by name.
COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_object", "gather", "gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip
#: The ``torch.Tensor`` methods that read values back to the host (on a GPU: a sync).
#: ``cpu`` counts on every device: free on the CPU, the same call waits on a GPU.
HOST_READS: tuple[str, ...] = (
    "item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy",
)  # fmt: skip
#: Collectives whose second argument is what this rank sends (the first is the output).
_INPUT_SECOND = frozenset(
    {"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
     "all_to_all", "all_to_all_single", "scatter"}
)  # fmt: skip
#: What torch's collectives call the tensors this rank sends, when passed by keyword.
_INPUT_KEYWORDS = ("tensor", "input_tensor", "input", "input_tensor_list", "input_list",
                   "scatter_list")  # fmt: skip


@dataclass(frozen=True)
class StepSyncs:
    """What one training step did on this process: collectives and host reads by name,
    the bytes of tensors it handed to collectives, and whether the step was ordinary
    (no log, evaluation, checkpoint, live ``set``, epoch boundary, and not the first step
    of ``train()``, where one-time set-up lands)."""

    step: int
    collectives: dict[str, int]
    host_reads: dict[str, int]
    payload_bytes: int
    ordinary: bool

    @property
    def n_collectives(self) -> int:
        return sum(self.collectives.values())

    @property
    def n_host_reads(self) -> int:
        return sum(self.host_reads.values())


class SyncCounts:
    """The running counts of one :func:`count_sync_points` block, and per-step windows.

    ``collectives`` and ``host_reads`` count everything since the block began;
    :meth:`close_step` files what happened since the last boundary as one step in
    ``steps``. For a :class:`~hookloop.Trainer`, add :attr:`marker` to its callbacks and
    the steps are filed for you; a hand-written loop calls :meth:`close_step` itself.
    """

    def __init__(self) -> None:
        self.collectives: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.payload_bytes = 0
        self.steps: dict[int, StepSyncs] = {}
        self._since: tuple[Counter[str], Counter[str], int] = (Counter(), Counter(), 0)
        self.marker = StepMarker(self)

    def open_step(self) -> None:
        """Start a step's window here (what came before belongs to no step)."""
        self._since = (self.collectives.copy(), self.host_reads.copy(), self.payload_bytes)

    def close_step(self, step: int, *, ordinary: bool = True) -> StepSyncs:
        """File everything since the last boundary as ``step``; the next window opens."""
        collectives, reads, sent = self._since
        record = StepSyncs(
            step=step,
            collectives=dict(self.collectives - collectives),
            host_reads=dict(self.host_reads - reads),
            payload_bytes=self.payload_bytes - sent,
            ordinary=ordinary,
        )
        self.steps[step] = record
        self.open_step()
        return record

    def ordinary_steps(self, steps: Iterable[int] | None = None) -> list[StepSyncs]:
        """The ordinary steps filed, in step order (only those of ``steps``, if given)."""
        wanted = None if steps is None else set(steps)
        return [
            record
            for step, record in sorted(self.steps.items())
            if record.ordinary and (wanted is None or step in wanted)
        ]

    def add(self, kind: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Count one call (``kind`` is ``"host_read"`` or ``"collective"``)."""
        if kind == "host_read":
            self.host_reads[name] += 1
            return
        self.collectives[name] += 1
        index = 1 if name in _INPUT_SECOND else 0
        if len(args) > index:
            sent = args[index]
        else:
            sent = next((kwargs[k] for k in _INPUT_KEYWORDS if k in kwargs), None)
        tensors = sent if isinstance(sent, (list, tuple)) else [sent]
        self.payload_bytes += sum(
            t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)
        )


class StepMarker(Callback):
    """Files a :class:`SyncCounts` window per training step: from one step's
    ``on_train_step_start`` to the next (or ``on_train_end``), so the agreement at a
    step's end counts in that step. A log, evaluation, checkpoint, live ``set`` or epoch
    boundary in the window makes the step not ordinary; so does being the first."""

    priority = 0  # first at on_train_step_start: another callback's work there is this step's

    def __init__(self, counts: SyncCounts) -> None:
        self.counts = counts
        self.pending: list[Any] | None = None  # [step, ordinary] of the open window
        self.first = True

    def on_train_start(self, ctx: CallbackContext) -> None:
        self.pending, self.first = None, True

    def on_train_step_start(self, ctx: CallbackContext) -> None:
        if self.pending is None:
            self.counts.open_step()
        else:
            self.counts.close_step(self.pending[0], ordinary=self.pending[1])
            self.pending = None

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        self.pending = [ctx.state.step, not self.first]
        self.first = False

    def _eventful(self, ctx: CallbackContext) -> None:
        if self.pending is not None:
            self.pending[1] = False

    on_settings_change = on_before_log = on_eval_start = _eventful
    on_checkpoint_save = on_checkpoint_load = on_epoch_end = _eventful

    def on_train_end(self, ctx: CallbackContext) -> None:
        if self.pending is not None:  # the last step's window holds the end of training
            self.counts.close_step(self.pending[0], ordinary=False)
            self.pending = None


class _Depth(threading.local):
    """How deep this thread is inside counted calls: only the outermost counts."""

    value = 0


_active: list[SyncCounts] = []


@contextlib.contextmanager
def count_sync_points() -> Iterator[SyncCounts]:
    """Count, inside the block, this process's ``torch.distributed`` collectives and
    host reads of tensor values (``Tensor.item``, ``.tolist``, ``bool()``, ``float()``,
    ``int()``, ``.cpu()``, ``.numpy()``; not ``.to("cpu")``). Instrumentation for tests
    and benchmarks: it replaces those functions for the block's duration (every thread
    of the process) and restores the originals on exit, error or not.

    Only the outermost call counts: the host reads torch makes inside
    ``all_gather_object`` belong to that collective. Collectives are counted where
    called as ``torch.distributed.<name>`` (or through ``distributed_c10d``); what DDP's
    C++ reducer does (its gradient all-reduce) is not a Python call and is not counted.
    ``payload_bytes`` adds up the tensors handed to collectives; pickled objects are
    not counted in it.

    >>> with count_sync_points() as counts:
    ...     _ = torch.ones(3).sum().item()
    ...     _ = torch.zeros(2).tolist()
    >>> dict(counts.host_reads)
    {'item': 1, 'tolist': 1}
    """
    if _active:
        raise RuntimeError("count_sync_points() is already counting in this process")
    counts, depth = SyncCounts(), _Depth()
    saved: list[tuple[Any, str, Any, bool]] = []  # (owner, name, original, own attribute)
    targets: list[tuple[Any, str, str]] = [(torch.Tensor, name, "host_read") for name in HOST_READS]
    if dist.is_available():
        modules = (dist, dist.distributed_c10d)
        targets += [(m, name, "collective") for m in modules for name in COLLECTIVES]
    originals: dict[tuple[str, str], Any] = {}
    try:
        _active.append(counts)
        for owner, name, kind in targets:
            original = getattr(owner, name, None)
            if original is None:
                continue
            saved.append((owner, name, original, name in vars(owner)))
            wrapped = originals.setdefault((kind, name), original)
            setattr(owner, name, _counted(counts, depth, kind, name, wrapped))
        yield counts
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # inherited (torch.Tensor's methods): inherit again
        _active.clear()


def _counted(counts: SyncCounts, depth: _Depth, kind: str, name: str, original: Any) -> Any:
    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if depth.value:
            return original(*args, **kwargs)
        counts.add(kind, name, args, kwargs)
        depth.value += 1
        try:
            return original(*args, **kwargs)
        finally:
            depth.value -= 1

    return counted
