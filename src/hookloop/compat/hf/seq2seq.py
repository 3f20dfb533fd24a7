"""transformers' ``Seq2SeqTrainer`` on the dialect: evaluation and prediction by
generation.

With ``args.predict_with_generate`` each evaluation or prediction batch is answered by
``model.generate`` (``max_length`` / ``num_beams`` from the call, else from
``args.generation_max_length`` / ``generation_num_beams``), the generated ids padded to
the generation's length with the pad token, as transformers pads them; the labels are
padded alike and the loss is the model's on the batch. ``compute_metrics`` then sees
generated ids, not logits. Without it the Trainer evaluates as the plain one does.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from hookloop.compat.hf.trainer import Trainer

#: transformers' generation length when neither the call nor the model's generation
#: config sets one.
DEFAULT_MAX_LENGTH = 20

#: What transformers 5's ``generate()`` uses for each field a generation config leaves
#: unset. transformers' Seq2SeqTrainer writes them into the model's generation config
#: after each generated batch, so its ``generation_config.json`` lists them all.
GENERATE_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "use_cache": True,
    "early_stopping": False, "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "temperature": 1.0, "top_k": 50, "top_p": 1.0, "typical_p": 1.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "length_penalty": 1.0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
    "num_return_sequences": 1, "output_scores": False, "return_dict_in_generate": False,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4, "assistant_lookbehind": 10, "target_lookbehind": 10,
}  # fmt: skip

#: The key of ``generation_config.json`` saying the config was derived from the model's
#: config (transformers then derives it again at each ``generate()``).
FROM_MODEL_CONFIG = "_from_model_config"

#: Inputs that steer the decoder in training; generation starts the decoder afresh.
_DECODER_INPUTS = ("decoder_input_ids", "decoder_attention_mask")


def _generation_kwargs(args: Any, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the arguments' ``generation_max_length`` / ``generation_num_beams``
    where the call set neither."""
    kwargs = dict(given)
    max_length = getattr(args, "generation_max_length", None)
    if kwargs.get("max_length") is None and kwargs.get("max_new_tokens") is None and max_length:
        kwargs["max_length"] = max_length
    beams = getattr(args, "generation_num_beams", None)
    if kwargs.get("num_beams") is None and beams is not None:
        kwargs["num_beams"] = beams
    return {k: v for k, v in kwargs.items() if not (k in ("num_beams", "max_length") and v is None)}


def load_generation_config(value: Any) -> Any:
    """``args.generation_config`` as a ``GenerationConfig``: a copy of one, or read from a
    file or folder (or a name), checked strictly as transformers checks it."""
    from transformers import GenerationConfig

    if isinstance(value, GenerationConfig):
        config = copy.deepcopy(value)
    else:
        path = Path(value)
        if path.is_file():
            config = GenerationConfig.from_pretrained(path.parent, path.name)
        else:
            config = GenerationConfig.from_pretrained(value)
    config.validate(strict=True)
    return config


def settle_generation_config(config: Any) -> None:
    """``config`` as transformers' Seq2SeqTrainer leaves the model's generation config
    after a generated batch: no longer marked as derived from the model's config, and
    each field left unset holding ``generate()``'s default (:data:`GENERATE_DEFAULTS`)."""
    if config.to_dict().get(FROM_MODEL_CONFIG):
        config.update(**{FROM_MODEL_CONFIG: False})
    config.update(defaults_only=True, **GENERATE_DEFAULTS)


class Seq2SeqTrainer(Trainer):
    """``Seq2SeqTrainer(model, args, ...)``: :class:`Trainer` whose ``evaluate`` and
    ``predict`` take transformers' generation keywords (``max_length``, ``num_beams``,
    any other of ``generate``'s) and, with ``args.predict_with_generate``, generate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gen_kwargs: dict[str, Any] | None = None
        config = getattr(self.args, "generation_config", None)
        if config is not None:
            self.model.generation_config = load_generation_config(config)

    load_generation_config = staticmethod(load_generation_config)

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """The plain ``evaluate``, each batch generated with ``gen_kwargs``."""
        self._gen_kwargs = _generation_kwargs(self.args, gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> Any:
        """The plain ``predict``; the predictions are the generated ids."""
        self._gen_kwargs = _generation_kwargs(self.args, gen_kwargs)
        return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """``(loss, generated ids, labels)`` of one batch with ``predict_with_generate``."""
        if not getattr(self.args, "predict_with_generate", False) or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not gen_kwargs:
            gen_kwargs = _generation_kwargs(self.args, self._gen_kwargs or {})
        generation_inputs = dict(inputs)
        labels = inputs.get("labels")
        decoder_ids = inputs.get("decoder_input_ids")
        if labels is not None and decoder_ids is not None and labels.shape == decoder_ids.shape:
            generation_inputs = {k: v for k, v in inputs.items() if k not in _DECODER_INPUTS}
        generator: Any = self.model
        generated = generator.generate(**generation_inputs, **gen_kwargs)
        settle_generation_config(self.model.generation_config)
        length = self._padded_length()
        generated = self._pad_to(generated, length)
        loss = None
        if labels is not None:
            with torch.no_grad():
                outputs = model(**inputs)
            if self.label_smoother is not None:
                loss = self.label_smoother(outputs, labels).detach().mean()
            else:
                first = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
                loss = first.detach().mean()
        if getattr(self.args, "prediction_loss_only", False):
            return loss, None, None
        return loss, generated, None if labels is None else self._pad_to(labels, length)

    def _padded_length(self) -> tuple[int, int | None]:
        """(max_length, max_new_tokens) of the model's generation config (transformers'
        default length where it sets none): what transformers pads to, whatever the
        call's keywords."""
        config = getattr(self.model, "generation_config", None)
        max_length = getattr(config, "max_length", None)
        return int(max_length or DEFAULT_MAX_LENGTH), getattr(config, "max_new_tokens", None)

    def _pad_to(self, tensor: torch.Tensor, length: tuple[int, int | None]) -> torch.Tensor:
        """``tensor`` right-padded with the pad token to the generation's length (to
        ``max_new_tokens + 1`` when that is what bounds it), as transformers pads."""
        max_length, new_tokens = length
        if tensor.shape[-1] < max_length:
            target = max_length
        elif new_tokens is not None and tensor.shape[-1] < new_tokens + 1:
            target = new_tokens + 1
        else:
            return tensor
        padded = torch.full(
            (tensor.shape[0], target),
            self._pad_token_id(),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        padded[:, : tensor.shape[-1]] = tensor
        return padded

    def _pad_token_id(self) -> int:
        tokenizer = self.processing_class
        if tokenizer is not None and hasattr(tokenizer, "pad_token_id"):
            pad = tokenizer.pad_token_id
            return int(pad if pad is not None else tokenizer.eos_token_id)
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        if pad is None:
            raise ValueError(
                "Seq2SeqTrainer pads generated ids with the pad token: give a processing_class "
                "with pad_token_id, or set model.config.pad_token_id"
            )
        return int(pad)
