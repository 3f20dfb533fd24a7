"""The contract of transformers' ``TrainingArguments``, held by the dialect's class.

Each rule transformers' own test module for its arguments checks is restated here and
run on both classes: transformers' (the oracle: if a rule fails there, transformers
changed) and ``hookloop.compat.hf.TrainingArguments``. Then what scripts rely on
beyond construction: ``HfArgumentParser`` round trips, ``to_dict`` / ``to_json_string``,
``Seq2SeqTrainingArguments``, and that a dialect Trainer leaves the arguments as given.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers.debug_utils import DebugOption  # noqa: E402
from transformers.trainer_utils import (  # noqa: E402
    HubStrategy,
    IntervalStrategy,
    SaveStrategy,
    SchedulerType,
)
from transformers.training_args import OptimizerNames  # noqa: E402

from hookloop.compat import hf  # noqa: E402


@pytest.fixture(params=["transformers", "hookloop"])
def Args(request: pytest.FixtureRequest) -> Any:
    return (
        transformers.TrainingArguments if request.param == "transformers" else hf.TrainingArguments
    )


@pytest.fixture(autouse=True)
def _no_kubeflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)


def test_the_dialect_class_is_transformers_class():
    assert issubclass(hf.TrainingArguments, transformers.TrainingArguments)
    assert issubclass(hf.Seq2SeqTrainingArguments, transformers.Seq2SeqTrainingArguments)
    ours = [f.name for f in dataclasses.fields(hf.TrainingArguments)]
    assert ours == [f.name for f in dataclasses.fields(transformers.TrainingArguments)]


# -- output_dir ---------------------------------------------------------------------------
def test_no_output_dir_means_trainer_output(Args):
    assert Args(output_dir=None).output_dir == "trainer_output"


def test_a_given_output_dir_is_kept(Args, tmp_path: Path):
    assert Args(output_dir=str(tmp_path)).output_dir == str(tmp_path)


def test_building_the_arguments_creates_no_directory(Args, tmp_path: Path):
    target = tmp_path / "later"
    args = Args(output_dir=str(target), do_train=True, save_strategy="no", report_to=None)
    args.save_strategy, args.save_steps = "steps", 1
    assert not target.exists()


def test_a_home_relative_output_dir_is_expanded(Args):
    assert Args(output_dir="~/runs/a", report_to=None).output_dir == os.path.expanduser("~/runs/a")


# -- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [1.0, "none", -1, 0])
def test_torch_empty_cache_steps_must_be_a_positive_int(Args, bad: Any):
    with pytest.raises(ValueError):
        Args(torch_empty_cache_steps=bad)


def test_torch_empty_cache_steps_accepts_none_and_positive_ints(Args):
    assert Args(torch_empty_cache_steps=None).torch_empty_cache_steps is None
    assert Args(torch_empty_cache_steps=3).torch_empty_cache_steps == 3


def test_strings_become_transformers_enums(Args):
    args = Args(output_dir="o", eval_strategy="steps", eval_steps=5, logging_strategy="steps",
                save_strategy="epoch", hub_strategy="end", lr_scheduler_type="linear",
                optim="adamw_torch", report_to=None)  # fmt: skip
    assert args.eval_strategy == IntervalStrategy.STEPS
    assert args.logging_strategy == IntervalStrategy.STEPS
    assert args.save_strategy == SaveStrategy.EPOCH
    assert args.hub_strategy == HubStrategy.END
    assert args.lr_scheduler_type == SchedulerType.LINEAR
    assert args.optim == OptimizerNames.ADAMW_TORCH
    with pytest.raises(ValueError):
        Args(output_dir="o", eval_strategy="sometimes", report_to=None)


def test_an_evaluation_strategy_turns_do_eval_on(Args):
    args = Args(output_dir="o", do_eval=False, eval_strategy="steps", eval_steps=4, report_to=None)
    assert args.do_eval is True


def test_eval_steps_default_to_logging_steps(Args):
    assert Args(output_dir="o", eval_strategy="steps", logging_steps=7).eval_steps == 7


def test_step_strategies_need_a_nonzero_interval(Args):
    with pytest.raises(ValueError):
        Args(output_dir="o", eval_strategy="steps", logging_steps=0, report_to=None)
    with pytest.raises(ValueError):
        Args(output_dir="o", logging_strategy="steps", logging_steps=0, report_to=None)


@pytest.mark.parametrize("kind", ["logging", "eval", "save"])
def test_intervals_above_one_must_be_whole(Args, kind: str):
    with pytest.raises(ValueError):
        Args(output_dir="o", **{f"{kind}_strategy": "steps", f"{kind}_steps": 3.5})


def test_intervals_up_to_one_are_fractions_of_the_run(Args):
    assert Args(output_dir="o", logging_strategy="steps", logging_steps=0.25).logging_steps == 0.25


def test_load_best_model_needs_saves_that_line_up_with_evaluations(Args):
    best = {"output_dir": "o", "load_best_model_at_end": True, "eval_strategy": "steps",
            "eval_steps": 6, "report_to": None}  # fmt: skip
    with pytest.raises(ValueError):
        Args(**best, save_strategy="epoch")
    with pytest.raises(ValueError):
        Args(**best, save_strategy="steps", save_steps=9)
    assert Args(**best, save_strategy="steps", save_steps=12).load_best_model_at_end


@pytest.mark.parametrize(
    ("metric", "expected_metric", "greater"),
    [(None, "loss", False), ("eval_loss", "eval_loss", False), ("accuracy", "accuracy", True)],
)
def test_best_model_metric_and_direction_defaults(Args, metric, expected_metric, greater):
    args = Args(output_dir="o", load_best_model_at_end=True, eval_strategy="epoch",
                save_strategy="epoch", metric_for_best_model=metric)  # fmt: skip
    assert (args.metric_for_best_model, args.greater_is_better) == (expected_metric, greater)


def test_fp16_and_bf16_exclude_each_other(Args):
    with pytest.raises(ValueError):
        Args(output_dir="o", fp16=True, bf16=True)
    with pytest.raises(ValueError):
        Args(output_dir="o", fp16_full_eval=True, bf16_full_eval=True)


def test_reduce_on_plateau_needs_evaluations(Args):
    with pytest.raises(ValueError):
        Args(output_dir="o", lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="no")


def test_a_compile_mode_or_backend_turns_torch_compile_on(Args):
    assert Args(output_dir="o", torch_compile_mode="max-autotune").torch_compile
    assert Args(output_dir="o", torch_compile_backend="inductor").torch_compile
    assert Args(output_dir="o", torch_compile=True).torch_compile_backend == "inductor"


@pytest.mark.parametrize(
    ("given", "kept"), [("none", []), (["none"], []), ("tensorboard", ["tensorboard"])]
)
def test_report_to_becomes_a_list(Args, given: Any, kept: list[str]):
    assert Args(output_dir="o", report_to=given).report_to == kept


def test_a_kubeflow_server_adds_kubeflow_reporting_once(Args, monkeypatch):
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "https://example.invalid")
    assert "kubeflow" in Args(output_dir="o", report_to="none").report_to
    assert set(Args(output_dir="o", report_to="tensorboard").report_to) >= {
        "kubeflow",
        "tensorboard",
    }
    assert (
        Args(output_dir="o", report_to=["kubeflow", "tensorboard"]).report_to.count("kubeflow") == 1
    )
    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL")
    assert "kubeflow" not in Args(output_dir="o", report_to="none").report_to


def test_warmup_steps_may_be_zero_or_a_fraction_but_not_negative(Args):
    with pytest.raises(ValueError):
        Args(output_dir="o", warmup_steps=-2)
    assert Args(output_dir="o", warmup_steps=0).warmup_steps == 0
    assert Args(output_dir="o", warmup_steps=0.1).warmup_steps == 0.1


def test_debug_reads_as_a_list_of_options(Args):
    assert Args(output_dir="o", debug="underflow_overflow").debug == [
        DebugOption.UNDERFLOW_OVERFLOW
    ]
    assert Args(output_dir="o", debug=None).debug == []


def test_a_prefetch_factor_needs_workers(Args):
    with pytest.raises(ValueError):
        Args(output_dir="o", dataloader_prefetch_factor=4, dataloader_num_workers=0)
    args = Args(output_dir="o", dataloader_prefetch_factor=4, dataloader_num_workers=1)
    assert args.dataloader_prefetch_factor == 4


def test_use_cpu_turns_pinned_memory_off(Args):
    assert Args(output_dir="o", use_cpu=True).dataloader_pin_memory is False


@pytest.mark.parametrize(("given", "kept"), [(True, "all"), (False, "no")])
def test_include_num_input_tokens_seen_reads_a_bool_as_a_mode(Args, given: bool, kept: str):
    assert (
        Args(output_dir="o", include_num_input_tokens_seen=given).include_num_input_tokens_seen
        == kept
    )


def test_a_json_string_for_a_dict_field_is_parsed(Args):
    args = Args(output_dir="o", lr_scheduler_kwargs='{"num_cycles": 2}')
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}


@pytest.mark.parametrize("name", ["float32", "bfloat16", "complex64", "int8", "uint8", "bool"])
def test_a_dtype_field_of_a_subclass_serialises_as_its_name(Args, name: str, tmp_path: Path):
    @dataclasses.dataclass
    class WithDtype(Args):
        dtype: torch.dtype = torch.float32

    args = WithDtype(output_dir=str(tmp_path), dtype=getattr(torch, name))
    assert args.to_dict()["dtype"] == name
    assert json.loads(args.to_json_string())["dtype"] == name


# -- what scripts rely on beyond the constructor ----------------------------------------
ARGV = ["--output_dir", "out", "--do_train", "--do_eval", "--eval_strategy", "steps",
        "--eval_steps", "3", "--learning_rate", "1e-3", "--lr_scheduler_kwargs",
        '{"num_cycles": 2}', "--include_num_input_tokens_seen", "false", "--report_to",
        "none", "--max_steps", "6", "--use_cpu"]  # fmt: skip


def test_the_argument_parser_reads_a_command_line_as_transformers_does():
    theirs = transformers.HfArgumentParser(transformers.TrainingArguments)
    (expected,) = theirs.parse_args_into_dataclasses(ARGV)
    (ours,) = transformers.HfArgumentParser(hf.TrainingArguments).parse_args_into_dataclasses(ARGV)
    assert type(ours) is hf.TrainingArguments
    assert ours.to_dict() == expected.to_dict()
    assert ours.to_json_string() == expected.to_json_string()
    assert ours.include_num_input_tokens_seen == "no"
    assert ours.lr_scheduler_kwargs == {"num_cycles": 2}


def test_what_scripts_ask_of_the_arguments_is_there():
    args = hf.TrainingArguments(output_dir="o", use_cpu=True, log_level="info")
    assert args.parallel_mode.value == "not_parallel"
    assert args.get_process_log_level() == 20
    with args.main_process_first(desc="tokenising"):
        pass
    assert args.device.type == "cpu"


def test_seq2seq_arguments_carry_the_generation_fields():
    argv = ["--output_dir", "o", "--predict_with_generate", "--generation_max_length", "9",
            "--generation_num_beams", "2"]  # fmt: skip
    parser = transformers.HfArgumentParser(hf.Seq2SeqTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(argv)
    expected = transformers.Seq2SeqTrainingArguments(
        output_dir="o", predict_with_generate=True, generation_max_length=9, generation_num_beams=2
    )
    assert args.to_dict() == expected.to_dict()


def test_the_arguments_convert_to_a_hookloop_config():
    args = hf.TrainingArguments(
        output_dir="o", max_steps=6, logging_steps=2, save_steps=3, eval_strategy="steps",
        eval_steps=3, learning_rate=1e-3,
    )  # fmt: skip
    config = args.to_config()
    assert (config.train.max_steps, config.train.log_every, config.train.eval_every) == (6, 2, 3)
    assert (config.checkpoint.every, config.optimizer.lr) == (3, 1e-3)
    back = hf.TrainingArguments.from_config(config, output_dir="o")
    assert (back.max_steps, back.eval_steps, back.save_steps) == (6, 3, 3)


def test_a_dialect_trainer_leaves_the_arguments_as_given(tmp_path: Path):
    from hookloop.testing import TinyModel, ToyData

    args = hf.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
        report_to="none", save_strategy="no",
    )  # fmt: skip
    before = args.to_dict()
    trainer = hf.Trainer(TinyModel(), args, train_dataset=ToyData(n=16), loss_fn=TinyModel.loss_fn)
    trainer.train()
    assert args.to_dict() == before
    assert args.report_to == []


def test_the_dialect_still_refuses_what_it_does_not_carry_out(tmp_path: Path):
    from hookloop.testing import TinyModel, ToyData

    args = hf.TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True,
                                full_determinism=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"does not carry out full_determinism=True"):
        hf.Trainer(TinyModel(), args, train_dataset=ToyData(n=8), loss_fn=TinyModel.loss_fn)
