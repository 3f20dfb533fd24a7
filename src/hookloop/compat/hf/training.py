"""``Trainer.train()`` of the HF dialect, in the steps transformers' ``train()`` takes:
where to resume from (``resume_from_checkpoint``: a hookloop checkpoint, transformers'
``checkpoint-N`` folders, or a folder transformers' own Trainer wrote), whether the
arguments changed since the loop was built, ``model_init`` again, transformers'
start-of-training summary, NEFTune around the run, and the result under HF's names.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hookloop.checkpoint import MANIFEST
from hookloop.compat.hf import arguments, console, foreign, layout, results, switches
from hookloop.compat.hf import data as hf_data
from hookloop.compat.hf import optim as hf_optim
from hookloop.compat.hf import parts as hf_parts
from hookloop.result import TrainResult

log = logging.getLogger(__name__)
#: transformers' Trainer logger: the messages transformers' Trainer writes go there too
hf_log = logging.getLogger("transformers.trainer")


@dataclasses.dataclass
class TrainOutput(TrainResult):
    """The native result, also read by HF's names: ``global_step``,
    ``training_loss`` (the summary log's ``train_loss``) and ``metrics`` (HF's
    summary); unpacks as HF's triple."""

    @property
    def global_step(self) -> int:
        return self.step

    @property
    def training_loss(self) -> float | None:
        return self.logs.get("train_loss")

    def __iter__(self) -> Any:
        """Unpacks as HF's ``(global_step, training_loss, metrics)``."""
        return iter((self.global_step, self.training_loss, self.metrics))

    def __getitem__(self, i: int) -> Any:
        return tuple(self)[i]


def check_ignore_keys(ignore_keys_for_eval: Any) -> None:
    if ignore_keys_for_eval is not None and not (
        isinstance(ignore_keys_for_eval, (list, tuple))
        and all(isinstance(k, str) for k in ignore_keys_for_eval)
    ):
        raise ValueError(
            f"ignore_keys_for_eval must be a list of output names, got {ignore_keys_for_eval!r}"
        )


def resume(resume_from_checkpoint: Any, *, args: Any, loop: Any) -> Path | None:
    """The loop resumed as ``resume_from_checkpoint`` says: a checkpoint path, or True
    for the newest in ``output_dir``. A folder transformers' own Trainer wrote is
    returned instead, to be read after any rebuild, as transformers reads it."""
    if resume_from_checkpoint is None:
        return None
    if not isinstance(resume_from_checkpoint, (str, os.PathLike, bool)):
        raise TypeError(
            "resume_from_checkpoint must be a checkpoint path, True (the newest in "
            f"output_dir) or None; got {type(resume_from_checkpoint).__name__}"
        )
    if resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        output_dir = results.output_dir(args, None)
        last = layout.last_checkpoint(output_dir)  # as transformers finds it
        if last is None:  # as transformers: no fresh start
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
        compare_with_checkpoint(args, last)
        console.announce_loading(last)
        loop.resume_from(layout.native_checkpoint(last))
        return None
    if not os.path.isdir(resume_from_checkpoint):  # transformers' words
        raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")
    compare_with_checkpoint(args, Path(resume_from_checkpoint))
    console.announce_loading(resume_from_checkpoint)
    target = layout.native_checkpoint(resume_from_checkpoint)
    if layout.written_by_transformers(target):
        return Path(target)
    loop.resume_from(target)
    return None


