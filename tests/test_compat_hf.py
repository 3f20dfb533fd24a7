"""The HF dialect (transformers' Trainer, Forgather): real ``transformers`` callbacks on the loop.

``transformers`` is a test extra: the tests that use its callbacks skip without it.
"""

from __future__ import annotations

import doctest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from _golden import golden_run_config
from _reference_examples import example
from hookloop import Callback, Config, ExitCode
from hookloop import Trainer as NativeTrainer
from hookloop.compat.hf import (
    DivergenceDetector,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainingArguments,
    hf_callbacks,
)
from hookloop.compat.hf.plain_args import PlainTrainingArguments
from hookloop.compat.mapping import dialect_event_names
from hookloop.testing import TinyModel, ToyData

HF_EVENTS = dialect_event_names("hf")
COMMON_KWARGS = {
    "model",
    "processing_class",
    "optimizer",
    "lr_scheduler",
    "train_dataloader",
    "eval_dataloader",
    "trainer",
}


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arguments without ``output_dir`` write to ``./trainer_output``, as transformers'."""
    monkeypatch.chdir(tmp_path)


def _transformers():
    return pytest.importorskip("transformers.trainer_callback")


def _args(**fields: Any) -> TrainingArguments:
    """Small CPU runs: batch 4, no logging or saving unless asked."""
    defaults: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "logging_strategy": "no",
        "save_strategy": "no",
        "use_cpu": True,
    }
    return TrainingArguments(**{**defaults, **fields})


def _trainer(callbacks: Any, args: TrainingArguments, **kwargs: Any) -> Trainer:
    kwargs.setdefault("loss_fn", TinyModel.loss_fn)
    return Trainer(TinyModel(), args, train_dataset=ToyData(n=64), callbacks=callbacks, **kwargs)


def scripted_eval_loss(values: list[float]) -> Any:
    """A loss_fn: mean-squared error in training, the next of ``values`` in evaluation."""
    script: Iterator[float] = iter(values)

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return torch.nn.functional.mse_loss(outputs, targets)
        return torch.tensor(next(script))

    return loss_fn


