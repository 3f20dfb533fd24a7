"""Forgather's ``TextgenCallback``: sampled continuations of prompts, written to TensorBoard."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookloop.compat.forgather.callbacks.common import check_positive_int, check_writer
from hookloop.compat.forgather.events import answers_transformers_events
from hookloop.compat.hf.callback import TrainerCallback

__all__ = ["DEFAULT_GENERATION", "TextgenCallback"]


def _forgather_prompts(prompts: Any) -> Any:
    """``prompts`` checked as Forgather checks them, with its messages: a list of strings,
    or the path of a YAML file holding one."""
    if isinstance(prompts, os.PathLike):
        prompts = str(prompts)
    if isinstance(prompts, str) and Path(prompts).is_file():
        import yaml

        loaded = yaml.safe_load(Path(prompts).read_text(encoding="utf-8"))
        if not isinstance(loaded, list):
            raise ValueError(
                f"From file {prompts}, expected 'prompts' to be a list but found {type(loaded)}"
            )
        prompts_list = loaded
    elif isinstance(prompts, list):
        prompts_list = prompts
    elif isinstance(prompts, str):
        return prompts  # not a file: the native loader says so
    else:
        raise ValueError(f"'prompts' must be List[str] | str, found {type(prompts)}")
    for prompt in prompts_list:
        if not isinstance(prompt, str):
            raise ValueError(f"Expected all prompts to be strings, but found {type(prompt)}")
    return prompts_list


#: Forgather's sampling settings when no generation_config is given.
DEFAULT_GENERATION = {
    "do_sample": True,
    "top_k": 20,
    "temperature": 0.7,
    "repetition_penalty": 1.15,
}


@answers_transformers_events
class TextgenCallback(TrainerCallback):
    """Continuations of ``prompts`` in TensorBoard (tag ``eval-text``) at evaluations.

    ``TextgenCallback(summary_writer, prompts, generation_config=None,
    generation_steps=None, max_new_tokens=200)``: ``prompts`` is a list or the
    path of a YAML list; ``generation_config`` holds ``GenerationConfig``
    arguments; generation runs at the first evaluation at or past every
    ``generation_steps`` steps (default: ``args.eval_steps``). A model with
    ``generate`` (a transformers model) is sampled through it with the
    ``processing_class`` tokenizer; any other model through hookloop's own
    sampler (:class:`hookloop.callbacks.TextgenCallback`).
    """

    priority = 60

    def __init__(
        self,
        summary_writer: Any,
        prompts: list[str] | str,
        generation_config: dict[str, Any] | None = None,
        generation_steps: int | None = None,
        max_new_tokens: int = 200,
    ) -> None:
        from hookloop.callbacks.textgen import load_prompts

        self.summary_writer = check_writer("summary_writer", summary_writer, optional=False)
        self.prompts = load_prompts(_forgather_prompts(prompts))
        if generation_config is not None and not isinstance(generation_config, Mapping):
            raise ValueError(
                f"generation_config must be a dict of GenerationConfig arguments or None, "
                f"got {generation_config!r}"
            )
        self.gen_config_args = dict(
            DEFAULT_GENERATION if generation_config is None else generation_config
        )
        self.generation_steps = check_positive_int(
            "generation_steps", generation_steps, optional=True
        )
        self.max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        self.next_gen_step = 0
        self.last_text: str | None = None

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.generation_steps is None:
            self.generation_steps = getattr(args, "eval_steps", None) or state.eval_steps
        if not state.is_world_process_zero or state.global_step < self.next_gen_step:
            return
        self.next_gen_step += self.generation_steps
        model = kwargs.get("model")
        text = "".join(
            s + "\n\n---\n\n" for s in self.generate(model, kwargs.get("processing_class"))
        )
        self.last_text = text
        self.summary_writer.add_text("eval-text", text, global_step=state.global_step)
        self.summary_writer.flush()

    def generate(self, model: Any, tokenizer: Any) -> list[str]:
        """``prompt [START] continuation`` for each prompt."""
        if not callable(getattr(model, "generate", None)):
            return self._native(model)
        if tokenizer is None:
            raise ValueError(
                "TextgenCallback: the model has generate() but the trainer has no "
                "processing_class (tokenizer) to encode the prompts with"
            )
        from transformers import GenerationConfig

        # The tokenizer's special ids, the length cap and the sampling settings; sequences
        # come back in a dict so the prompt can be cut off the decoded text.
        special = {
            f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("eos", "bos", "pad")
        }
        settings = {**special, **self.gen_config_args, "max_new_tokens": self.max_new_tokens}
        config = GenerationConfig(return_dict_in_generate=True, **settings)
        # Left padding: every prompt ends where generation begins.
        encoded = tokenizer(
            list(self.prompts),
            return_tensors="pt",
            padding=True,
            padding_side="left",
            truncation=True,
        )
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                out = model.generate(
                    encoded["input_ids"].to(device),
                    attention_mask=encoded["attention_mask"].to(device),
                    generation_config=config,
                )
        finally:
            model.train(was_training)
        texts = tokenizer.batch_decode(out.sequences, skip_special_tokens=True)
        return [p + " [START] " + t[len(p) + 1 :] for p, t in zip(self.prompts, texts, strict=True)]

    def _native(self, model: Any) -> list[str]:
        from hookloop.callbacks.textgen import TextgenCallback as Native

        top_k = self.gen_config_args.get("top_k")
        sampler = Native(
            self.prompts,
            max_new_tokens=self.max_new_tokens,
            temperature=float(self.gen_config_args.get("temperature", 1.0))
            if self.gen_config_args.get("do_sample", True)
            else 0.0,
            top_k=top_k if isinstance(top_k, int) and top_k > 0 else None,
            print_samples=False,
        )
        return [
            p + " [START] " + t for p, t in zip(self.prompts, sampler.generate(model), strict=True)
        ]
