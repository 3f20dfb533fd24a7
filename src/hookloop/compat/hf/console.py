"""What the HF dialect prints: transformers' console, unless hookloop's is asked for.

A script that swaps its import of ``Trainer`` for ``hookloop.compat.hf`` sees what
transformers' Trainer shows with the same arguments: transformers' own
``ProgressCallback`` (its tqdm bars and the log dicts written under them) or, with
``disable_tqdm``, its ``PrinterCallback``, chosen as transformers chooses; and the
info lines transformers' Trainer writes on its logger (``transformers.trainer``), so
the scripts' ``log_level`` governs them. ``HOOKLOOP_HF_CONSOLE=hookloop`` in the
environment shows hookloop's progress table instead (as does a run without
transformers installed).

Checkpoints are written into a staging folder (``checkpoint-N.partial``) renamed when
complete: :func:`naming_final_folder` makes the lines transformers' ``save_pretrained``
logs name the folder the files end up in.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hookloop.compat.hf.data import ignored_columns
from hookloop.compat.hf.handler import PrinterCallback

#: transformers' Trainer logger: the dialect's lines of transformers' console go there.
hf_log = logging.getLogger("transformers.trainer")
#: where transformers' ``save_pretrained`` reports the weights it wrote
modeling_log = logging.getLogger("transformers.modeling_utils")
WEIGHTS = "model.safetensors"

#: The environment variable choosing the console, and the consoles it may name.
CONSOLE_VARIABLE = "HOOKLOOP_HF_CONSOLE"
CONSOLES = ("transformers", "hookloop")


def chosen_console() -> str:
    """``"transformers"`` (the default) or ``"hookloop"``, as ``$HOOKLOOP_HF_CONSOLE``
    says; transformers' console needs transformers installed."""
    console = os.environ.get(CONSOLE_VARIABLE, "transformers").strip().lower() or "transformers"
    if console not in CONSOLES:
        raise ValueError(
            f"{CONSOLE_VARIABLE}={os.environ[CONSOLE_VARIABLE]!r} names no console; "
            f"allowed: {', '.join(CONSOLES)}"
        )
    if console == "transformers" and importlib.util.find_spec("transformers") is None:
        return "hookloop"
    return console


def progress_callback(args: Any) -> Any:
    """The progress display transformers' Trainer adds last to its callbacks:
    ``PrinterCallback`` with ``disable_tqdm``, else ``ProgressCallback`` (in a notebook
    ``NotebookProgressCallback``): transformers' own classes. With hookloop's console,
    hookloop's table (Forgather's ``ProgressCallback``) or, with ``disable_tqdm``, the
    dialect's ``PrinterCallback``."""
    if chosen_console() == "transformers":
        from transformers import trainer_callback
        from transformers.utils import is_in_notebook

        if tqdm_disabled(args):
            return trainer_callback.PrinterCallback()
        if is_in_notebook():  # transformers' choice in Jupyter: its notebook display
            from transformers.utils.notebook import NotebookProgressCallback

            return NotebookProgressCallback()
        return trainer_callback.ProgressCallback()
    if tqdm_disabled(args):
        return PrinterCallback()
    # hookloop.compat.forgather builds on this package, so it is looked up when a
    # Trainer is built, not imported with this module
    forgather = importlib.import_module("hookloop.compat.forgather.callbacks")
    return forgather.ProgressCallback()


def tqdm_disabled(args: Any) -> bool:
    """``args.disable_tqdm``; left None (on arguments that keep it so), transformers'
    default: disabled when its logger shows nothing of level WARNING."""
    disabled = getattr(args, "disable_tqdm", False)
    if disabled is None:
        return logging.getLogger("transformers.training_args").getEffectiveLevel() > logging.WARN
    return bool(disabled)


# -- transformers' info lines ---------------------------------------------------------------
def announce_max_steps(args: Any) -> None:
    """What transformers' Trainer says when built with both ``max_steps`` and epochs."""
    if getattr(args, "max_steps", -1) > 0 and getattr(args, "num_train_epochs", 0) > 0:
        hf_log.info("max_steps is given, it will override any value given in num_train_epochs")


def start_pass(session: Any, ctx: Any, loader: Any, kind: str) -> None:
    """Before an evaluation (``kind`` ``"eval"``) or prediction (``"test"``) pass, as
    transformers' ``evaluation_loop`` begins: its lines, and ``loader`` becomes the
    ``eval_dataloader`` callbacks are handed (the progress bar's length is its)."""
    if session.kwargs is None:
        session.bind(ctx)
    session.kwargs["eval_dataloader"] = loader
    if hf_log.isEnabledFor(logging.INFO):
        args = session.args
        per_device_eval = getattr(args, "per_device_eval_batch_size", 8)
        batch_size = int(getattr(args, "eval_batch_size", None) or per_device_eval)
        per_device_train = getattr(args, "per_device_train_batch_size", 8)
        description = "Evaluation" if kind == "eval" else "Prediction"
        announce_ignored(
            loader, getattr(ctx, "model", None), "Evaluation" if kind == "eval" else "test"
        )
        announce_pass(description, examples_in(loader, per_device_train), batch_size)


