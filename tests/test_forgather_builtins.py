"""Each of Forgather's built-ins, built as Forgather builds it, in a short HF-dialect training.

Every test constructs the class from ``hookloop.compat.hf`` with Forgather's own
parameter names and runs ``hookloop.compat.hf.Trainer`` (TinyModel, a few
steps, logging every 2 and evaluating every 3 steps), then checks what Forgather
says the callback produces: the files in ``args.logging_dir``, the TensorBoard
tags, the keys in ``logs``, the console lines.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hookloop.callback import Callback
from hookloop.compat.hf import (
    DefaultMetrics,
    DivergenceDetector,
    GradNormLogger,
    InfoCallback,
    JsonLogger,
    ParameterNormLogger,
    PeakMemory,
    ProfilerCallback,
    ProgressCallback,
    ResumableSummaryWriter,
    TBLogger,
    TextgenCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    WeightNormLogger,
)
from hookloop.rundir import RunDir
from hookloop.testing import TinyModel, ToyData

STEPS, LOG_EVERY, EVAL_EVERY = 6, 2, 3


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Logs(TrainerCallback):
    """What ``on_log`` and ``on_evaluate`` receive, in order."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, Any]]] = []
        self.evals: list[tuple[int, dict[str, Any]]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evals.append((state.global_step, dict(metrics)))


def train(tmp_path: Path, callbacks: list[Any], *, model: Any = None, **overrides: Any) -> Trainer:
    """A short HF-dialect run; ``args.logging_dir`` is ``tmp_path / "logs"``."""
    values: dict[str, Any] = dict(
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_steps=STEPS,
        logging_steps=LOG_EVERY,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        save_strategy="no",
        logging_dir=str(tmp_path / "logs"),
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        disable_tqdm=True,  # no default progress display of HF's beside the one under test
    )
    values.update(overrides)
    native = values.pop("native", {})
    trainer = Trainer(
        model if model is not None else TinyModel(),
        TrainingArguments(**values),
        train_dataset=ToyData(n=64),
        eval_dataset=ToyData(n=16, seed=1),
        callbacks=callbacks,
        **({"loss_fn": TinyModel.loss_fn} if model is None else {}),
        **native,
    )
    trainer.train()
    return trainer


def json_array(path: Path) -> list[dict[str, Any]]:
    """The file must be one valid JSON array (it is closed at train end)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(data, list)
    return data


def tb(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_text(acc: Any, tag: str) -> list[tuple[int, str]]:
    return [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")
    ]


def summary_writer(path: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(path))


# -- DefaultMetrics ------------------------------------------------------------------------


def test_default_metrics_puts_mfu_in_every_training_log(tmp_path):
    seen = Logs()
    train(
        tmp_path,
        [DefaultMetrics(peak_hardware_flops=1e9), seen],
        native={"flops_per_sample": 1000.0},
    )
    train_logs = [(s, log) for s, log in seen.logs if "loss" in log]
    assert [s for s, _ in train_logs] == [2, 4, 6]
    for _, log in train_logs:
        assert 0 < log["mfu"] < 1


class PeakList(Callback):
    """A trainer that reports per-rank peaks as ``peak_mem_allocated`` (Forgather's does)."""

    priority = 5  # before DefaultMetrics

    def on_before_log(self, ctx):
        ctx.logs["peak_mem_allocated"] = [1234]


def test_default_metrics_aliases_peak_mem_allocated_as_peak_mem(tmp_path):
    seen = Logs()
    train(tmp_path, [PeakList(), DefaultMetrics(), seen])
    assert all(log["peak_mem"] == [1234] for _, log in seen.logs if "loss" in log)
    assert all("mfu" not in log for _, log in seen.logs)  # no peak_hardware_flops, no MFU


# -- ProgressCallback ----------------------------------------------------------------------


def test_progress_prints_a_table_and_the_final_train_runtime_summary(tmp_path):
    out = io.StringIO()
    progress = ProgressCallback(
        use_tqdm=False,
        output_stream=out,
        step_columns={"grad_norm": None},
        final_metrics={"total_flos": None, "train_runtime": {"label": "took", "suffix": " sec"}},
        header_interval=20,
    )
    train(tmp_path, [progress])
    text = out.getvalue()
    rows = [line.split()[0] for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [f"{s}/{STEPS}" for s in (2, 4, 6)]  # step/max_steps, one row per log
    assert "grad_norm" not in text  # erased from the default columns
    summary = [line for line in text.splitlines() if line.startswith("training finished")]
    assert len(summary) == 1
    assert " took " in summary[0] and " sec" in summary[0] and "total FLOPs" not in summary[0]


def test_progress_callback_takes_transformers_constructor_too(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import inspect

    theirs = inspect.signature(transformers.ProgressCallback).parameters
    ours = inspect.signature(ProgressCallback).parameters
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
    train(tmp_path, [ProgressCallback(), ProgressCallback(max_str_len=50)])
    out = capsys.readouterr().out  # Forgather writes to stdout by default
    assert out.count("training finished") == 2


# -- InfoCallback --------------------------------------------------------------------------


def test_info_callback_prints_the_run_summary_on_stdout(tmp_path, capsys):
    train(tmp_path, [InfoCallback(verbose=True)])
    out = capsys.readouterr().out
    params = sum(p.numel() for p in TinyModel().parameters())
    assert "TinyModel" in out and str(params) in out
    assert "parameters.net" in out  # verbose: each top-level submodule


# -- TBLogger and ResumableSummaryWriter ---------------------------------------------------


def test_tb_logger_writes_texts_and_the_configured_scalars(tmp_path):
    writer = summary_writer(tmp_path / "tb")
    logger = TBLogger(
        summary_writer=writer,
        scalars={
            "grad-norm": None,  # a default removed
            "lr-x10": {"source": "learning_rate", "transform": _times10},  # one added
            "eval-loss": {"transform": _times10},  # a default's field changed, source kept
            "eval-runtime": {},  # no source: the tag with '-' read as '_'
        },
        experiment_info={"name": "forgather", "note": "tiny"},
    )
    seen = Logs()
    train(tmp_path, [logger, seen], lr_scheduler_type="constant")  # HF's default decays
    writer.close()
    acc = tb(tmp_path / "tb")
    # Forgather's tags for its default scalars
    assert {"train-loss", "learning-rate", "eval-loss", "eval-perplexity"} <= set(
        acc.Tags()["scalars"]
    )
    assert [e.step for e in acc.Scalars("train-loss")] == [2, 4, 6]
    losses = [log["loss"] for _, log in seen.logs if "loss" in log]
    assert [e.value for e in acc.Scalars("train-loss")] == pytest.approx(losses)
    assert [e.value for e in acc.Scalars("learning-rate")] == pytest.approx([5e-5] * 3)
    evals = [m["eval_loss"] for _, m in seen.evals]
    assert [e.step for e in acc.Scalars("eval-loss")] == [3, 6]
    assert [e.value for e in acc.Scalars("eval-loss")] == pytest.approx([10 * v for v in evals])
    perplexity = [e.value for e in acc.Scalars("eval-perplexity")]
    assert perplexity == pytest.approx([math.exp(v) for v in evals], rel=1e-5)
    assert [e.step for e in acc.Scalars("eval-runtime")] == [3, 6]
    assert [e.value for e in acc.Scalars("lr-x10")] == pytest.approx([5e-4] * 3)
    assert "grad-norm" not in acc.Tags()["scalars"]
    assert "forgather" in tb_text(acc, "experiment")[0][1]
    assert tb_text(acc, "training_info")[0][0] == 0
    [(step, results)] = tb_text(acc, "train_results")
    assert step == STEPS and "train_runtime" in results


def test_tb_logger_takes_forgathers_older_tuple_scalars_and_experiment_keywords(tmp_path):
    writer = summary_writer(tmp_path / "tb")
    logger = TBLogger(
        writer,
        [("loss", "train-loss"), ("eval_loss", "eval-loss-x10", _times10)],
        run="older-config",
    )
    train(tmp_path, [logger])
    writer.close()
    acc = tb(tmp_path / "tb")
    # the list replaces the defaults: only its two tags
    assert set(acc.Tags()["scalars"]) == {"train-loss", "eval-loss-x10"}
    assert "older-config" in tb_text(acc, "experiment")[0][1]


@pytest.mark.parametrize(
    "scalars, why",
    [
        ("loss", "scalars must be a dict"),
        ([("loss",)], "holds \\(metric, tag\\)"),
        ({"x": {"sauce": "loss"}}, "must be None or a dict with source and/or transform"),
        ({"x": {"source": 3}}, "must be a metric name"),
        ({"x": {"transform": "exp"}}, "must be callable"),
    ],
)
def test_tb_logger_names_a_bad_scalars_entry(tmp_path, scalars, why):
    with pytest.raises(ValueError, match=why):
        TBLogger(summary_writer(tmp_path / "tb"), scalars)


def _times10(value: float, metrics: dict[str, Any]) -> float:
    return value * 10


def test_resumable_summary_writer_takes_summary_writer_calls(tmp_path):
    writer = ResumableSummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("custom", 1.5, global_step=3)
    writer.add_text("note", "hello", global_step=4)
    train(tmp_path, [writer, TBLogger(writer)])  # registered, and shared with the logger
    acc = tb(tmp_path / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("custom")] == [(3, 1.5)]
    assert [e.step for e in acc.Scalars("train-loss")] == [2, 4, 6]


def test_resumable_summary_writer_resumes_into_the_checkpointed_runs_directory(tmp_path):
    saves = dict(output_dir=str(tmp_path / "out"), save_strategy="steps", save_steps=4)
    first = ResumableSummaryWriter(str(tmp_path / "tb-1"))
    train(tmp_path, [first, TBLogger(first)], **saves)
    second = ResumableSummaryWriter(str(tmp_path / "tb-2"))
    train(tmp_path, [second, TBLogger(second)], max_steps=8, native={"resume": "auto"}, **saves)
    assert not (tmp_path / "tb-2").exists()
    # the second run continues the first one's event files: one event per logged step
    steps = [e.step for e in tb(tmp_path / "tb-1").Scalars("train-loss")]
    assert steps == [2, 4, 6, 8]


# -- JsonLogger ----------------------------------------------------------------------------


def test_json_logger_writes_a_json_array_of_logs_and_evaluations(tmp_path):
    logger = JsonLogger(experiment="forgather", lr=5e-5)
    train(tmp_path, [logger])
    records = json_array(tmp_path / "logs" / "trainer_logs.json")
    # the keyword arguments are kept, never written: every record is a log or an evaluation
    assert logger.kwargs == {"experiment": "forgather", "lr": 5e-5}
    assert not any("experiment" in r for r in records)
    assert all("loss" in r or "eval_loss" in r or "train_runtime" in r for r in records)
    for r in records:
        assert {"timestamp", "global_step", "epoch"} <= set(r)
    assert [r["global_step"] for r in records if "loss" in r] == [2, 4, 6]
    # an evaluation is written twice, as Forgather does: its log and its on_evaluate
    assert [r["global_step"] for r in records if "eval_loss" in r] == [3, 3, 6, 6]
    assert any("train_runtime" in r for r in records)


def test_json_logger_without_logging_dir_writes_nothing(tmp_path):
    logger = JsonLogger()
    train(tmp_path, [logger], logging_dir=None)
    assert logger.log_path is None and not (tmp_path / "logs").exists()


def test_json_logger_resumed_run_continues_the_same_file(tmp_path):
    out = str(tmp_path / "out")
    first = dict(output_dir=out, save_strategy="steps", save_steps=4)
    train(tmp_path, [JsonLogger()], **first)
    path = tmp_path / "logs" / "trainer_logs.json"
    assert [r["global_step"] for r in json_array(path) if "loss" in r] == [2, 4, 6]
    train(tmp_path, [JsonLogger()], max_steps=8, native={"resume": "auto"}, **first)
    steps = [r["global_step"] for r in json_array(path) if "loss" in r]
    assert steps == [2, 4, 6, 8]  # the records after the step-6 checkpoint's step were replaced


# -- GradNormLogger / ParameterNormLogger --------------------------------------------------


def test_grad_norm_logger_writes_gradient_norms_at_each_evaluation(tmp_path):
    model = TinyModel()
    names = [n for n, _ in model.named_parameters()]
    train(tmp_path, [GradNormLogger()], model=model, native={"loss_fn": TinyModel.loss_fn})
    records = json_array(tmp_path / "logs" / "gradient_norms.json")
    assert [r["global_step"] for r in records] == [3, 6]
    for r in records:
        assert list(r["grad_norms"]) == names
        assert all(math.isfinite(v) and v > 0 for v in r["grad_norms"].values())


class GradsBeforeStep(TrainerCallback):
    """Each parameter's gradient norm just before the optimizer step, computed here."""

    def __init__(self) -> None:
        self.norms: dict[int, dict[str, float]] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1  # HF counts completed steps; this one is under way
        self.norms[step] = {n: float(p.grad.norm()) for n, p in model.named_parameters()}


def test_grad_norm_logger_records_the_gradients_the_optimizer_steps_with(tmp_path):
    seen = GradsBeforeStep()
    train(tmp_path, [GradNormLogger(), seen], max_grad_norm=0.5)  # clipped gradients
    records = json_array(tmp_path / "logs" / "gradient_norms.json")
    for r in records:
        assert r["grad_norms"] == pytest.approx(seen.norms[r["global_step"]], rel=1e-6)
    total = math.sqrt(sum(v * v for v in records[0]["grad_norms"].values()))
    assert total <= 0.5 + 1e-6


def test_parameter_norm_logger_writes_norms_and_spectral_norms_at_each_evaluation(tmp_path):
    model = TinyModel()
    logger = ParameterNormLogger(log_norms=True, log_spectral_norms=True, power_iter_steps=10)
    train(tmp_path, [logger], model=model, native={"loss_fn": TinyModel.loss_fn})
    records = json_array(tmp_path / "logs" / "parameter_norms.json")
    assert [r["global_step"] for r in records] == [3, 6]
    last = records[-1]  # written at step 6, the last step: the final weights
    for name, p in model.named_parameters():
        assert last["norms"][name] == pytest.approx(float(p.detach().norm()), rel=1e-6)
        exact = torch.linalg.matrix_norm(p.detach(), ord=2) if p.dim() == 2 else p.detach().norm()
        assert last["spectral_norms"][name] == pytest.approx(float(exact), rel=1e-3)


def test_norm_log_files_continue_across_a_resume(tmp_path):
    saves = dict(output_dir=str(tmp_path / "out"), save_strategy="steps", save_steps=3)
    train(tmp_path, [ParameterNormLogger(), GradNormLogger()], **saves)
    train(
        tmp_path,
        [ParameterNormLogger(), GradNormLogger()],
        max_steps=9,
        native={"resume": str(RunDir(tmp_path / "out").checkpoints / "step-00000003")},
        **saves,
    )
    # resumed from step 3: the first run's step-6 record is dropped, then written again
    for name in ("parameter_norms.json", "gradient_norms.json"):
        assert [r["global_step"] for r in json_array(tmp_path / "logs" / name)] == [3, 6, 9]


def test_parameter_norm_logger_can_leave_either_part_out(tmp_path):
    train(tmp_path, [ParameterNormLogger(log_spectral_norms=False)])
    records = json_array(tmp_path / "logs" / "parameter_norms.json")
    assert all("norms" in r and "spectral_norms" not in r for r in records)


# -- PeakMemory ----------------------------------------------------------------------------


def test_peak_memory_reads_rank_and_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    memory = PeakMemory(
        summary_writer=None,
        show_details=False,
        do_log=True,
        enable_memory_snapshot=False,
        file_prefix="snap",
    )
    assert (memory.rank, memory.world_size, memory.file_prefix) == (3, 4, "snap")
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK"):
        PeakMemory()


def test_peak_memory_stays_off_for_a_model_on_the_cpu(tmp_path, capsys):
    memory = PeakMemory(summary_writer=summary_writer(tmp_path / "tb"), do_log=True)
    train(tmp_path, [memory])
    assert memory.enabled is False
    assert "CUDA" not in capsys.readouterr().err


# PeakMemory's CUDA path is tested in gpu_tests/ (run on a GPU machine; see the README).


# -- TextgenCallback -----------------------------------------------------------------------


def _tiny_hf_lm() -> tuple[Any, Any]:
    """A one-layer GPT-2 and a byte-level tokenizer built in memory (nothing downloaded)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<eos>", bos_token="<eos>"
    )
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(vocab), n_positions=64, n_embd=16, n_layer=1, n_head=2
    )
    return transformers.GPT2LMHeadModel(config), tokenizer


class TextData(torch.utils.data.Dataset):
    def __init__(self, tokenizer: Any) -> None:
        ids = tokenizer("def add(a, b): return a + b\n" * 4)["input_ids"][:32]
        self.ids = torch.tensor(ids)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "labels": self.ids}


def test_textgen_samples_an_hf_model_with_generate_at_evaluations(tmp_path):
    model, tokenizer = _tiny_hf_lm()
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text("- 'def add'\n- 'return'\n", encoding="utf-8")
    writer = summary_writer(tmp_path / "tb")
    textgen = TextgenCallback(
        summary_writer=writer,
        prompts=str(prompts),
        generation_config={"do_sample": False},
        generation_steps=None,  # every eval_steps
        max_new_tokens=5,
    )
    args = TrainingArguments(
        per_device_train_batch_size=4,
        max_steps=STEPS,
        logging_steps=LOG_EVERY,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        save_strategy="no",
        use_cpu=True,
        output_dir=str(tmp_path / "out"),
    )
    data = TextData(tokenizer)
    Trainer(
        model,
        args,
        train_dataset=data,
        eval_dataset=data,
        callbacks=[textgen],
        processing_class=tokenizer,
    ).train()
    writer.close()
    texts = tb_text(tb(tmp_path / "tb"), "eval-text")
    assert [step for step, _ in texts] == [3, 6]
    for _, text in texts:
        assert text.count(" [START] ") == 2 and text.startswith("def add [START] ")


def test_textgen_generation_steps_spaces_the_samples(tmp_path):
    writer = summary_writer(tmp_path / "tb")
    textgen = TextgenCallback(writer, ["ab"], None, 6, 3)
    # Only *when* is under test here: the sampler is replaced by a recorder.
    calls: list[Any] = []
    textgen.generate = lambda model, tok: calls.append(model) or ["ab [START] c"]  # type: ignore[method-assign]
    train(tmp_path, [textgen], max_steps=12)
    writer.close()
    # evaluations at 3, 6, 9, 12; a sample at the first at or past 0, 6 and 12
    assert [s for s, _ in tb_text(tb(tmp_path / "tb"), "eval-text")] == [3, 6, 12]
    assert len(calls) == 3 and all(isinstance(m, TinyModel) for m in calls)


# -- DivergenceDetector in Forgather's positional order -------------------------------------


def test_divergence_detector_takes_forgathers_positional_order():
    detector = DivergenceDetector(0.5, None, 1.5, 2, 0, "abort", True, None)
    assert detector.action == "abort"
    assert detector.use_eval_loss is True


def test_forgathers_older_detector_names_are_the_same_class():
    from hookloop.compat.forgather import (
        DualTimeScaleDivergenceDetector,
        DualWindowDivergenceDetector,
    )

    assert DualTimeScaleDivergenceDetector is DivergenceDetector
    assert DualWindowDivergenceDetector is DivergenceDetector


def test_divergence_detector_state_has_forgathers_keys_and_reads_older_ones(tmp_path):
    first = DivergenceDetector(threshold=100.0, warmup=0)
    train(tmp_path, [first])
    state = first.state_dict()
    assert {"smoothed_loss", "best_smoothed_loss", "observation_count", "consecutive_above"} <= set(
        state
    )
    assert state["observation_count"] > 0 and state["smoothed_loss"] >= state["best_smoothed_loss"]
    second = DivergenceDetector()
    second.load_state_dict(  # what Forgather's own detector saves
        {
            "smoothed_loss": 2.5,
            "best_smoothed_loss": 2.0,
            "observation_count": 7,
            "consecutive_above": 1,
        }
    )
    assert second.state_dict() | {"healthy_step": 0} == {
        "smoothed_loss": 2.5, "best_smoothed_loss": 2.0, "observation_count": 7,
        "consecutive_above": 1, "healthy_step": 0}  # fmt: skip
    third = DivergenceDetector()  # a checkpoint hookloop wrote before the keys changed
    third.load_state_dict(
        {"smoothed": 1.0, "best": 0.5, "observations": 3, "consecutive": 0, "healthy_step": 4}
    )
    assert third.state_dict()["observation_count"] == 3
    with pytest.raises(ValueError, match="lacks best_smoothed_loss"):
        DivergenceDetector().load_state_dict({"smoothed_loss": 1.0})


def test_progress_callback_takes_forgathers_older_flags(tmp_path):
    for progress in [
        # positional: use_tqdm, output_stream, show_loss, show_grad_norm
        lambda out: ProgressCallback(False, out, False, False),
        lambda out: ProgressCallback(False, out, show_loss=False, show_grad_norm=False),
    ]:
        out = io.StringIO()
        train(tmp_path, [progress(out)])
        text = out.getvalue()
        header = next(line for line in text.splitlines() if "epoch" in line.split())
        assert "loss" not in header.split() and "grad_norm" not in header.split()
    with pytest.raises(TypeError, match="unexpected keyword argument 'show_lr'"):
        ProgressCallback(show_lr=False)
    with pytest.raises(ValueError, match="show_epoch must be True or False"):
        ProgressCallback(show_epoch="no")
    with pytest.raises(ValueError, match="peak_hardware_flops must be a FLOP/s figure"):
        ProgressCallback(peak_hardware_flops=-1.0)
    with pytest.raises(TypeError, match="multiple values for argument 'show_loss'"):
        ProgressCallback(None, None, True, show_loss=False)


def test_weight_norm_logger_takes_forgathers_older_writer_form(tmp_path):
    from hookloop.compat.forgather import WeightNormLogger

    writer = summary_writer(tmp_path / "tb")
    train(tmp_path, [WeightNormLogger(writer, tag="weights")])
    writer.close()
    events = tb(tmp_path / "tb").Scalars("weights")
    assert [e.step for e in events] == [3, 6]  # at each evaluation, as Forgather's older one
    assert all(e.value > 0 for e in events)
    assert WeightNormLogger().summary_writer is None  # the newer form: into the logs
    with pytest.raises(ValueError, match="tag must be a non-empty TensorBoard tag"):
        WeightNormLogger(writer, tag="")


def test_profiler_writes_forgathers_file_names_and_prints_its_tables(tmp_path, capsys):
    from hookloop.compat.forgather import ProfilerCallback

    profiler = ProfilerCallback(start_step=1, num_steps=2, output_dir=str(tmp_path / "prof"))
    train(tmp_path, [profiler])
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["real_training_rank0.json"]
    out = capsys.readouterr().out
    assert "CPU time summary (steps 2-3)" in out


@pytest.mark.parametrize(
    ("old", "names"),
    [
        ("hookloop.compat.hf.seed004", ["JsonLogger", "ProgressCallback", "DiLoCoCallback"]),
        ("hookloop.compat.hf.seed004_diloco", ["DiLoCoCallback"]),
    ],
)
def test_the_deprecated_module_paths_still_import_and_warn_with_the_new_one(
    old, names, monkeypatch
):
    import importlib
    import sys

    import hookloop.compat.forgather as forgather

    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match="moved to hookloop.compat.forgather") as seen:
        module = importlib.import_module(old)
    (message,) = [str(w.message) for w in seen]
    # the message names the old path and the new one, nothing else of the old naming
    assert message.lower().count("seed") == message.count(old.rsplit(".", 1)[1])
    for name in names:
        assert getattr(module, name) is getattr(forgather, name)


# -- Forgather's messages, and transformers' events called directly ----------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"smoothing": 1.5}, "smoothing must be in (0, 1], got 1.5"),
        ({"threshold": -2}, "threshold must be > 0, got -2"),
        ({"relative_threshold": 0.9}, "relative_threshold must be > 1, got 0.9"),
        ({"threshold": None}, "At least one of threshold or relative_threshold must be set"),
        ({"patience": 0}, "patience must be >= 1, got 0"),
        ({"warmup": -1}, "warmup must be >= 0, got -1"),
    ],
)
def test_divergence_detector_refuses_a_bad_number_with_forgathers_message(kwargs, message):
    with pytest.raises(ValueError) as refused:
        DivergenceDetector(**kwargs)
    assert str(refused.value) == message


def test_progress_callback_refuses_an_unknown_stream_name_with_forgathers_message():
    with pytest.raises(ValueError, match=r"^Must be one of 'stderr' or 'stdout', got 'stdlog'$"):
        ProgressCallback(use_tqdm=False, output_stream="stdlog")


def test_textgen_callback_refuses_bad_prompts_with_forgathers_messages(tmp_path):
    writer = summary_writer(tmp_path / "tb")
    not_a_list = tmp_path / "prompts.yaml"
    not_a_list.write_text("first: def add\n", encoding="utf-8")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("- def add\n- 42\n", encoding="utf-8")
    cases = [
        (("def add",), "'prompts' must be List[str] | str, found <class 'tuple'>"),
        (["def add", None], "Expected all prompts to be strings, but found <class 'NoneType'>"),
        (str(not_a_list), f"From file {not_a_list}, expected 'prompts' to be a list but found "
         "<class 'dict'>"),
        (str(mixed), "Expected all prompts to be strings, but found <class 'int'>"),
    ]  # fmt: skip
    for prompts, message in cases:
        with pytest.raises(ValueError) as refused:
            TextgenCallback(writer, prompts)
        assert str(refused.value) == message
    assert TextgenCallback(writer, ["def add"]).prompts == ["def add"]


def _native_based(tmp_path: Path) -> list[Any]:
    """Forgather's built-ins that are native hookloop callbacks underneath."""
    return [
        DefaultMetrics(),
        ProgressCallback(use_tqdm=False, output_stream=io.StringIO()),
        WeightNormLogger(),
        InfoCallback(),
        DivergenceDetector(),
        ProfilerCallback(output_dir=str(tmp_path / "profiles")),
        ResumableSummaryWriter(log_dir=str(tmp_path / "tb")),
    ]


def test_forgathers_builtins_take_every_event_of_transformers_callback_handler(tmp_path):
    import inspect

    from transformers import TrainingArguments as HfArguments
    from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    callbacks = _native_based(tmp_path)
    handler = CallbackHandler(callbacks, TinyModel(), None, None, None)
    args = HfArguments(output_dir=str(tmp_path / "out"), report_to=[])
    state, control = TrainerState(), TrainerControl()
    events = [name for name in dir(handler) if name.startswith("on_")]
    assert {"on_step_end", "on_log", "on_evaluate", "on_push_begin"} <= set(events)
    for name in events:
        event = getattr(handler, name)
        extra = {}
        if "logs" in inspect.signature(event).parameters:
            extra["logs"] = {"loss": 1.0}
        if "metrics" in inspect.signature(event).parameters:
            extra["metrics"] = {"eval_loss": 1.0}
        event(args, state, control, **extra)
    assert not control.should_training_stop  # a steady loss: no divergence
    # every event method exists on each callback, called the way transformers calls it
    for callback in [*callbacks, JsonLogger(), TBLogger(summary_writer(tmp_path / "tb2"))]:
        for name in events:
            assert getattr(callback, name)(args, state, control) in (None, control), name


def test_divergence_detector_called_as_forgathers_stops_on_the_patience_th_rise():
    from transformers.trainer_callback import TrainerControl, TrainerState

    detector = DivergenceDetector(smoothing=1.0, threshold=1.0, patience=2, warmup=0)
    state, control = TrainerState(), TrainerControl()
    stops = []
    for loss in [1.0, 0.5, 2.0, 2.0]:  # best 0.5; 2.0 rises by 1.5 twice
        detector.on_log(None, state, control, logs={"loss": loss})
        stops.append(control.should_training_stop)
    assert stops == [False, False, False, True]
    assert detector.state_dict()["observation_count"] == 4

    watcher = DivergenceDetector(warmup=0, use_eval_loss=True, action="abort")
    control = TrainerControl()
    control.should_abort_without_save = False
    watcher.on_evaluate(None, state, control, metrics={"eval_loss": math.nan})
    assert control.should_training_stop and control.should_abort_without_save
