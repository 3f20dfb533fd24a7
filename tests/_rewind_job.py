"""A run whose loss explodes on one known batch, for tests/test_rewind.py (not collected).

The data is not shuffled, so the batch a rank trains on at each step is known:
its *position* in the rank's share of the epoch. The forward step multiplies the
loss of the batch at position ``SPIKE`` on rank 0 by 10^4 (the loss logged is
the mean over ranks, so every rank's detector sees it) and records which
position each step trained on.

Run as ``python _rewind_job.py MODE OUT [KEY=VALUE ...]`` (or under torchrun):
MODE ``plain`` trains to the end; ``kill`` SIGKILLs itself at the end of step
``KILL_AT`` once it has rewound; ``resume`` continues ``OUT`` with
``resume="auto"``. ``detect_on_rank=R`` leaves the divergence to rank R's
detector alone (the others' never fire). Every rank writes ``result-MODE-rankR.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from hookloop import Callback, Config, DataConfig, TrainConfig, Trainer
from hookloop.callbacks import JsonLogger
from hookloop.callbacks.divergence import DivergenceDetector
from hookloop.distributed import init_from_env, leave_process_group, rank_info
from hookloop.testing import TinyModel

BATCH = 4
SPIKE = 7  # position of the batch whose loss explodes: trained at step 8
KILL_AT = 13  # the save of step 9 has committed by then (one save in flight at most)


class Numbered(Dataset):
    """``(x, y, i)``: toy regression samples that carry their own index."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) / 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class SpikyStep:
    """The forward step: records each step's batch position; explodes on SPIKE."""

    def __init__(self, spike: float = 1e4) -> None:
        self.spike = spike  # the factor on the SPIKE batch's loss (nan: a non-finite loss)
        self.seen: list[tuple[int, int]] = []  # (step, batch position), in training order

    def __call__(self, state: Any, data_iterator: Any, model: Any) -> Any:
        x, y, index = next(data_iterator)
        position = int(index[0]) // state.world_size // BATCH
        self.seen.append((state.step, position))
        spike = self.spike if position == SPIKE and state.rank == 0 else 1.0
        output = model(x)
        return output, lambda out: (torch.nn.functional.mse_loss(out, y) * spike, {})

    def timeline(self) -> dict[int, int]:
        """step -> the batch position the finished run trained it on (a replay wins)."""
        return dict(self.seen)


def build(
    out: Path, *, resume: str | None = None, callbacks: list[Callback] = (), **settings: Any
) -> tuple[Trainer, SpikyStep]:
    """The run: 14 steps, checkpoints every 3 (``checkpoint.*`` and detector settings
    may be overridden by keyword: ``local_every=1``, ``skip_batches=0`` ...; ``spike``
    is the factor on the spiking batch's loss)."""
    _, _, world = rank_info()
    cfg = Config(
        train=TrainConfig(
            max_steps=settings.pop("max_steps", 14), log_every=1, device="cpu",
            handle_signals=False,
        ),
        data=DataConfig(batch_size=BATCH, shuffle=False),
    )  # fmt: skip
    spike = settings.pop("spike", 1e4)
    cfg.checkpoint.every = 3
    cfg.checkpoint.keep_last = None
    for key in ("every", "local_every", "keep_last"):
        if key in settings:
            setattr(cfg.checkpoint, key, settings.pop(key))
    detector = DivergenceDetector(
        smoothing=1.0, patience=1, warmup=2, action="rewind",
        **{"threshold": 100.0, "skip_batches": 3, "max_rewinds": 2, **settings},
    )  # fmt: skip
    step = SpikyStep(spike)
    trainer = Trainer(
        TinyModel(), train_data=Numbered(128 * world), forward_step=step, config=cfg,
        out_dir=str(out), resume=resume,
        callbacks=[detector, JsonLogger(out / "metrics.jsonl"), *callbacks],
    )  # fmt: skip
    return trainer, step


class KillAfterRewind(Callback):
    def on_train_step_end(self, ctx: Any) -> None:
        if ctx.state.rewinds and ctx.state.step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, out, *overrides = sys.argv[1:]
    init_from_env()
    rank, _, world = rank_info()
    settings = {k: json.loads(v) for k, v in (o.split("=", 1) for o in overrides)}
    if settings.pop("detect_on_rank", rank) != rank:  # the others' detectors never fire
        settings["threshold"] = 1e30
    callbacks = [KillAfterRewind()] if mode == "kill" else []
    trainer, step = build(
        Path(out), resume="auto" if mode == "resume" else None, callbacks=callbacks, **settings
    )
    result = trainer.train()
    record = {
        "rank": rank,
        "step": result.step,
        "exit_code": int(result.exit_code),
        "stop_reason": result.stop_reason,
        "rewinds": [r.to_json() for r in trainer.state.rewinds],
        "seen": step.seen,
        "params": [p.detach().flatten().tolist() for p in trainer.model.parameters()],
    }
    (Path(out) / f"result-{mode}-rank{rank}.json").write_text(json.dumps(record))
    if world > 1:
        leave_process_group()


if __name__ == "__main__":
    main()
