"""Four of transformers' ``TrainingArguments`` switches, carried out as transformers'
Trainer carries them out:

- ``eval_on_start``: one evaluation after ``on_train_begin``, before the first step
  (logged at step 0); it neither steps a metric-driven schedule nor counts towards
  the best metric (:func:`evaluate_at_start`);
- ``include_num_input_tokens_seen`` (``"no"``, ``"all"``, ``"non_padding"``; True and
  False as transformers reads them): every training micro-batch's tokens are counted
  (the elements of the model's ``main_input_name``, or those the attention mask keeps,
  summed over ranks); every log then carries ``num_input_tokens_seen`` and each training
  log also ``train_runtime`` and ``train_tokens_per_second`` (:class:`InputTokens`);
- ``activation_checkpointing`` / ``gradient_checkpointing`` with their ``*_kwargs``:
  the model's own ``activation_checkpointing_enable`` (or the older
  ``gradient_checkpointing_enable``), called at ``train()`` (:func:`enable_checkpointing`);
- ``auto_find_batch_size``: training that runs out of memory starts over from the
  beginning with a smaller per-device batch (:func:`hookloop.batch_finder`'s step, the
  one accelerate takes), the callbacks kept, a fresh ``TrainerState``
  (:func:`shrink_on_out_of_memory`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hookloop.batch_finder import find_executable_batch_size, is_out_of_memory
from hookloop.compat.hf import optim as hf_optim

# transformers' own logger: its verbosity settings (and log_level) govern these messages
logger = logging.getLogger("transformers.trainer")

TOKEN_MODES = ("no", "all", "non_padding")


def connect(loop: Any, session: Any, args: Any, processing_class: Any) -> None:
    """What the switches need of a loop the arguments decide: the token counter, the
    evaluation at the start, and a model that can checkpoint when asked to."""
    check_checkpointing(args, loop.model)
    session.tokens = input_tokens(args, loop.model, processing_class)
    if hf_optim.arg(args, "eval_on_start", False):
        session.evaluate_at_start = functools.partial(evaluate_at_start, loop, session)


# -- include_num_input_tokens_seen --------------------------------------------------------
def token_mode(args: Any) -> str:
    """``include_num_input_tokens_seen`` as transformers 5.x normalises it."""
    value = hf_optim.arg(args, "include_num_input_tokens_seen", "no")
    if isinstance(value, bool) or value is None:
        value = "all" if value else "no"
    if value not in TOKEN_MODES:
        raise ValueError(
            f"include_num_input_tokens_seen must be one of {', '.join(TOKEN_MODES)} (or True/"
            f"False), got {value!r}"
        )
    return str(value)


class InputTokens:
    """The input tokens of the training micro-batches, as transformers counts them.

    Counts stay on the device until read (:meth:`seen`), and are summed over ranks
    once a step (:meth:`end_step`), where transformers gathers them each micro-batch."""

    def __init__(self, mode: str, main_input_name: str, pad_token_id: int | None) -> None:
        self.mode, self.main, self.pad_token_id = mode, main_input_name, pad_token_id
        self.total = 0  # read back to the host
        self.at_train_start = 0  # the count when this train() began (its tokens per second)
        self.step_count: Any = 0  # this step's, on the device
        self.pending: list[Any] = []  # steps' counts not yet read back
        self.warned: set[str] = set()

    def count(self, inputs: Mapping[str, Any]) -> None:
        """One micro-batch's tokens."""
        if self.main not in inputs:
            self.warn_once(
                "missing",
                "Tried to track the number of tokens seen, but the model's main input "
                f"({self.main!r}) is not in the batch; give the model a main_input_name "
                "attribute naming its input",
            )
            return
        ids = inputs[self.main]
        if self.mode == "non_padding" and "attention_mask" in inputs:
            tokens = inputs["attention_mask"].sum()
        elif self.mode == "non_padding" and self.pad_token_id is not None:
            tokens = (ids != self.pad_token_id).sum()
        else:
            if self.mode == "non_padding":
                self.warn_once(
                    "padding",
                    "No attention mask and no pad token: counting all tokens as non-padding",
                )
            tokens = ids.numel()
        self.step_count = self.step_count + tokens

    def end_step(self) -> None:
        """The step's count, summed over ranks (every rank runs the same steps)."""
        count = self.step_count
        self.step_count = 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            count = torch.as_tensor(count, dtype=torch.int64, device=_device_of(count))
            torch.distributed.all_reduce(count)
        self.pending.append(count)

    def seen(self) -> int:
        """All tokens counted so far (one host read for what is pending)."""
        if self.pending:
            self.total += int(sum(int(c) for c in self.pending))
            self.pending.clear()
        return self.total

    def restore(self, total: int) -> None:
        self.total, self.pending, self.step_count = int(total), [], 0

    def add_to_log(self, logs: dict[str, Any], *, started: float | None = None) -> None:
        """transformers' ``log()``: ``num_input_tokens_seen``, and for a training log
        (``started``: when this train() began, on ``time.monotonic``) the runtime and
        the tokens per second of this train()."""
        logs["num_input_tokens_seen"] = seen = self.seen()
        if started is None:
            return
        runtime = time.monotonic() - started
        logs["train_runtime"] = round(runtime, 4)
        if runtime > 0:
            logs["train_tokens_per_second"] = round((seen - self.at_train_start) / runtime, 3)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message)


