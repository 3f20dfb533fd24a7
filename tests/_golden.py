"""The small run every golden event trace is taken on (native and each dialect).

TinyModel on ToyData(n=16), batch 4, grad_accum 2 (2 optimizer steps an epoch),
2 epochs, log every 2 steps, evaluate every 3 steps and at each epoch end.
"""

from __future__ import annotations

from hookloop import Config


def golden_run_config() -> Config:
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device = "cpu"
    cfg.train.handle_signals = False
    cfg.train.grad_accum = 2
    cfg.train.max_epochs = 2
    cfg.train.eval_every = 3
    cfg.train.log_every = 2
    return cfg
