"""Two DDP ranks (gloo) training with ``callbacks.ema_decay``, launched by torchrun (not
collected): each writes its averages and weights to ``<out>/ema-rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hookloop.callbacks import EMA, default_callbacks
from hookloop.config import apply_overrides
from hookloop.distributed import init_from_env, leave_process_group, rank_info
from hookloop.entry import build_trainer
from hookloop.recipes import default_config


def main() -> None:
    out = Path(sys.argv[1])
    init_from_env()
    rank, _, world = rank_info()
    cfg = default_config("mlp-regression")
    apply_overrides(
        cfg,
        [
            "train.max_steps=6",
            "train.log_every=0",
            "train.eval_every=3",
            "callbacks.ema_decay=0.9",
            "logging.progress=false",
        ],
    )
    trainer = build_trainer(cfg, callbacks=default_callbacks(cfg, None))  # as `hookloop train`
    (ema,) = [cb for cb in trainer.callbacks.callbacks if isinstance(cb, EMA)]
    trainer.train()
    record = {
        "world": world,
        "updates": ema.updates,
        "averages": {n: t.flatten().tolist() for n, t in ema.averaged_state_dict().items()},
        "weights": {n: p.detach().flatten().tolist() for n, p in ema_names(trainer.model)},
    }
    (out / f"ema-rank{rank}.json").write_text(json.dumps(record))
    leave_process_group()
    sys.stdout.flush()
    os._exit(0)  # as tests/_dist_job.py: the result is written; skip torch's teardown


def ema_names(model):
    return getattr(model, "module", model).named_parameters()


if __name__ == "__main__":
    main()
