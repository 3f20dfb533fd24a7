"""Four switches of transformers' ``TrainingArguments`` on the HF dialect, each run beside
transformers' own Trainer with the same arguments, data and starting weights:
``eval_on_start``, ``include_num_input_tokens_seen``, ``gradient_checkpointing`` and
``auto_find_batch_size`` (and ``torch_compile``, which transformers' arguments spell with
a backend)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hookloop.compat import hf  # noqa: E402
from test_hf_training_differential import (  # noqa: E402
    BASE,
    RegressionDataset,
    RegressionModel,
    gpt2,
    one_thread,  # noqa: F401 - the module's autouse fixture: tiny models, one thread
    token_rows,
    tokenizer,
)

FACTORIES = {"hf": transformers.Trainer, "hookloop": hf.Trainer}
TIMING = ("runtime", "per_second")


class Recorder(transformers.TrainerCallback):
    """``(event, global_step)`` of the events the switches touch."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.seen.append(("train_begin", state.global_step))

    def on_evaluate(self, args, state, control, **kwargs):
        self.seen.append(("evaluate", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(("step_end", state.global_step))


def lm_run(kind: str, out: Path, model: Any = gpt2, **overrides: Any) -> tuple[Any, Any, Recorder]:
    """A causal LM trained by ``kind``'s Trainer: the trainer, train()'s output and the
    recorded events."""
    settings = {**BASE, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 4,
                "max_steps": 4, **overrides}  # fmt: skip
    recorder = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(output_dir=str(out), **settings)
        trainer = FACTORIES[kind](
            model(),
            args,
            train_dataset=[{"input_ids": r} for r in token_rows(24, seed=1)],
            eval_dataset=[{"input_ids": r} for r in token_rows(6, seed=2)],
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
            processing_class=tokenizer(),
            callbacks=[recorder],
        )
        output = trainer.train()
    return trainer, output, recorder


def both(tmp_path: Path, **overrides: Any) -> dict[str, tuple[Any, Any, Recorder]]:
    return {kind: lm_run(kind, tmp_path / kind, **overrides) for kind in FACTORIES}


def untimed(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if not any(t in k for t in TIMING)}


def assert_same_history(ours: Any, theirs: Any) -> None:
    """The same log entries, keys (timings included) and values (timings aside)."""
    assert [sorted(e) for e in ours.state.log_history] == [
        sorted(e) for e in theirs.state.log_history
    ]
    for mine, their in zip(ours.state.log_history, theirs.state.log_history, strict=True):
        assert untimed(mine) == pytest.approx(untimed(their), rel=1e-5)


def saved_state(trainer: Any) -> dict[str, Any]:
    trainer.save_state()
    return json.loads((Path(trainer.args.output_dir) / "trainer_state.json").read_text())


# -- eval_on_start ----------------------------------------------------------------------------


def test_eval_on_start_evaluates_at_step_zero_after_train_begin_as_transformers(tmp_path: Path):
    # the loss falls, so with greater_is_better the start would be the best, were it counted
    runs = both(tmp_path, eval_on_start=True, eval_strategy="steps", eval_steps=2,
                logging_steps=2, save_strategy="steps", save_steps=2,
                metric_for_best_model="eval_loss", greater_is_better=True)  # fmt: skip
    (theirs, _, their_events), (ours, _, our_events) = runs["hf"], runs["hookloop"]
    assert our_events.seen == their_events.seen
    assert their_events.seen[:2] == [("train_begin", 0), ("evaluate", 0)]
    assert_same_history(ours, theirs)
    first = ours.state.log_history[0]
    assert first["step"] == 0 and "eval_loss" in first
    # the evaluation at the start is not a best metric: the best is training's
    assert ours.state.best_global_step == theirs.state.best_global_step != 0
    assert ours.state.best_metric == pytest.approx(theirs.state.best_metric, rel=1e-5)
    mine, their = saved_state(ours)["log_history"], saved_state(theirs)["log_history"]
    assert len(mine) == len(their)
    for a, b in zip(mine, their, strict=True):
        assert untimed(a) == pytest.approx(untimed(b), rel=1e-5)


# -- include_num_input_tokens_seen ------------------------------------------------------------


@pytest.mark.parametrize("setting", [True, "non_padding"])
def test_input_tokens_seen_are_counted_and_logged_as_transformers(tmp_path: Path, setting: Any):
    runs = both(tmp_path, include_num_input_tokens_seen=setting, eval_strategy="steps",
                eval_steps=2, logging_steps=2, save_strategy="steps", save_steps=2)  # fmt: skip
    (theirs, their_output, _), (ours, our_output, _) = runs["hf"], runs["hookloop"]
    seen = theirs.state.num_input_tokens_seen
    assert seen > 0 and ours.state.num_input_tokens_seen == seen
    assert_same_history(ours, theirs)
    training_log = ours.state.log_history[0]
    assert {"num_input_tokens_seen", "train_runtime", "train_tokens_per_second"} <= set(
        training_log
    )
    assert sorted(our_output.metrics) == sorted(their_output.metrics)
    assert our_output.metrics["num_input_tokens_seen"] == seen
    assert (
        saved_state(ours)["num_input_tokens_seen"] == saved_state(theirs)["num_input_tokens_seen"]
    )
    for kind, trainer in (("hf", theirs), ("hookloop", ours)):  # each checkpoint's state
        folder = tmp_path / kind / "checkpoint-2" / "trainer_state.json"
        at_two = json.loads(folder.read_text())["num_input_tokens_seen"]
        assert at_two == trainer.state.log_history[0]["num_input_tokens_seen"]


def test_input_tokens_seen_go_on_from_a_resumed_checkpoint(tmp_path: Path):
    whole, _, _ = lm_run("hookloop", tmp_path / "whole", include_num_input_tokens_seen="all",
                         save_strategy="steps", save_steps=2)  # fmt: skip
    folder = tmp_path / "whole" / "checkpoint-2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "resumed"), **{**BASE, "per_device_train_batch_size": 2,
            "max_steps": 4, "include_num_input_tokens_seen": "all"},
        )  # fmt: skip
        resumed = hf.Trainer(
            gpt2(), args, train_dataset=[{"input_ids": r} for r in token_rows(24, seed=1)],
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
            processing_class=tokenizer(),
        )  # fmt: skip
        resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.state.num_input_tokens_seen == whole.state.num_input_tokens_seen