def _device_of(count: Any) -> Any:
    if isinstance(count, torch.Tensor):
        return count.device
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"


def input_tokens(args: Any, model: torch.nn.Module, processing_class: Any) -> InputTokens | None:
    """The counter ``include_num_input_tokens_seen`` asks for (None: ``"no"``)."""
    mode = token_mode(args)
    if mode == "no":
        return None
    main = getattr(model, "main_input_name", "input_ids")
    return InputTokens(mode, main, getattr(processing_class, "pad_token_id", None))


# -- eval_on_start ----------------------------------------------------------------------------
def evaluate_at_start(loop: Any, session: Any) -> None:
    """transformers' ``eval_on_start``: the evaluation it runs after ``on_train_begin``
    (not a best metric, no schedule step)."""
    session.evaluating_at_start = True
    try:
        loop.evaluate()
    finally:
        session.evaluating_at_start = False
    loop.model.train()


# -- activation (gradient) checkpointing --------------------------------------------------------
def checkpointing_asked(args: Any) -> bool:
    """``activation_checkpointing``, or its older name ``gradient_checkpointing``."""
    return bool(
        hf_optim.arg(args, "activation_checkpointing", None)
        or hf_optim.arg(args, "gradient_checkpointing", None)
    )


def check_checkpointing(args: Any, model: torch.nn.Module) -> None:
    """Refuse checkpointing for a model that cannot switch it on itself."""
    if not checkpointing_asked(args):
        return
    if not any(hasattr(model, name) for name in _ENABLERS):
        raise ValueError(
            "gradient_checkpointing (activation_checkpointing) needs a model with "
            f"activation_checkpointing_enable() (a PreTrainedModel); {type(model).__name__} "
            "has none: leave it False"
        )


_ENABLERS = ("activation_checkpointing_enable", "gradient_checkpointing_enable")


def enable_checkpointing(args: Any, model: torch.nn.Module) -> None:
    """The model's own checkpointing with the arguments' keywords, as transformers'
    ``train()`` switches it on (``every_n_layers`` and ``offload`` as the model's)."""
    if not checkpointing_asked(args):
        return
    check_checkpointing(args, model)
    options = dict(
        hf_optim.arg(args, "activation_checkpointing_kwargs", None)
        or hf_optim.arg(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    every_n_layers, offload = options.pop("every_n_layers", 1), options.pop("offload", False)
    enable: Any
    if hasattr(model, "activation_checkpointing_enable"):
        enable = model.activation_checkpointing_enable
        enable(activation_checkpointing_kwargs=options or None, every_n_layers=every_n_layers,
               offload=offload)  # fmt: skip
    else:
        enable = model.gradient_checkpointing_enable
        enable(gradient_checkpointing_kwargs=options or None, every_n_layers=every_n_layers,
               offload=offload)  # fmt: skip


# -- auto_find_batch_size -----------------------------------------------------------------------
def shrink_on_out_of_memory(
    attempt: Callable[[int], Any], args: Any, starting_batch_size: int
) -> Any:
    """``attempt(batch_size)``, and with ``auto_find_batch_size`` again from the start
    with a smaller batch each time it runs out of memory."""
    if not hf_optim.arg(args, "auto_find_batch_size", False):
        return attempt(starting_batch_size)
    return find_executable_batch_size(attempt, starting_batch_size)


def refuse_evaluation_out_of_memory(args: Any, error: BaseException) -> None:
    """As transformers: an evaluation in training that runs out of memory is not a
    reason to shrink the training batch; it is raised as an error of its own."""
    if hf_optim.arg(args, "auto_find_batch_size", False) and is_out_of_memory(error):
        raise RuntimeError(
            "Evaluation ran out of memory; auto_find_batch_size shrinks only the training "
            "batch: lower per_device_eval_batch_size"
        ) from error
