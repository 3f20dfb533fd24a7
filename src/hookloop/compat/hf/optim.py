"""The optimizer and learning-rate schedule ``TrainingArguments`` imply, as
``transformers.Trainer`` builds them.

AdamW with HF's defaults (``adam_beta1`` / ``adam_beta2`` / ``adam_epsilon``,
the fused kernel for ``optim="adamw_torch_fused"``, HF's default on torch 2.8+)
over two groups: weights that decay and those that do not (biases, LayerNorm
and any parameter whose name says norm), found as HF's
``Trainer.get_decay_parameter_names`` finds them. The schedule is
``get_scheduler``'s: a ``LambdaLR`` per ``lr_scheduler_type``. The four common
types are written here so transformers is not needed; any other type is
delegated to ``transformers.get_scheduler`` when it is installed.

:class:`OptimizerView` is what the Trainer's ``optimizer`` and ``lr_scheduler``
attributes show of them, as transformers shows its own.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Iterator
from typing import Any

import torch

#: ``lr_scheduler_type`` values built without transformers.
SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")
#: ``optim`` values the dialect builds: ``torch.optim.AdamW`` (two), ``SGD``, ``Adagrad``,
#: ``RMSprop`` (with the keys of ``optim_args`` transformers reads for each) and
#: transformers' ``Adafactor`` (transformers installed).
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor")

#: ``optim_args`` keys transformers passes to each optimizer (floats; the bools named).
_OPTIM_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sgd": (("momentum", "dampening", "weight_decay"), ("nesterov",)),
    "adagrad": (("lr_decay", "weight_decay", "eps"), ()),
    "rmsprop": (("momentum", "alpha", "eps", "weight_decay"), ("centered",)),
}

# Parameter names HF never decays (matched on the lower-cased dotted name).
_NO_DECAY_NAMES = [
    re.compile(p)
    for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
]


def arg(args: Any, name: str, default: Any) -> Any:
    """``args.name`` for our TrainingArguments or transformers' (enums read as values)."""
    value = getattr(args, name, default)
    return getattr(value, "value", value)