# -- gradient checkpointing -----------------------------------------------------------------------


def test_gradient_checkpointing_trains_a_gpt2_as_transformers(tmp_path: Path):
    runs = both(tmp_path, gradient_checkpointing=True, logging_steps=1,
                gradient_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
    (theirs, _, _), (ours, _, _) = runs["hf"], runs["hookloop"]
    assert ours.model.is_gradient_checkpointing and theirs.model.is_gradient_checkpointing
    assert_same_history(ours, theirs)
    for name, value in ours.model.state_dict().items():
        torch.testing.assert_close(value, theirs.model.state_dict()[name], msg=name)


def test_gradient_checkpointing_of_a_plain_module_is_refused_by_name(tmp_path: Path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **BASE, max_steps=1,
                                          gradient_checkpointing=True)  # fmt: skip
    with pytest.raises(ValueError, match="gradient_checkpointing") as caught:
        hf.Trainer(RegressionModel(), args, train_dataset=RegressionDataset(8))
    assert "\n" not in str(caught.value) and "RegressionModel" in str(caught.value)


# -- auto_find_batch_size ----------------------------------------------------------------------


class Hungry(transformers.GPT2LMHeadModel):
    """A GPT-2 that runs out of memory on a training batch larger than 5 (in evaluation,
    with ``eval_limit``, on a batch larger than that)."""

    limit, eval_limit = 5, 100

    def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
        limit = self.limit if self.training else self.eval_limit
        if input_ids.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(input_ids=input_ids, **kwargs)


def hungry() -> Hungry:
    model = gpt2()
    copy = Hungry(model.config)
    copy.load_state_dict(model.state_dict())
    return copy


def test_auto_find_batch_size_starts_over_with_the_batch_transformers_finds(tmp_path: Path):
    runs = {
        kind: lm_run(
            kind,
            tmp_path / kind,
            model=hungry,
            auto_find_batch_size=True,
            per_device_train_batch_size=6,
            logging_steps=1,
        )
        for kind in FACTORIES
    }
    (theirs, their_output, their_events) = runs["hf"]
    (ours, our_output, our_events) = runs["hookloop"]
    # 6, then 90% of it: 5 (halving would have given 3)
    assert theirs.state.train_batch_size == ours.state.train_batch_size == 5
    assert ours.args.per_device_train_batch_size == 6  # the arguments stay as given
    assert our_events.seen == their_events.seen  # on_train_begin at each start
    assert their_events.seen.count(("train_begin", 0)) == 2
    assert_same_history(ours, theirs)  # one run's history: the last start's
    assert saved_state(ours)["train_batch_size"] == saved_state(theirs)["train_batch_size"]
    assert our_output.global_step == their_output.global_step == 4


def test_an_evaluation_out_of_memory_does_not_shrink_the_training_batch(tmp_path: Path):
    class HungryInEvaluation(Hungry):
        limit, eval_limit = 100, 1

    def model() -> Any:
        made = HungryInEvaluation(gpt2().config)
        made.load_state_dict(gpt2().state_dict())
        return made

    for kind in FACTORIES:
        with pytest.raises(RuntimeError, match="per_device_eval_batch_size") as caught:
            lm_run(kind, tmp_path / kind, model=model, auto_find_batch_size=True,
                   eval_strategy="steps", eval_steps=1)  # fmt: skip
        assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


# -- torch_compile ---------------------------------------------------------------------------------


def test_torch_compile_in_transformers_arguments_is_the_loops_compile(tmp_path: Path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **BASE, max_steps=1,
                                          torch_compile=True)  # fmt: skip
    assert args.torch_compile_backend == "inductor"  # what transformers sets with it
    trainer = hf.Trainer(RegressionModel(), args, train_dataset=RegressionDataset(8))
    assert trainer.config.train.compile is True
    other = transformers.TrainingArguments(output_dir=str(tmp_path), **BASE, max_steps=1,
                                           torch_compile_backend="eager")  # fmt: skip
    with pytest.raises(ValueError, match="torch_compile_backend='eager'"):
        hf.Trainer(RegressionModel(), other, train_dataset=RegressionDataset(8))


def test_auto_find_batch_size_resumes_with_the_batch_the_checkpoint_records(tmp_path: Path):
    settings = {"auto_find_batch_size": True, "per_device_train_batch_size": 6,
                "logging_steps": 1, "save_strategy": "steps", "save_steps": 2}  # fmt: skip
    resumed = {}
    for kind in FACTORIES:
        first, _, _ = lm_run(kind, tmp_path / kind, model=hungry, **settings)
        assert first.state.train_batch_size == 5
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path / f"{kind}-again"),
                **{**BASE, "max_steps": 4, **settings},
            )
            recorder = Recorder()
            trainer = FACTORIES[kind](
                hungry(), args, train_dataset=[{"input_ids": r} for r in token_rows(24, seed=1)],
                data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
                processing_class=tokenizer(), callbacks=[recorder],
            )  # fmt: skip
            trainer.train(resume_from_checkpoint=str(tmp_path / kind / "checkpoint-2"))
        resumed[kind] = trainer, recorder
    (theirs, their_events), (ours, our_events) = resumed["hf"], resumed["hookloop"]
    assert our_events.seen == their_events.seen
    assert [e for e, _ in their_events.seen].count("train_begin") == 1  # no out-of-memory
    assert ours.state.train_batch_size == theirs.state.train_batch_size == 5
    assert_same_history(ours, theirs)
