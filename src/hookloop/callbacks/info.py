"""A summary of the run, printed once when training starts.

The same facts are kept in ``ctx.user_state["run_info"]`` (plain numbers and
strings), so other callbacks (a logger, a tracker) can record them too.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import torch

from hookloop.callback import Callback
from hookloop.state import CallbackContext


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(total, trainable)`` parameter counts; shared (tied) tensors count once."""
    total = trainable = 0
    for p in model.parameters():  # parameters() already yields a shared tensor once
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return total, trainable


def run_info(ctx: CallbackContext, *, verbose: bool = False) -> dict[str, Any]:
    """Collect the run's facts from ``ctx``; missing pieces are simply left out."""
    info: dict[str, Any] = {}
    st, cfg, run, trainer = ctx.state, ctx.config, ctx.run, ctx.trainer
    model = ctx.model
    if model is not None:
        total, trainable = count_parameters(model)
        info["model"] = type(_unwrap(model)).__name__
        info["parameters"] = total
        info["trainable_parameters"] = trainable
        if verbose:
            for name, child in _unwrap(model).named_children():
                info[f"parameters.{name}"] = sum(p.numel() for p in child.parameters())
    if run.device is not None:
        info["device"] = str(run.device)
    train = getattr(cfg, "train", None)
    data = getattr(cfg, "data", None)
    if train is not None:
        info["precision"] = train.precision
    info["world_size"] = st.world_size
    info["max_steps"] = st.max_steps
    info["max_epochs"] = st.num_epochs
    info["steps_per_epoch"] = st.steps_per_epoch
    if st.step:
        info["resumed_at_step"] = st.step
    if data is not None and train is not None:
        info["batch_size"] = data.batch_size
        info["grad_accum"] = train.grad_accum
        info["global_batch_size"] = data.batch_size * train.grad_accum * st.world_size
        info["clip_grad_norm"] = train.clip_grad_norm
    if ctx.optimizer is not None:
        info["optimizer"] = type(ctx.optimizer).__name__
        group = ctx.optimizer.param_groups[0]
        # The peak rate: a schedule records it as initial_lr, while lr is already the first
        # warm-up value (which read as "the learning rate" misled users).
        info["lr"] = float(group.get("initial_lr", group["lr"]))
    info["scheduler"] = type(ctx.scheduler).__name__ if ctx.scheduler is not None else None
    if trainer is not None:  # the loaders are public Trainer attributes; sizes are not in ctx.run
        loaders = (trainer.train_loader, trainer.eval_loader, trainer.test_loader)
        for kind, loader in zip(("train", "eval", "test"), loaders, strict=True):
            size = _dataset_size(loader)
            if size is not None:
                info[f"{kind}_samples"] = size
        # Not in ctx.run yet: the estimate the Trainer was given (Trainer(flops_per_sample=...)).
        if trainer.flops_per_sample:
            info["flops_per_sample"] = float(trainer.flops_per_sample)
    if run.dir is not None:
        info["out_dir"] = str(run.dir.root)
    if cfg is not None and hasattr(cfg, "seed"):
        info["seed"] = cfg.seed
    return info


def format_info(info: dict[str, Any]) -> str:
    """Aligned ``key  value`` lines; large integers get thousands separators."""
    width = max((len(k) for k in info), default=0)
    lines = []
    for key, value in info.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
            text = f"{value:,}"
        elif isinstance(value, float):
            text = f"{value:.4g}"
        else:
            text = str(value)
        lines.append(f"  {key:<{width}}  {text}")
    return "\n".join(lines)


class InfoCallback(Callback):
    """Prints a run summary at train start on rank 0 and stores it in ``user_state``.

    ``stream`` is a text stream or ``"stdout"`` / ``"stderr"`` (default), or
    ``None`` to print nothing (the summary is still stored). ``verbose`` adds
    the parameter count of each top-level submodule.
    """

    priority = 1

    def __init__(
        self,
        stream: TextIO | str | None = "stderr",
        *,
        verbose: bool = False,
        key: str = "run_info",
    ) -> None:
        if isinstance(stream, str) and stream not in ("stdout", "stderr"):
            raise ValueError(
                f"stream must be a text stream, 'stdout', 'stderr' or None, got {stream!r}"
            )
        if not isinstance(verbose, bool):
            raise ValueError(f"verbose must be True or False, got {verbose!r}")
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty user_state key, got {key!r}")
        self.stream = stream
        self.verbose = verbose
        self.key = key
        self.info: dict[str, Any] = {}

    def on_train_start(self, ctx: CallbackContext) -> None:
        if not ctx.state.is_rank_zero:
            return
        self.info = run_info(ctx, verbose=self.verbose)
        ctx.user_state[self.key] = dict(self.info)
        out = {"stdout": sys.stdout, "stderr": sys.stderr}.get(self.stream, self.stream)  # type: ignore[arg-type]  # else a stream
        if out is not None:
            print("run info:\n" + format_info(self.info), file=out, flush=True)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a DistributedDataParallel / DataParallel wrapper."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def _dataset_size(loader: Any) -> int | None:
    """Samples in the loader's dataset, when it has one with a length."""
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None