def announce_ignored(loader: Any, model: Any, description: str) -> None:
    """transformers' line as it builds a loader whose dataset lost columns ``model.forward``
    does not take (``remove_unused_columns``); ``description``: ``"Training"``,
    ``"Evaluation"`` or ``"test"``, as transformers names the set."""
    ignored = ignored_columns(loader)
    if not ignored or not hf_log.isEnabledFor(logging.INFO):
        return
    name, columns = type(getattr(model, "module", model)).__name__, ", ".join(ignored)
    hf_log.info(
        f"The following columns in the {description} set don't have a corresponding argument "
        f"in `{name}.forward` and have been ignored: {columns}. If {columns} are not expected "
        f"by `{name}.forward`,  you can safely ignore this message."
    )


def examples_in(loader: Any, per_device_train: int) -> int | None:
    """The examples transformers counts in ``loader``: its dataset's length, else its
    batches times the training batch size; None where the loader has no length."""
    try:
        batches = len(loader)
    except TypeError:
        return None
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return batches * per_device_train


def announce_loading(folder: str | os.PathLike[str]) -> None:
    """transformers' line as ``train(resume_from_checkpoint=...)`` loads ``folder``."""
    hf_log.info(f"Loading model from {folder}.")


def announce_resume(epochs: int, step: int, batches: int | None) -> None:
    """transformers' last lines of the training summary when resuming: the epoch and
    step resumed at, and (``batches`` None with ``ignore_data_skip``) the batches of the
    epoch skipped."""
    hf_log.info(f"  Resuming training from checkpoint with epoch {epochs} and global step {step}")
    if batches is not None:
        hf_log.info(
            f"  Fast-forwarding the dataloader past {epochs} epochs and {batches} batches to "
            "resume from the exact training state."
        )


def announce_pass(description: str, examples: int | None, batch_size: int) -> None:
    """transformers' lines before an evaluation or prediction pass (``description``:
    ``"Evaluation"`` or ``"Prediction"``); ``examples`` None for a loader of unknown
    length."""
    hf_log.info(f"\n***** Running {description} *****")
    if examples is None:
        hf_log.info("  Num examples: Unknown")
    else:
        hf_log.info(f"  Num examples = {examples}")
    hf_log.info(f"  Batch size = {batch_size}")


def announce_saving(folder: str | os.PathLike[str]) -> None:
    """transformers' line as it writes a checkpoint's model (``folder``: its final name)."""
    hf_log.info(f"Saving model checkpoint to {folder}")


def announce_model_written(folder: Path, model: Any) -> None:
    """What transformers shows as it writes a checkpoint's weights (the dialect copies
    them from hookloop's checkpoint): for a model with ``save_pretrained``, the shard bar
    and the line of ``save_pretrained``; for another module, the Trainer's note."""
    if not callable(getattr(model, "save_pretrained", None)):
        hf_log.info("Trainer.model is not a `PreTrainedModel`, only saving its state dict.")
        return
    from transformers.utils import logging as hf_logging

    for _ in hf_logging.tqdm([WEIGHTS], desc="Writing model shards"):
        pass  # the weights are in the folder already
    modeling_log.info(f"Model weights saved in {folder / WEIGHTS}")


def announce_collator_tokenizer() -> None:
    """transformers' note when it saves the collator's tokenizer for want of a
    ``processing_class``."""
    hf_log.info(
        "Saving Trainer.data_collator.tokenizer by default as Trainer.processing_class is `None`"
    )


def announce_best_model(folder: str, score: Any) -> None:
    """transformers' line as ``load_best_model_at_end`` loads the best checkpoint."""
    hf_log.info(f"Loading best model from {folder} (score: {score}).")


def announce_deleting(folder: Path) -> None:
    """transformers' line as ``save_total_limit=1`` removes a folder but the best."""
    hf_log.info(f"Deleting older checkpoint [{folder}] due to args.save_total_limit")


def announce_training_completed() -> None:
    """transformers' line at the end of training, before the summary log."""
    hf_log.info(
        "\n\nTraining completed. Do not forget to share your model on huggingface.co/models =)\n\n"
    )


# -- the staging folder --------------------------------------------------------------------
class _FinalFolder(logging.Filter):
    """Rewrites the staging folder's path into the final one in each record's message."""

    def __init__(self, staging: str, final: str) -> None:
        super().__init__()
        self.staging, self.final = staging, final

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.staging in message:
            record.msg, record.args = message.replace(self.staging, self.final), None
        return True


@contextlib.contextmanager
def naming_final_folder(staging: str | os.PathLike[str], final: Path) -> Iterator[None]:
    """Within it, transformers' loggers name ``final`` where their messages name the
    ``staging`` folder files are written to before it is renamed to ``final``."""
    rewrite = _FinalFolder(str(staging), str(final))
    loggers = [logging.getLogger(name) for name in _transformers_logger_names()]
    for each in loggers:
        each.addFilter(rewrite)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(rewrite)


def _transformers_logger_names() -> list[str]:
    """``transformers`` and each of its loggers made so far (a filter is a logger's own:
    a record is filtered by the logger that writes it, not by its parents)."""
    made = logging.Logger.manager.loggerDict
    return ["transformers", *(n for n in made if n.startswith("transformers."))]
