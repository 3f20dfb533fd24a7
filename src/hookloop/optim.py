"""Optimizer and learning-rate schedule built from config (used by entry points)."""

from __future__ import annotations

import math

import torch

from hookloop.config import OptimizerConfig, SchedulerConfig


def build_optimizer(cfg: OptimizerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW/Adam/SGD over the trainable parameters; no decay on biases and norms."""
    cfg.validate()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"optimizer.name must be 'adamw', 'adam' or 'sgd', got {cfg.name!r}")


def build_scheduler(
    cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int | None
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A LambdaLR with linear warm-up then constant / cosine / linear decay.

    Returns None for a constant rate without warm-up (nothing to step).
    """
    cfg.validate()
    if cfg.name == "constant" and cfg.warmup_steps == 0:
        return None
    if cfg.name != "constant" and not total_steps:
        raise ValueError(
            f"scheduler.name={cfg.name!r} decays over the run, so it needs train.max_steps "
            "(or a sized dataset with train.max_epochs)"
        )
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    total = total_steps or 1

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if cfg.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
