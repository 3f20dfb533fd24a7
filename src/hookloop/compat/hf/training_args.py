"""``hookloop.compat.hf.TrainingArguments`` and ``Seq2SeqTrainingArguments``.

Where transformers is installed they are thin subclasses of transformers' own classes:
every field, default, validation, normalisation, property and method is transformers'
(``HfArgumentParser``, ``to_dict``, ``get_process_log_level``, ``main_process_first``
...), so a script that builds them behaves as it does on transformers. The subclasses
add only the two bridges to hookloop's ``Config`` (:meth:`from_config`,
:meth:`to_config`) and accept, as attributes outside the fields, transformers 4.x's
``logging_dir`` (where Forgather's callbacks write) and ``warmup_ratio``. Without
transformers they are the plain dataclasses of :mod:`hookloop.compat.hf.plain_args`.

What the dialect cannot carry out is refused when a Trainer is built from them
(:mod:`hookloop.compat.hf.arguments`), not here: the arguments accept what
transformers' accept. transformers is imported on first use of either name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hookloop.compat.hf.plain_args import PlainTrainingArguments, config_for

if TYPE_CHECKING:
    from hookloop.config import Config


@dataclass
class PlainSeq2SeqTrainingArguments(PlainTrainingArguments):
    """transformers' ``Seq2SeqTrainingArguments`` fields on the plain dataclass."""

    sortish_sampler: bool = False
    predict_with_generate: bool = False
    generation_max_length: int | None = None
    generation_num_beams: int | None = None
    generation_config: Any = None


#: transformers' generation fields, read by :class:`hookloop.compat.hf.Seq2SeqTrainer`.
SEQ2SEQ_FIELDS = ("predict_with_generate", "generation_max_length", "generation_num_beams",
                  "generation_config")  # fmt: skip


def _config_bridges(base: Any) -> dict[str, Any]:
    """The two methods that relate arguments of class ``base`` to a hookloop Config."""

    def from_config(
        cls: type, config: Config, *, output_dir: str | None = None, has_eval_data: bool = True
    ) -> Any:
        """What a hookloop ``Config`` means, under transformers' names."""
        plain = PlainTrainingArguments.from_config(
            config, output_dir=output_dir, has_eval_data=has_eval_data
        )
        names = ("per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "learning_rate", "weight_decay",
                 "max_grad_norm", "num_train_epochs", "max_steps", "logging_strategy",
                 "logging_steps", "eval_strategy", "eval_steps", "save_strategy", "save_steps",
                 "save_total_limit", "metric_for_best_model", "greater_is_better", "seed",
                 "fp16", "bf16")  # fmt: skip
        return cls(output_dir=output_dir, **{name: getattr(plain, name) for name in names})

    def to_config(self: Any, base: Config | None = None) -> Config:
        """A hookloop ``Config`` (a copy of ``base``, or the defaults) that runs these args."""
        return config_for(self, base)

    def __init__(
        self: Any, *args: Any, logging_dir: str | None = None, warmup_ratio: float = 0.0, **kw: Any
    ) -> None:
        self.logging_dir, self.warmup_ratio = logging_dir, warmup_ratio
        base.__init__(self, *args, **kw)

    return {"from_config": classmethod(from_config), "to_config": to_config, "__init__": __init__}


@functools.cache
def _classes() -> tuple[type, type]:
    """(TrainingArguments, Seq2SeqTrainingArguments): transformers' where installed."""
    try:
        import transformers
    except ImportError:
        return PlainTrainingArguments, PlainSeq2SeqTrainingArguments
    doc = "transformers' ``{}``, which a hookloop ``Config`` converts to and from."
    made = []
    for name in ("TrainingArguments", "Seq2SeqTrainingArguments"):
        theirs = getattr(transformers, name)
        namespace = {"__module__": __name__, "__doc__": doc.format(name)}
        made.append(type(name, (theirs,), {**namespace, **_config_bridges(theirs)}))
    return made[0], made[1]


def is_dialect_args(args: Any) -> bool:
    """Whether ``args`` is of this module's classes (where transformers is installed, of
    the subclasses; the plain ones check themselves when built)."""
    return isinstance(args, _classes())


def __getattr__(name: str) -> Any:
    if name == "TrainingArguments":
        return _classes()[0]
    if name == "Seq2SeqTrainingArguments":
        return _classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