class HFRecorder(TrainerCallback):
    """Records ``(event, global_step)`` and the kwargs of every dialect event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.kwargs: dict[str, dict[str, Any]] = {}


def _recorder_handler(event: str) -> Any:
    def handler(self: HFRecorder, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append((event, state.global_step))
        self.kwargs.setdefault(event, kwargs)

    return handler


for _event in HF_EVENTS:
    setattr(HFRecorder, _event, _recorder_handler(_event))


# -- golden trace --------------------------------------------------------------------

# The run of tests/test_trace.py (16 samples, batch 4, grad_accum 2, 2 epochs, log every
# 2 steps, evaluate every 3 steps and at each epoch end on 2 batches), then test().
# global_step is HF's: steps completed, so one less inside a step than after it.
EXPECTED_HF_TRACE = [
    ("on_init_end", 0),
    ("on_train_begin", 0),
    ("on_epoch_begin", 0),
    ("on_step_begin", 0),
    ("on_forward_backward_begin", 0),
    ("on_forward_backward_end", 0),
    ("on_substep_end", 0),  # not after the last micro-step
    ("on_forward_backward_begin", 0),
    ("on_forward_backward_end", 0),
    ("on_pre_optimizer_step", 0),
    ("on_optimizer_step", 0),
    ("on_step_end", 1),
    ("on_train_metrics", 1),
    ("on_step_begin", 1),
    ("on_forward_backward_begin", 1),
    ("on_forward_backward_end", 1),
    ("on_substep_end", 1),
    ("on_forward_backward_begin", 1),
    ("on_forward_backward_end", 1),
    ("on_pre_optimizer_step", 1),
    ("on_optimizer_step", 1),
    ("on_step_end", 2),
    ("on_train_metrics", 2),
    ("on_log_step", 2),
    ("on_log", 2),
    ("on_prediction_step", 2),  # epoch-end evaluation, before on_epoch_end
    ("on_prediction_step", 2),
    ("on_log", 2),  # evaluation metrics, as HF logs them
    ("on_evaluate", 2),
    ("on_epoch_end", 2),
    ("on_epoch_begin", 2),
    ("on_step_begin", 2),
    ("on_forward_backward_begin", 2),
    ("on_forward_backward_end", 2),
    ("on_substep_end", 2),
    ("on_forward_backward_begin", 2),
    ("on_forward_backward_end", 2),
    ("on_pre_optimizer_step", 2),
    ("on_optimizer_step", 2),
    ("on_step_end", 3),
    ("on_train_metrics", 3),
    ("on_prediction_step", 3),  # eval every 3 steps
    ("on_prediction_step", 3),
    ("on_log", 3),  # evaluation metrics, as HF logs them
    ("on_evaluate", 3),
    ("on_step_begin", 3),
    ("on_forward_backward_begin", 3),
    ("on_forward_backward_end", 3),
    ("on_substep_end", 3),
    ("on_forward_backward_begin", 3),
    ("on_forward_backward_end", 3),
    ("on_pre_optimizer_step", 3),
    ("on_optimizer_step", 3),
    ("on_step_end", 4),
    ("on_train_metrics", 4),
    ("on_log_step", 4),
    ("on_log", 4),
    ("on_prediction_step", 4),
    ("on_prediction_step", 4),
    ("on_log", 4),  # evaluation metrics, as HF logs them
    ("on_evaluate", 4),
    ("on_epoch_end", 4),
    ("on_train_end", 4),
    ("on_prediction_step", 4),  # trainer.test(): each batch, as HF's predict() reports it
    ("on_prediction_step", 4),
    ("on_predict", 4),
]


def test_hf_event_order_matches_the_golden_trace():
    rec = HFRecorder()
    trainer = Trainer(
        TinyModel(),
        train_dataset=ToyData(n=16),
        eval_dataset=ToyData(n=8, seed=1),
        test_dataset=ToyData(n=8, seed=2),
        loss_fn=TinyModel.loss_fn,
        config=golden_run_config(),
        callbacks=[rec],
    )
    trainer.train()
    trainer.test()
    assert rec.events == EXPECTED_HF_TRACE


def test_every_event_fires_with_the_documented_kwargs(tmp_path: Path):
    rec = HFRecorder()
    args = _args(
        gradient_accumulation_steps=2,
        max_steps=2,
        logging_strategy="steps",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        output_dir=str(tmp_path),
    )
    trainer = Trainer(
        TinyModel(),
        args,
        train_dataset=ToyData(n=16),
        eval_dataset=ToyData(n=8, seed=1),
        test_dataset=ToyData(n=8, seed=2),
        loss_fn=TinyModel.loss_fn,
        callbacks=[rec],
    )
    trainer.train()
    trainer.test()

    assert set(rec.kwargs) == set(HF_EVENTS)
    for event, kwargs in rec.kwargs.items():
        assert set(kwargs) >= COMMON_KWARGS, event
        assert kwargs["model"] is trainer.model and kwargs["trainer"] is trainer
    assert set(rec.kwargs["on_evaluate"]["metrics"]) >= {"eval_loss"}
    assert set(rec.kwargs["on_predict"]["metrics"]) >= {"test_loss"}
    assert isinstance(rec.kwargs["on_train_metrics"]["metrics"]["loss"], float)
    assert "loss" in rec.kwargs["on_log"]["logs"]


def test_logs_added_in_on_log_step_reach_on_log_and_the_log_history():
    class Inject(TrainerCallback):
        def on_log_step(self, state, logs, **kwargs):  # Forgather's form of this handler
            logs["custom"] = state.global_step * 10

    class Read(TrainerCallback):
        seen: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(logs["custom"])

    reader = Read()
    trainer = _trainer(
        [reader, Inject()], _args(max_steps=4, logging_strategy="steps", logging_steps=2)
    )
    trainer.train()

    # The logs of steps 2 and 4, then HF's end-of-training summary log (at step 4).
    assert reader.seen == [20, 40, 40]
    assert [entry["custom"] for entry in trainer.hf.state.log_history] == [20, 40, 40]
    assert [entry["step"] for entry in trainer.hf.state.log_history] == [2, 4, 4]
    assert "train_loss" in trainer.hf.state.log_history[-1]


# -- real transformers callbacks -----------------------------------------------------


def test_transformers_early_stopping_stops_when_eval_stops_improving():
    tc = _transformers()
    early = tc.EarlyStoppingCallback(early_stopping_patience=2)
    args = _args(
        max_steps=10, eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss"
    )
    trainer = _trainer(
        [early],
        args,
        eval_dataset=ToyData(n=4, seed=1),
        loss_fn=scripted_eval_loss([1.0, 0.8, 0.9, 0.85, 0.7, 0.6]),
    )
    result = trainer.train()

    # 0.9 and 0.85 do not beat 0.8: the second miss (step 4) stops. Had best_metric been
    # updated before on_evaluate, 0.8 would have counted as a miss and stopped at step 3.
    assert result.step == 4
    assert "EarlyStoppingCallback" in result.stop_reason
    assert (trainer.hf.state.best_metric, trainer.hf.state.best_global_step) == (
        pytest.approx(0.8),
        2,
    )


def test_load_best_model_at_end_restores_the_best_evaluations_weights(tmp_path: Path):
    from safetensors.torch import load_file

    tc = _transformers()
    args = _args(
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="eval_loss",
        load_best_model_at_end=True,
        output_dir=str(tmp_path),
    )
    trainer = _trainer(
        [tc.EarlyStoppingCallback(early_stopping_patience=5)],
        args,
        eval_dataset=ToyData(n=4, seed=1),
        loss_fn=scripted_eval_loss([1.0, 0.8, 0.9, 0.85]),
        out_dir=str(tmp_path),
    )
    trainer.train()

    best = Path(trainer.hf.state.best_model_checkpoint)
    assert trainer.hf.state.best_global_step == 2 and best.name.endswith("2")
    saved = load_file(str(best / "model.safetensors"))
    live = trainer.model.state_dict()
    assert all(torch.equal(live[k], saved[k]) for k in saved)
    final = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))  # HF's layout
    assert not all(torch.equal(live[k], final[k]) for k in final)  # the run did move on


def test_transformers_early_stopping_counter_and_best_metric_survive_resume(tmp_path: Path):
    tc = _transformers()

    def run(max_steps: int, losses: list[float], resume: str | None) -> Any:
        args = _args(
            max_steps=max_steps,
            eval_strategy="steps",
            eval_steps=1,
            metric_for_best_model="eval_loss",
            save_strategy="steps",  # as in HF, a run saves only when its save strategy says so
            save_steps=2,
            restore_callback_states_from_checkpoint=True,  # as in HF, callbacks restore if asked
            output_dir=str(tmp_path),
        )
        early = tc.EarlyStoppingCallback(early_stopping_patience=2)
        trainer = _trainer(
            [early],
            args,
            eval_dataset=ToyData(n=4, seed=1),
            loss_fn=scripted_eval_loss(losses),
            resume=resume,
        )
        return trainer, early, trainer.train()

    _, first, _ = run(2, [1.0, 1.1], resume=None)
    assert first.early_stopping_patience_counter == 1
    trainer, second, result = run(6, [1.2, 0.5, 0.4, 0.3], resume="auto")

    # Restored: counter 1 and best 1.0, so 1.2 at step 3 is the second miss.
    assert result.step == 3
    assert second.early_stopping_patience_counter == 2
    assert trainer.hf.state.best_metric == pytest.approx(1.0)


def test_transformers_printer_callback_prints_each_log(capsys: pytest.CaptureFixture[str]):
    tc = _transformers()
    trainer = _trainer(
        [tc.PrinterCallback()], _args(max_steps=4, logging_strategy="steps", logging_steps=2)
    )
    trainer.pop_callback(tc.ProgressCallback)  # the default display writes the logs too
    trainer.train()

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 3  # steps 2 and 4, then HF's end-of-training summary
    assert all("'loss':" in line and "'epoch':" in line for line in lines[:2])
    assert "'train_loss':" in lines[2] and "'train_runtime':" in lines[2]


def test_transformers_printer_callback_also_prints_evaluation_metrics(
    capsys: pytest.CaptureFixture[str],
):
    tc = _transformers()
    args = _args(
        max_steps=4, logging_strategy="steps", logging_steps=2, eval_strategy="steps", eval_steps=4
    )
    trainer = _trainer([tc.PrinterCallback()], args, eval_dataset=ToyData(n=8, seed=1))
    trainer.pop_callback(tc.ProgressCallback)  # the default display writes the logs too
    trainer.train()
    metrics = next(e for e in trainer.state.log_history if "eval_loss" in e)

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    # Train logs at steps 2 and 4, the evaluation at step 4, the summary, in HF's order.
    assert ["'loss':" in line for line in lines] == [True, True, False, False]
    assert "'train_loss':" in lines[3]
    assert f"'eval_loss': '{metrics['eval_loss']:.4g}'" in lines[2]
    assert "eval_loss" in metrics  # the printer popped from its own copy, not the history


def test_handwritten_transformers_callback_stops_training_at_its_step():
    tc = _transformers()

    class StopAtThree(tc.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                control.should_training_stop = True

    result = _trainer([StopAtThree()], _args(max_steps=10)).train()

    assert (result.step, result.exit_code) == (3, ExitCode.OK)
    assert "StopAtThree" in result.stop_reason


@pytest.mark.parametrize("control_type", ["hookloop", "transformers"])
def test_a_handler_may_return_a_new_control(control_type: str):
    if control_type == "transformers":
        make_control = _transformers().TrainerControl
    else:
        make_control = TrainerControl

    class ReturnsControl(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                return make_control(should_training_stop=True)
            return None

    result = _trainer([ReturnsControl()], _args(max_steps=10)).train()

    assert result.step == 2


# -- control flags -------------------------------------------------------------------


class _SetsFlagAtTwo(TrainerCallback):
    def __init__(self, *flags: str) -> None:
        self.flags = flags

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            for flag in self.flags:
                setattr(control, flag, True)


def _saved_steps(out_dir: Path) -> list[str]:
    return sorted(p.name for p in (out_dir / "checkpoints").glob("step-*"))


def test_abort_without_save_ends_the_run_with_no_checkpoint(tmp_path: Path):
    aborter = _SetsFlagAtTwo("should_training_stop", "should_abort_without_save")
    result = _trainer([aborter], _args(max_steps=10, output_dir=str(tmp_path))).train()

    assert (result.step, result.exit_code) == (2, ExitCode.ABORTED)
    assert _saved_steps(tmp_path) == []


def test_training_stop_saves_only_what_the_save_strategy_asks_for(tmp_path: Path):
    # As transformers: stopping is not a save; with save_strategy="no" nothing is written.
    stopper = _SetsFlagAtTwo("should_training_stop")
    result = _trainer([stopper], _args(max_steps=10, output_dir=str(tmp_path))).train()

    assert (result.step, result.exit_code) == (2, ExitCode.OK)
    assert _saved_steps(tmp_path) == []


def test_should_evaluate_and_should_save_run_at_that_step(tmp_path: Path):
    rec = HFRecorder()
    asker = _SetsFlagAtTwo("should_evaluate", "should_save")
    trainer = _trainer(
        [asker, rec],
        _args(max_steps=3, output_dir=str(tmp_path)),
        eval_dataset=ToyData(n=4, seed=1),
    )
    trainer.train()

    done = [e for e in rec.events if e[0] in ("on_evaluate", "on_save")]
    assert done[:2] == [("on_evaluate", 2), ("on_save", 2)]
    assert "step-00000002" in _saved_steps(tmp_path)


def test_should_epoch_stop_ends_the_epoch_and_training_goes_on():
    rec = HFRecorder()
    result = _trainer([_SetsFlagAtTwo("should_epoch_stop"), rec], _args(max_steps=3)).train()

    assert result.step == 3
    epochs = [e for e in rec.events if e[0] in ("on_epoch_begin", "on_epoch_end")]
    assert epochs == [
        ("on_epoch_begin", 0),
        ("on_epoch_end", 2),
        ("on_epoch_begin", 2),
        ("on_epoch_end", 3),
    ]


# -- mixing with native callbacks ----------------------------------------------------


def test_hf_and_native_callbacks_run_in_registration_order():
    order: list[str] = []

    class HFStep(TrainerCallback):
        def __init__(self, label: str) -> None:
            self.label = label

        def on_step_end(self, args, state, control, **kwargs):
            order.append(self.label)

    class NativeStep(Callback):
        def on_train_step_end(self, ctx):
            order.append("native")

    _trainer([HFStep("first"), NativeStep(), HFStep("last")], _args(max_steps=1)).train()

    assert order == ["first", "native", "last"]


def test_hf_callbacks_work_with_the_native_trainer(capsys: pytest.CaptureFixture[str]):
    tc = _transformers()
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device = "cpu"
    cfg.train.max_steps = 2
    cfg.train.log_every = 1
    trainer = NativeTrainer(
        TinyModel(),
        train_data=ToyData(n=16),
        loss_fn=TinyModel.loss_fn,
        config=cfg,
        callbacks=hf_callbacks([tc.PrinterCallback()]),
    )
    trainer.train()

    assert capsys.readouterr().out.count("'loss':") == 2


def test_args_and_config_translate_both_ways():
    args = _args(max_steps=7, gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=3)
    cfg = args.to_config()
    back = TrainingArguments.from_config(cfg)

    assert (cfg.train.max_steps, cfg.train.grad_accum, cfg.train.eval_every) == (7, 2, 3)
    assert (back.max_steps, back.gradient_accumulation_steps, back.eval_steps) == (7, 2, 3)
    assert back.eval_strategy == "steps"


# -- Forgather's example ---------------------------------------------------------------


def test_forgathers_divergence_detector_example_runs_as_written():
    code = example(
        "forgather_callbacks", ">>> detector = DivergenceDetector(", ">>> trainer.train()"
    )
    built: list[Trainer] = []

    def trainer_for_example(*args: Any, callbacks: list[Any]) -> Trainer:
        # The example writes Trainer(..., callbacks=[detector]): its ``...`` is the
        # Ellipsis object, standing for the model and data, which we supply here.
        assert args == (Ellipsis,)
        trainer = _trainer(
            callbacks,
            _args(max_steps=40, logging_strategy="steps", logging_steps=1),
            loss_fn=_diverging_after(12),
        )
        built.append(trainer)
        return trainer

    namespace = {"DivergenceDetector": DivergenceDetector, "Trainer": trainer_for_example}
    for part in doctest.DocTestParser().get_examples(code):
        exec(part.source, namespace)  # Forgather's example, cut out of its docs at run time

    (trainer,) = built
    assert namespace["trainer"] is trainer
    # The loss jumps at step 13; with patience 3 the third high observation aborts.
    assert trainer.loop.state.step == trainer.state.global_step == 15
    assert trainer.loop.state.stop_reason.startswith("abort")


def _diverging_after(steps: int) -> Any:
    """A loss that stays near 1 for ``steps`` steps, then jumps to 10 (gradients intact)."""
    calls = iter(range(10**6))

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        level = 1.0 if next(calls) < steps else 10.0
        return outputs.sum() * 0 + level

    return loss_fn


# -- clear errors --------------------------------------------------------------------


def test_bad_inputs_raise_errors_that_name_the_problem():
    with pytest.raises(TypeError, match="neither a hookloop Callback nor an HF-style"):
        _trainer([42], _args(max_steps=1))
    with pytest.raises(TypeError, match="class NativeCb"):
        _trainer([type("NativeCb", (Callback,), {})], _args(max_steps=1))
    with pytest.raises(TypeError, match=r"args must be a TrainingArguments"):
        Trainer(TinyModel(), {"max_steps": 1}, train_dataset=ToyData(n=8))
    with pytest.raises(TypeError, match="use train_dataset instead of train_data"):
        Trainer(TinyModel(), _args(), train_data=ToyData(n=8))
    with pytest.raises(ValueError, match="optimizers must be a pair"):
        Trainer(TinyModel(), _args(), train_dataset=ToyData(n=8), optimizers=None)
    with pytest.raises(ValueError, match="eval_strategy must be one of no, steps, epoch"):
        PlainTrainingArguments(eval_strategy="sometimes")


def test_a_handler_returning_something_else_than_a_control_is_named():
    class ReturnsNumber(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return 1

    with pytest.raises(TypeError, match=r"ReturnsNumber\.on_step_end returned int"):
        _trainer([ReturnsNumber()], _args(max_steps=1)).train()


def test_a_handler_that_needs_a_keyword_no_event_passes_is_rejected_when_wrapped():
    class NeedsMetrics(TrainerCallback):
        def on_step_end(self, args, state, control, metrics):
            pass

    with pytest.raises(TypeError, match=r"NeedsMetrics\.on_step_end requires 'metrics'"):
        _trainer([NeedsMetrics()], _args(max_steps=1))


def test_a_misspelt_handler_warns_with_a_suggestion():
    class Typo(TrainerCallback):
        def on_step_ends(self, args, state, control, **kwargs):
            pass

        def on_step_end(self, args, state, control, **kwargs):
            pass

    with pytest.warns(UserWarning, match="Did you mean 'on_step_end'"):
        _trainer([Typo()], _args(max_steps=1))


def test_any_object_with_hf_handler_names_is_an_hf_callback():
    class Plain:  # no base class at all
        steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    plain = Plain()
    _trainer([plain, TrainerCallback()], _args(max_steps=2)).train()

    assert plain.steps == [1, 2]


def test_args_of_another_class_are_read_by_their_hf_names():
    from types import SimpleNamespace

    foreign = SimpleNamespace(
        metric_for_best_model=None,
        max_steps=3,
        per_device_train_batch_size=4,
        logging_strategy="no",
        save_strategy="no",
        use_cpu=True,
    )
    seen: list[Any] = []

    class SeesArgs(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append((args, state.max_steps))

    trainer = Trainer(TinyModel(), foreign, train_dataset=ToyData(n=64), loss_fn=TinyModel.loss_fn)
    trainer.add_callback(SeesArgs)  # a class, instantiated as transformers does
    result = trainer.train()

    assert result.step == 3
    assert seen == [(foreign, 3)]


@pytest.mark.parametrize(
    "schedule",
    [
        {"logging_strategy": "steps", "logging_steps": 3, "logging_first_step": True},
        {"logging_strategy": "epoch"},
    ],
    ids=["steps_and_first_step", "epoch"],
)
def test_will_log_at_step_start_names_the_steps_hf_logs(schedule: dict[str, Any]):
    class WillLog(Callback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_train_step_start(self, ctx: Any) -> None:
            if ctx.state.will_log:
                self.steps.append(ctx.state.step)

    seen = WillLog()
    trainer = Trainer(
        TinyModel(),
        _args(num_train_epochs=2, **schedule),
        train_dataset=ToyData(n=16),
        loss_fn=TinyModel.loss_fn,
        callbacks=[seen],
    )
    trainer.train()

    logged = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert seen.steps == logged and logged  # 16 samples, batch 4: 4 steps an epoch


def test_a_callback_clearing_should_log_suppresses_that_steps_record():
    class NoLogAtFour(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                control.should_log = False

    args = _args(max_steps=6, logging_strategy="steps", logging_steps=2)
    trainer = _trainer([NoLogAtFour()], args)
    trainer.train()

    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [2, 6]


# -- the run TrainingArguments imply (optimizer, schedule, data, metrics, reporting) -----
class PlainRegression:
    """Sized and indexable dicts, not a torch ``Dataset`` (as transformers' test data)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "labels": self.y[i], "note": "not an argument of forward"}


class TupleModel(torch.nn.Module):
    """Returns ``(loss, prediction)``, as many HF-era models do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        y = self.linear(self.norm(x)).squeeze(-1)
        return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


def _hf_run(**fields: Any) -> Trainer:
    args = _args(disable_tqdm=True, **fields)
    return Trainer(
        TupleModel(),
        args,
        train_dataset=PlainRegression(24),
        eval_dataset=PlainRegression(10),
        compute_metrics=lambda p: {"mae": float(abs(p.predictions - p.label_ids).mean())},
    )


def test_a_plain_dataset_of_dicts_is_batched_by_per_device_train_batch_size():
    trainer = _hf_run(num_train_epochs=2)
    output = trainer.train()
    assert output.global_step == 2 * 6  # 24 samples / 4 a batch, not 24 ready-made batches
    global_step, training_loss, metrics = output  # HF's TrainOutput unpacks
    assert (global_step, training_loss) == (12, metrics["train_loss"])
    assert {"train_runtime", "train_loss", "epoch"} <= set(metrics)


def test_the_learning_rate_decays_linearly_by_default_and_is_logged_as_learning_rate():
    trainer = _hf_run(max_steps=8, logging_strategy="steps", logging_steps=2, learning_rate=0.1)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    # The rate each logged step used: 0.1 * (8 - (step - 1)) / 8.
    assert [e["learning_rate"] for e in logs] == pytest.approx([0.0875, 0.0625, 0.0375, 0.0125])
    assert all(set(e) == {"loss", "grad_norm", "learning_rate", "epoch", "step"} for e in logs)


def test_hf_optimizer_does_not_decay_biases_or_norms():
    trainer = _hf_run(max_steps=1, weight_decay=0.1)
    assert trainer.optimizer is None  # as in transformers: made by create_optimizer / train
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decayed, plain = trainer.create_optimizer().param_groups
    assert [names[id(p)] for p in decayed["params"]] == ["linear.weight"]
    assert sorted(names[id(p)] for p in plain["params"]) == [
        "linear.bias",
        "norm.bias",
        "norm.weight",
    ]
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedules_follow_transformers_get_scheduler(kind: str):
    transformers = pytest.importorskip("transformers")
    from hookloop.compat.hf.optim import create_scheduler

    def rates(make: Any) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        scheduler, seen = make(optimizer), []
        for _ in range(20):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    args = _args(lr_scheduler_type=kind, warmup_steps=0.2)
    ours = rates(lambda opt: create_scheduler(opt, args, 20))
    theirs = rates(lambda opt: transformers.get_scheduler(kind, opt, 4, 20))
    assert ours == theirs


def test_compute_metrics_and_metric_key_prefix_name_the_evaluations_keys():
    trainer = _hf_run(max_steps=2)
    trainer.train()
    metrics = trainer.evaluate(metric_key_prefix="dev")
    assert {"dev_loss", "dev_mae"} <= set(metrics)
    # eval_loss is the mean over samples: 10 samples in batches of 4, 4 and 2
    errors = []
    with torch.no_grad():
        for i in range(10):
            sample = PlainRegression(10)[i]
            errors.append(float(trainer.model(sample["x"][None])[0] - sample["labels"]))
    assert metrics["dev_mae"] == pytest.approx(sum(map(abs, errors)) / 10, rel=1e-5)
    assert metrics["dev_loss"] == pytest.approx(sum(e * e for e in errors) / 10, rel=1e-5)


def test_report_to_tensorboard_writes_the_logged_scalars(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hookloop.callbacks.tensorboard import TBLogger

    trainer = _hf_run(
        max_steps=4,
        logging_strategy="steps",
        logging_steps=2,
        output_dir=str(tmp_path),
        report_to="tensorboard",
    )
    assert [type(cb) for cb in trainer.callback_handler.callbacks][1] is TBLogger
    trainer.train()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    assert any(tag.endswith("loss") for tag in acc.Tags()["scalars"])


def test_report_to_maps_names_onto_hookloop_loggers():
    pytest.importorskip("wandb")
    from hookloop.callbacks.wandb_logger import WandbLoggingCallback
    from hookloop.compat.hf.reporting import loggers, normalize

    assert normalize("none") == [] and normalize([]) == []
    made = loggers(_args(report_to=["wandb"], run_name="r1"))
    assert [type(cb) for cb in made] == [WandbLoggingCallback]
    assert set(normalize("all")) == {"tensorboard", "wandb"}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"report_to": "comet_ml"}, "report_to names 'comet_ml'"),
        ({"optim": "lion_32bit"}, "optim must be one of adamw_torch"),
        ({"warmup_ratio": 1.5}, "warmup_ratio must lie in [0, 1)"),
        ({"warmup_steps": -1}, "warmup_steps must be a number >= 0"),
        ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy must be one"),
        ({"adam_epsilon": 0}, "adam_epsilon must be > 0"),
    ],
)
def test_bad_training_fields_name_the_field_and_what_is_allowed(fields: dict, named: str):
    """The plain class refuses them when built; transformers' class (which accepts
    them, as transformers does) when a Trainer is built from it."""
    pattern = named.replace("[", r"\[").replace(")", r"\)")
    plain = {"per_device_train_batch_size": 4, "use_cpu": True, **fields}
    with pytest.raises(ValueError, match=pattern):
        PlainTrainingArguments(**plain)
    if "warmup_ratio" in fields:  # transformers 5 has no such field
        return
    with pytest.raises(ValueError, match=next(iter(fields))):  # transformers' or ours
        Trainer(TinyModel(), _args(max_steps=1, **fields), train_dataset=ToyData(n=8))


def test_bad_evaluate_arguments_are_named():
    trainer = _hf_run(max_steps=1)
    with pytest.raises(ValueError, match="metric_key_prefix must be a non-empty string"):
        trainer.evaluate(metric_key_prefix="")


def test_plain_use_of_the_dialect_does_not_import_transformers(monkeypatch: pytest.MonkeyPatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # any `import transformers` fails
    data = [{"x": [float(i), 1.0, 0.0, 2.0], "labels": float(i)} for i in range(8)]
    args = _args(max_steps=2, disable_tqdm=True, lr_scheduler_type="cosine", warmup_steps=1)
    trainer = Trainer(TupleModel(), args, train_dataset=data, eval_dataset=data)
    assert trainer.train().global_step == 2
    assert "eval_loss" in trainer.evaluate()


def test_transformers_arguments_the_dialect_does_not_reproduce_are_refused():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(
        output_dir="unused", use_cpu=True, report_to="none", ignore_data_skip=True
    )
    with pytest.raises(ValueError, match=r"ignore_data_skip=True; leave them at .*=False"):
        Trainer(TupleModel(), args, train_dataset=PlainRegression(8))


def test_evaluate_returns_the_epoch_as_transformers_does():
    trainer = _hf_run(num_train_epochs=1)
    trainer.train()
    assert trainer.evaluate()["epoch"] == 1.0


@pytest.mark.slow
def test_report_to_wandb_logs_each_record_to_an_offline_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    pytest.importorskip("wandb")
    from hookloop.callbacks.wandb_logger import offline_history

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the dialect's default: offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    trainer = _hf_run(
        max_steps=4,
        logging_strategy="steps",
        logging_steps=2,
        output_dir=str(tmp_path),
        report_to="wandb",
    )
    trainer.train()
    rows = offline_history(tmp_path / "wandb", wait_s=30)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [r["train/loss"] for r in rows if "train/loss" in r] == pytest.approx(
        [e["loss"] for e in logged]
    )


class DictStream(torch.utils.data.IterableDataset):
    """An unsized stream of samples."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        data = PlainRegression(64)
        return iter(data[i] for i in range(len(data)))


def test_a_stream_trains_for_max_steps_and_needs_them():
    assert _hf_run_on(DictStream(), max_steps=5).train().global_step == 5
    expected = r"no length \(a stream\), so TrainingArguments.max_steps must be > 0"
    with pytest.raises(ValueError, match=expected):
        _hf_run_on(DictStream(), num_train_epochs=1)


def _hf_run_on(data: Any, **fields: Any) -> Trainer:
    return Trainer(TupleModel(), _args(disable_tqdm=True, **fields), train_dataset=data)
