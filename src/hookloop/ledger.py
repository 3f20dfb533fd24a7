"""The sample ledger: which samples each step trained on, to check nothing was lost or repeated.

With ``data.ledger=true`` every rank appends one line per optimizer step to
``<run>/ledger/rank-<R>.jsonl``: the epoch, the global positions (in the epoch's
shuffled order) of the samples it took, as a range (first, stride = ranks, count),
and a CRC-32 of the sample indices themselves as the sampler dealt them. A resume
cuts every file back to the restored step, so the files always tell the history of
the run as it stands, across resumes on any number of ranks.

:func:`verify_ledger` (``hookloop runs RUN --verify-ledger``) recomputes each epoch's
order from the seed and checks that every step's ranks together took one contiguous
slice of it, that the slices follow each other with no gap (lost) and no overlap
(repeated), and that the indices match the CRCs.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hookloop.callback import Callback
from hookloop.data import EpochSampler
from hookloop.state import CallbackContext

LEDGER_DIR = "ledger"


def ledger_file(run_dir: Path, rank: int) -> Path:
    return run_dir / LEDGER_DIR / f"rank-{rank}.jsonl"


class SampleLedger(Callback):
    """Writes this rank's ledger lines (see the module doc); built by the loop when
    ``data.ledger`` is on and the train data is dealt by an :class:`EpochSampler`."""

    def __init__(self, sampler: EpochSampler, run_dir: Path, batch_size: int) -> None:
        self.sampler = sampler
        self.run_dir = run_dir
        self.batch_size = batch_size
        self.taken: deque[tuple[int, int, int]] = deque()  # (position, index, epoch)
        sampler.recorder = self.taken
        self._epoch = -1

    def on_train_start(self, ctx: CallbackContext) -> None:
        st = ctx.state
        path = ledger_file(self.run_dir, st.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        cut_after(path, st.step)
        if st.rank == 0:  # files of ranks this run no longer has (a resume on fewer)
            for other in path.parent.glob("rank-*.jsonl"):
                if other != path and _rank_of(other) >= st.world_size:
                    cut_after(other, st.step)
        s = self.sampler
        header = {"order": {"length": s.length, "seed": s.seed, "shuffle": s.shuffle},
                  "step": st.step, "world": st.world_size}  # fmt: skip
        _append(path, header)

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        st, s = ctx.state, self.sampler
        if s.epoch != self._epoch:  # a new epoch: what the last one fetched ahead is dropped
            while self.taken and self.taken[0][2] != s.epoch:
                self.taken.popleft()
            self._epoch = s.epoch
        used = st.epoch_step * ctx.config.train.grad_accum * self.batch_size  # this rank's
        rows = []
        while self.taken and self.taken[0][0] < used:
            rows.append(self.taken.popleft())
        if not rows:
            return
        positions = [p for p, _, _ in rows]
        indices = [i for _, i, _ in rows]
        line = {"step": st.step, "epoch": s.epoch, "rank": st.rank, "world": s.world_size,
                "first": positions[0] * s.world_size + s.rank, "count": len(rows),
                "crc": zlib.crc32(json.dumps(indices).encode())}  # fmt: skip
        if positions != list(range(positions[0], positions[0] + len(rows))):
            line["positions"] = positions  # not one range: said as it is
        _append(ledger_file(self.run_dir, st.rank), line)


def _rank_of(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {number} is not JSON") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {number} is not an object")
        out.append(record)
    return out


def cut_after(path: Path, step: int) -> None:
    """Drop the lines of steps after ``step`` (a resume's abandoned leg), atomically."""
    records = _read(path)
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    if len(kept) == len(records):
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    tmp.replace(path)


@dataclass
class LedgerReport:
    """What :func:`verify_ledger` found."""

    steps: int = 0
    samples: int = 0
    lost: list[str] = field(default_factory=list)
    repeated: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.repeated or self.mismatched)

    def summary(self) -> str:
        head = f"{self.steps} steps, {self.samples} samples"
        if self.ok:
            return f"ledger ok: {head}, 0 lost, 0 repeated"
        parts = [f"{len(self.lost)} lost", f"{len(self.repeated)} repeated",
                 f"{len(self.mismatched)} mismatched"]  # fmt: skip
        first = (self.lost + self.repeated + self.mismatched)[0]
        return f"ledger NOT ok: {head}, {', '.join(parts)}; first: {first}"


def verify_ledger(run_dir: str | Path) -> LedgerReport:
    """Check the run's ledger (see the module doc). Raises ``FileNotFoundError`` when the
    run has none."""
    folder = Path(run_dir) / LEDGER_DIR
    files = sorted(folder.glob("rank-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no ledger (train with data.ledger=true)")
    order_of: dict[str, Any] = {}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for path in files:
        for record in _read(path):
            if "order" in record:
                order_of = record["order"]
            elif "first" in record:
                by_step.setdefault(int(record["step"]), []).append(record)
    report = LedgerReport()
    orders: dict[int, list[int]] = {}
    seen: dict[int, set[int]] = {}
    expected_next: dict[int, int] = {}
    for step in sorted(by_step):
        report.steps += 1
        for epoch, positions in _positions(by_step[step]).items():
            order = orders.get(epoch) or orders.setdefault(epoch, _order(order_of, epoch))
            taken = seen.setdefault(epoch, set())
            again = taken & set(positions)
            again |= {p for p, n in Counter(positions).items() if n > 1}  # twice in one step
            if again:
                report.repeated.append(f"step {step}: epoch {epoch} positions {sorted(again)[:5]}")
            start, distinct = expected_next.get(epoch, 0), sorted(set(positions))
            if distinct != list(range(start, start + len(distinct))):
                report.lost.append(f"step {step}: epoch {epoch} expected from position {start}")
            taken.update(positions)
            expected_next[epoch] = distinct[-1] + 1
            report.samples += len(positions)
        for record in by_step[step]:
            indices = [order[p] for p in _record_positions(record) if p < len(order)]
            if zlib.crc32(json.dumps(indices).encode()) != record["crc"]:
                report.mismatched.append(f"step {step}: rank {record['rank']} indices differ")
    return report


def _record_positions(record: dict[str, Any]) -> list[int]:
    world, rank = int(record["world"]), int(record["rank"])
    if "positions" in record:
        return [p * world + rank for p in record["positions"]]
    first, count = int(record["first"]), int(record["count"])
    return [first + world * i for i in range(count)]


def _positions(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for record in records:
        out.setdefault(int(record["epoch"]), []).extend(_record_positions(record))
    return out


def _order(order: dict[str, Any], epoch: int) -> list[int]:
    sampler = EpochSampler(int(order["length"]), shuffle=bool(order["shuffle"]),
                           seed=int(order["seed"]))  # fmt: skip
    sampler.set_epoch(epoch)
    return sampler.order()
