"""``Trainer`` for the HF dialect: the native trainer, built the HuggingFace way.

It is :class:`hookloop.Trainer` itself (a subclass that only translates the
constructor), so the loop, checkpoints and native callbacks are unchanged.
HF-style callbacks in ``callbacks`` are wrapped by one :class:`HFSession`;
native ones pass through, and registration order is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hookloop.compat.hf.adapter import HFSession
from hookloop.compat.hf.types import TrainingArguments
from hookloop.config import Config, TrainConfig
from hookloop.manager import CallbackManager
from hookloop.trainer import Trainer as NativeTrainer


class Trainer(NativeTrainer):
    """``Trainer(model, args, train_dataset=..., eval_dataset=..., callbacks=[...])``.

    ``args`` (HF names) decides the run unless a hookloop ``config`` is given, in
    which case ``config`` decides it and ``args`` is only what callbacks see; with
    neither, both are the defaults. ``optimizers`` is HF's ``(optimizer,
    lr_scheduler)`` pair. Other keywords (``loss_fn``, ``forward_step``,
    ``out_dir``, ``resume``, ...) are the native trainer's. ``args.output_dir``
    becomes ``out_dir`` (checkpoints) unless ``out_dir`` is given.

    The dialect objects are ``trainer.args`` and ``trainer.hf.state`` /
    ``trainer.hf.control``; ``trainer.state`` stays the native ``TrainState``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        args: Any = None,
        *,
        train_dataset: Iterable[Any] | None = None,
        eval_dataset: Iterable[Any] | None = None,
        test_dataset: Iterable[Any] | None = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        processing_class: Any = None,
        config: Config | TrainConfig | None = None,
        **native: Any,
    ) -> None:
        if not (isinstance(optimizers, (tuple, list)) and len(optimizers) == 2):
            raise ValueError(
                "optimizers must be a pair (optimizer, lr_scheduler), either may be None; "
                f"got {optimizers!r}"
            )
        for key in ("train_data", "eval_data", "test_data", "callbacks", "scheduler"):
            if key in native:
                raise TypeError(
                    f"hookloop.compat.hf.Trainer takes HF's names: use "
                    f"{_HF_NAME[key]} instead of {key}"
                )
        self.hf = HFSession(args, processing_class=processing_class)
        if config is None and args is not None:
            config = _args_config(args)
        if args is not None and native.get("out_dir") is None:
            native["out_dir"] = getattr(args, "output_dir", None)
        manager = CallbackManager(self.hf.wrap(callbacks))
        optimizer, scheduler = optimizers
        super().__init__(
            model,
            optimizer,
            train_data=train_dataset,
            eval_data=eval_dataset,
            test_data=test_dataset,
            config=config,
            callbacks=manager,
            scheduler=scheduler,
            **native,
        )

    @property
    def args(self) -> Any:
        """The HF-named arguments callbacks receive."""
        return self.hf.args

    def add_callback(self, callback: Any) -> None:
        """Add an HF-style or native callback (instance or HF class), as HF's Trainer does."""
        self.callbacks.add(self.hf.wrap([callback]))


_HF_NAME = {
    "train_data": "train_dataset",
    "eval_data": "eval_dataset",
    "test_data": "test_dataset",
    "callbacks": "callbacks",
    "scheduler": "optimizers=(optimizer, lr_scheduler)",
}


def _args_config(args: Any) -> Config:
    """The Config that runs ``args``; a transformers ``TrainingArguments`` is read by name."""
    if isinstance(args, TrainingArguments):
        return args.to_config()
    fields = {
        name: getattr(args, name)
        for name in TrainingArguments.__dataclass_fields__
        if hasattr(args, name)
    }
    return TrainingArguments(**fields).to_config()