def compare_with_checkpoint(args: Any, folder: Path) -> None:
    """transformers' warning when the arguments' intervals or batch size differ from those
    in the checkpoint's ``trainer_state.json`` (a resume goes on with the arguments')."""
    try:
        saved = json.loads((folder / layout.TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no readable trainer_state.json: the resume itself says what is wrong
    if not isinstance(saved, dict):
        return
    differ = []
    for name in ("logging_steps", "eval_steps", "save_steps"):
        ours, theirs = getattr(args, name, None), saved.get(name)
        if ours is not None and theirs is not None and ours != theirs:
            differ.append((name, ours, theirs))
    batch = getattr(args, "per_device_train_batch_size", None)
    if isinstance(saved.get("train_batch_size"), int) and batch != saved["train_batch_size"]:
        differ.append(("per_device_train_batch_size", batch, saved["train_batch_size"]))
    if differ:
        hf_log.warning(
            "The arguments differ from the checkpoint's trainer_state.json: "
            + "; ".join(
                f"{k}: {a} (from args) != {b} (from trainer_state.json)" for k, a, b in differ
            )
        )


def reusable_eval_loader(trainer: Any, loop: Any) -> Any:
    """The loop's evaluation loader, unless the arguments changed since it was built
    (transformers builds a loader from them at each evaluation): None then."""
    if loop is None or arguments.changed_fields(trainer.args_built, trainer.args):
        return None
    return loop.eval_loader


def changed_since_build(trainer: Any) -> list[str]:
    """Why the loop must be built again before this ``train()``: the arguments' fields
    that changed since it was built, a dataset or the collator set since (taken into
    ``trainer.given`` for the build), or ``model_init`` after a first ``train()``."""
    changed = arguments.changed_fields(trainer.args_built, trainer.args)
    built = {**trainer.given, "data_collator": trainer.hf.data_collator}
    now = {"train_dataset": trainer.train_dataset, "eval_dataset": trainer.eval_dataset,
           "data_collator": trainer.data_collator}  # fmt: skip
    for name, value in now.items():
        if value is not built[name]:
            trainer.given[name] = value
            changed.append(f"{name}: set since the Trainer was built")
    if not changed and trainer.model_init is not None and trainer.hf.trained:
        changed = ["model_init: a new model, optimizer and schedule at each train()"]
    return changed


@dataclasses.dataclass
class TrainCall:
    """One ``train()`` call: :meth:`attempt` runs it from the start, and again with a
    smaller batch each time ``auto_find_batch_size`` finds it ran out of memory (the loop
    built anew for that batch, the random generators left as they are, as transformers
    starts over)."""

    resume_from_checkpoint: Any
    trial: Any
    ignore_keys: Any
    foreign_folder: Path | None
    built: int  # the per-device batch the loop was built with
    trainer: Any
    rebuild: Callable[[list[str], int], None]  # the loop again, for a batch size
    run: Callable[[], TrainResult]  # the loop's train(), announced

    def run_all(self) -> TrainResult:
        """The model's own checkpointing switched on when asked (as transformers' train()
        does), then the attempts."""
        trainer = self.trainer
        if trainer.hf.drives_loop:
            switches.enable_checkpointing(trainer.args, trainer.model)
        align_special_tokens(trainer.model, trainer.processing_class)
        start = self.starting_batch_size()
        return switches.shrink_on_out_of_memory(self.attempt, trainer.args, start)

    def starting_batch_size(self) -> int:
        """The batch the loop was built with; as transformers, with ``auto_find_batch_size``
        a resume starts from the one its checkpoint's ``trainer_state.json`` records."""
        args, target = self.trainer.args, self.resume_from_checkpoint
        if not hf_optim.arg(args, "auto_find_batch_size", False) or target in (None, False):
            return self.built
        folder = (
            layout.last_checkpoint(results.output_dir(args, None)) if target is True else target
        )
        if folder is None:
            return self.built  # nothing to resume: the resume says so
        try:
            state = json.loads((Path(folder) / layout.TRAINER_STATE_NAME).read_text("utf-8"))
        except (OSError, TypeError, ValueError):
            return self.built  # no readable trainer_state.json: the resume says what is wrong
        saved = state.get("train_batch_size") if isinstance(state, dict) else None
        return saved if isinstance(saved, int) and saved > 0 else self.built

    def attempt(self, batch_size: int) -> TrainResult:
        trainer = self.trainer
        if batch_size != self.built:
            with arguments.random_state_kept():
                self.rebuild([f"auto_find_batch_size: a batch of {batch_size}"], batch_size)
            self.built = batch_size
            self.foreign_folder = resume(
                self.resume_from_checkpoint, args=trainer.args, loop=trainer.loop
            )
        prepare(trainer, self.trial, self.foreign_folder, self.ignore_keys, batch_size)
        return self.run()


def align_special_tokens(model: torch.nn.Module, processing_class: Any) -> None:
    """As transformers' ``train()``: the PAD/BOS/EOS ids the tokenizer defines replace
    those of the model's config and generation config (transformers' own function, so
    the run's ``config.json`` and generation agree with transformers' Trainer)."""
    if processing_class is None or not hasattr(model, "config"):
        return
    try:
        from transformers import PreTrainedTokenizerBase, ProcessorMixin
        from transformers.trainer_utils import align_special_tokens as align
    except ImportError:  # no transformers (no tokenizer of its), or one without the step
        return
    if isinstance(processing_class, (PreTrainedTokenizerBase, ProcessorMixin)):
        align(model, processing_class)


def batch_size_built(trainer: Any) -> int:
    """The per-device training batch the loop was built with."""
    built = trainer.args_built or {}
    size = built.get("per_device_train_batch_size")
    if size is None:
        size = hf_optim.arg(trainer.args, "per_device_train_batch_size", 8)
    return int(size)


def prepare(
    trainer: Any, trial: Any, foreign_folder: Path | None, ignore_keys: Any, batch_size: int
) -> None:
    """What transformers' ``train()`` does before its loop: the model from ``model_init``
    again, the sampler's seed, a folder transformers' Trainer wrote read, the summary
    cleared, the outputs evaluation in training leaves out, the batch size the state
    records."""
    loop, drives_loop = trainer.loop, trainer.hf.drives_loop
    trainer.hf.train_batch_size = batch_size
    if trainer.model_init is not None and drives_loop:
        # As transformers: seeded again, the model built anew (its weights copied into
        # the model the optimizer holds), so the data order follows the same RNG.
        arguments.seed_everything(int(hf_optim.arg(trainer.args, "seed", 42)))
        trainer.model.load_state_dict(trainer.call_model_init(trial).state_dict())
    seed_sampler(loop)
    trainer.hf.foreign_step = None
    if foreign_folder is not None:
        step = resume_from_transformers(
            foreign_folder, args=trainer.args, loop=loop, drives_loop=drives_loop
        )
        log.info("resumed from %s (written by transformers' Trainer) at step %d",
                 foreign_folder, step)  # fmt: skip
        trainer.hf.foreign_step = step  # announced as transformers announces a resume
    trainer.hf.summary = {}
    if isinstance(loop.evaluation, hf_parts.HFEvaluation):
        loop.evaluation.ignore_keys_in_training = ignore_keys


def seed_sampler(loop: Any) -> None:
    """Without ``data_seed`` the training order follows ``torch.initial_seed()`` as it is
    now, which is what accelerate's sampler reads when ``train()`` prepares it."""
    sampler = getattr(loop.train_loader, "sampler", None)
    if isinstance(sampler, hf_data.HFSampler) and sampler.follows_torch_seed:
        sampler.seed = torch.initial_seed()


def resume_from_transformers(folder: Path, *, args: Any, loop: Any, drives_loop: bool) -> int:
    """Load a folder transformers' Trainer wrote (:mod:`hookloop.compat.hf.foreign`);
    returns the step it resumes at."""
    if not drives_loop or loop.train_loader is None:
        raise ValueError(
            f"{folder} was written by transformers' Trainer: resuming from it needs "
            "TrainingArguments to decide the run (no hookloop config=) and a train_dataset"
        )
    k = int(hf_optim.arg(args, "gradient_accumulation_steps", 1))
    plan = hf_parts.plan_of(args, loop.train_loader, k)
    batch = int(hf_optim.arg(args, "per_device_train_batch_size", 8))
    return foreign.resume(
        folder,
        loop.checkpointer.named_state(),
        steps_per_epoch=plan.steps_per_epoch,
        samples_per_step=batch * k * loop.progress.world_size,
    )


def announce(args: Any, loop: Any, model: torch.nn.Module, foreign_step: int | None) -> None:
    """transformers' start-of-training summary, at info level on its logger
    (``foreign_step``: the step of a folder transformers' Trainer wrote, resumed from)."""
    if not hf_log.isEnabledFor(logging.INFO):
        return
    loader = loop.train_loader
    k = int(hf_optim.arg(args, "gradient_accumulation_steps", 1))
    per_device = int(hf_optim.arg(args, "per_device_train_batch_size", 8))
    world = loop.progress.world_size
    plan = hf_parts.plan_of(args, loader, k) if loader is not None else None
    examples = len(loader.dataset) if hasattr(getattr(loader, "dataset", None), "__len__") else "?"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    console.announce_ignored(loader, model, "Training")
    for line in (
        "***** Running training *****",
        f"  Num examples = {examples:,}" if examples != "?" else "  Num examples = ?",
        f"  Num Epochs = {epochs_announced(plan)}",
        f"  Num update steps per epoch = {plan.steps_per_epoch if plan else '?'}",
        f"  Instantaneous batch size per device = {per_device:,}",
        f"  Total train batch size (w. parallel, distributed & accumulation) = "
        f"{per_device * k * world:,}",
        f"  Gradient Accumulation steps = {k}",
        f"  Total optimization steps = {plan.max_steps if plan else '?'}",
        f"  Number of trainable parameters = {trainable:,}",
    ):
        hf_log.info(line)
    step = resumed_step(loop) if foreign_step is None else foreign_step
    if step is not None and plan is not None and plan.steps_per_epoch:
        skip = not hf_optim.arg(args, "ignore_data_skip", False)
        batches = step % plan.steps_per_epoch * k if skip else None
        console.announce_resume(step // plan.steps_per_epoch, step, batches)


def resumed_step(loop: Any) -> int | None:
    """The step of the hookloop checkpoint the loop will resume from (None: none)."""
    target = getattr(loop, "resume", None)
    if not isinstance(target, (str, os.PathLike)) or target == "auto":
        return None
    try:
        step = json.loads((Path(target) / MANIFEST).read_text("utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def epochs_announced(plan: hf_parts.Plan | None) -> int | str:
    """The epochs transformers announces: with ``max_steps``, those its steps reach into
    (a partial one counts); '?' for a stream."""
    if plan is None or not plan.batches:
        return "?"
    return plan.num_epochs or math.ceil(plan.max_steps / plan.steps_per_epoch)


def neftune_alpha(args: Any, *, drives_loop: bool) -> float | None:
    """``neftune_noise_alpha`` when the arguments decide the run (None: no NEFTune)."""
    return hf_optim.arg(args, "neftune_noise_alpha", None) if drives_loop else None


def run_with_neftune(
    run: Callable[[], TrainResult], model: torch.nn.Module, alpha: float | None
) -> TrainResult:
    """``run()`` with transformers' NEFTune hook on the model's input embeddings for
    ``neftune_noise_alpha`` (None: off), removed afterwards."""
    if alpha is None:
        return run()
    if not hasattr(model, "get_input_embeddings"):
        raise ValueError(
            "neftune_noise_alpha adds noise to the model's input embeddings: the model "
            f"({type(model).__name__}) has no get_input_embeddings()"
        )
    from transformers.integrations import activate_neftune, deactivate_neftune

    handle = activate_neftune(model, alpha)
    try:
        return run()
    finally:
        deactivate_neftune(model, handle)


def output(result: TrainResult, summary: dict[str, Any]) -> TrainOutput:
    """The native result under HF's names; its metrics are HF's summary, as transformers'
    (the native ones, evaluations included, when there is none)."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    fields["metrics"] = dict(summary) if summary else fields["metrics"]
    return TrainOutput(**fields)