def decay_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters weight decay applies to: neither inside a
    ``LayerNorm`` nor named like a bias or a norm."""
    names: list[str] = []
    for child_name, child in model.named_children():
        if isinstance(child, torch.nn.LayerNorm):
            continue
        for name in decay_parameter_names(child):
            full = f"{child_name}.{name}"
            if not any(p.search(full.lower()) for p in _NO_DECAY_NAMES):
                names.append(full)
    own = [n for n, _ in model.named_parameters(recurse=False)]
    names += [n for n in own if not any(p.search(n.lower()) for p in _NO_DECAY_NAMES)]
    return names


def create_optimizer(
    model: torch.nn.Module, args: Any, *, cls_and_kwargs: tuple[type, dict[str, Any]] | None = None
) -> torch.optim.Optimizer:
    """HF's default optimizer for ``model`` under ``args``; with ``cls_and_kwargs``
    (the Trainer's ``optimizer_cls_and_kwargs``) that class and keywords over HF's
    weight-decay groups instead."""
    cls, kwargs = cls_and_kwargs if cls_and_kwargs is not None else optimizer_cls_and_kwargs(args)
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    groups = [
        {
            "params": [p for n, p in named if n in decay],
            "weight_decay": arg(args, "weight_decay", 0.0),
        },
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return cls(groups, **kwargs)


def optimizer_cls_and_kwargs(
    args: Any, model: torch.nn.Module | None = None
) -> tuple[type, dict[str, Any]]:
    """The optimizer class ``args.optim`` names and the keywords transformers builds it
    with (``Trainer.get_optimizer_cls_and_kwargs``); ``model`` is unused, as by the
    optimizers built here."""
    optim = str(arg(args, "optim", "adamw_torch_fused"))
    if optim not in OPTIMIZERS:
        raise ValueError(
            f"TrainingArguments.optim={optim!r} is not built by hookloop.compat.hf; "
            f"allowed: {', '.join(OPTIMIZERS)} (or pass optimizers=(optimizer, scheduler))"
        )
    lr = arg(args, "learning_rate", 5e-5)
    if optim in _OPTIM_ARGS:
        floats, bools = _OPTIM_ARGS[optim]
        given = parse_optim_args(arg(args, "optim_args", None))
        kwargs: dict[str, Any] = {"lr": lr}
        kwargs.update({k: float(v) for k, v in given.items() if k in floats})
        kwargs.update(
            {k: v.lower() in ("true", "1", "yes") for k, v in given.items() if k in bools}
        )
        cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}.get(
            optim, torch.optim.RMSprop
        )
        return cls, kwargs
    if optim == "adafactor":
        try:
            from transformers.optimization import Adafactor
        except ImportError:
            raise ValueError(
                "TrainingArguments.optim='adafactor' is transformers' Adafactor: install "
                "transformers, or pick one of " + ", ".join(o for o in OPTIMIZERS if o != optim)
            ) from None
        return Adafactor, {"lr": lr, "scale_parameter": False, "relative_step": False}
    betas = (arg(args, "adam_beta1", 0.9), arg(args, "adam_beta2", 0.999))
    kwargs = {"lr": lr, "betas": betas, "eps": arg(args, "adam_epsilon", 1e-8)}
    return torch.optim.AdamW, {
        **kwargs,
        **({"fused": True} if optim == "adamw_torch_fused" else {}),
    }


def parse_optim_args(text: Any) -> dict[str, str]:
    """``"momentum=0.9,nesterov=True"`` as ``{"momentum": "0.9", "nesterov": "True"}``."""
    if not text:
        return {}
    parsed = {}
    for item in str(text).replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(
                f"TrainingArguments.optim_args must read 'key=value,key=value', got {text!r}"
            )
        parsed[key] = value
    return parsed


def warmup_steps(args: Any, total_steps: int) -> int:
    """HF's warm-up length: ``warmup_steps`` (a fraction of the run when below 1),
    else ``warmup_ratio`` of the run (transformers 4.x's name)."""
    steps = arg(args, "warmup_steps", 0) or 0
    if steps >= 1:
        return int(steps)
    if steps > 0:
        return math.ceil(total_steps * steps)
    return math.ceil(total_steps * (arg(args, "warmup_ratio", 0.0) or 0.0))


def create_scheduler(
    optimizer: torch.optim.Optimizer, args: Any, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """``get_scheduler(args.lr_scheduler_type, ...)`` over ``total_steps`` optimizer steps."""
    name = str(arg(args, "lr_scheduler_type", "linear"))
    warmup = warmup_steps(args, total_steps)
    kwargs = dict(arg(args, "lr_scheduler_kwargs", None) or {})
    if name in SCHEDULES:
        factor = _FACTORS[name]
        lam = functools.partial(factor, warmup=warmup, total=total_steps, **kwargs)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lam)
    try:
        from transformers import get_scheduler
    except ImportError:
        raise ValueError(
            f"TrainingArguments.lr_scheduler_type={name!r} needs transformers installed; "
            f"without it the dialect builds {', '.join(SCHEDULES)}"
        ) from None
    return get_scheduler(
        name,
        optimizer=optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=kwargs,
    )


def _ramp(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _ramp(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int, num_cycles: float = 0.5) -> float:
    if step < warmup:
        return _ramp(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def _constant(step: int, *, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int, total: int) -> float:
    return _ramp(step, warmup) if step < warmup else 1.0


_FACTORS = {
    "linear": _linear,
    "cosine": _cosine,
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
}


def set_up(optimizer: Any) -> Any:
    """``optimizer``, or transformers' refusal when there is none yet."""
    if optimizer is None:  # transformers' words
        raise ValueError(
            "Trainer optimizer is None, please make sure you have setup the optimizer before."
        )
    return optimizer


def optimizer_group(optimizer: Any, param: Any = None) -> Any:
    """The parameter group of ``optimizer`` holding ``param``, or every group without one."""
    groups = optimizer.param_groups
    if param is None:
        return groups
    for group in groups:
        if any(p is param for p in group["params"]):
            return group
    raise ValueError(f"parameter {param!r} is in no optimizer group")


class OptimizerView:
    """What ``trainer.model``, ``optimizer`` and ``lr_scheduler`` show. While the loop is
    being built they are the staged objects ``create_optimizer`` / ``create_scheduler``
    see and set; afterwards the loop's, each shown as transformers shows it: None until
    ``create_*()`` or ``train()``, unless given in ``optimizers``."""

    def __init__(self) -> None:
        self.loop: Any = None  # the loop, once built
        self.staged: dict[str, Any] | None = None
        self.shown: set[str] = set()  # "optimizer", "lr_scheduler": shown to the user
        self.scheduler_view: Any = None  # a schedule create_scheduler() made after the build
        self.by_create = False  # inside create_scheduler() after the build

    def show_given(self, optimizers: Any) -> None:
        """Show what was given in ``optimizers`` (a build starts from it)."""
        names = ("optimizer", "lr_scheduler")
        self.shown = {n for n, o in zip(names, optimizers or (), strict=False) if o is not None}

    @contextlib.contextmanager
    def staging(self, model: Any, optimizer: Any, scheduler: Any) -> Iterator[dict[str, Any]]:
        """The objects ``create_optimizer`` and ``create_scheduler`` see before the loop
        exists (the dict holds what they set)."""
        self.staged = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
        try:
            yield self.staged
        finally:
            self.staged = None

    def get(self, name: str) -> Any:
        if self.staged is not None:
            return self.staged[name]
        if name == "model":
            return self.loop.model
        if name == "lr_scheduler" and self.scheduler_view is not None:
            return self.scheduler_view
        held = self.loop.optimizer if name == "optimizer" else self.loop.scheduler
        return held if name in self.shown else None

    def set(self, name: str, value: Any) -> None:
        if self.staged is not None:
            self.staged[name] = value
        elif name == "optimizer" and value is self.loop.optimizer:
            self.shown.add(name)
        elif name == "lr_scheduler" and self.by_create:
            self.scheduler_view = value  # create_scheduler()'s, until train()
        else:
            raise AttributeError(
                f"Trainer.{name} is set by create_optimizer / create_scheduler (override "
                "them, or pass optimizers=(optimizer, lr_scheduler)); the loop already holds "
                f"its {name}"
            )

    def show_training_objects(self) -> None:
        """From ``train()`` on, the optimizer and schedule the loop trains with are shown;
        a schedule ``create_scheduler()`` made for inspection is dropped (and the rates it
        set back to the loop's), as transformers' ``train()`` makes its own."""
        loop = self.loop
        if self.scheduler_view is not None and loop.scheduler is not None:
            for group, lr in zip(
                loop.optimizer.param_groups, loop.scheduler.get_last_lr(), strict=False
            ):
                group["lr"] = lr
        self.scheduler_view = None
        self.shown.update(("optimizer", "lr_scheduler"))
