"""transformers' Trainer surface on the HF dialect, each case run beside the real
``transformers.Trainer`` with the same arguments, data and starting weights:
what example scripts call after ``train()`` (``save_model``, ``save_state``,
``log_metrics``, ``save_metrics``), the ``compute_loss`` override point and
``compute_loss_func``, ``model_accepts_loss_kwargs``, ``model_init``,
``optimizer_cls_and_kwargs``, HF's positional arguments, and what is refused.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy as np
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


def _args(out: Path, **overrides: Any) -> Any:
    values = {**BASE, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8}
    return transformers.TrainingArguments(output_dir=str(out), **{**values, **overrides})


def _quiet(fn: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _losses(trainer: Any) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _assert_same_run(hf_trainer: Any, ours: Any) -> None:
    """The same logged losses and the same final weights."""
    assert _losses(ours) == pytest.approx(_losses(hf_trainer), rel=1e-5)
    theirs = hf_trainer.model.state_dict()
    for name, value in ours.model.state_dict().items():
        torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-6, msg=name)


# -- after train(): what an example script calls -----------------------------------------


def _example_script(kind: str, out: Path) -> dict[str, Any]:
    """The tail of transformers' run_clm.py: train, then log, save and keep the results."""
    args = _args(out, max_steps=3, per_device_train_batch_size=2)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    trainer = _quiet(
        lambda: FACTORIES[kind](
            gpt2(),
            args,
            train_dataset=[{"input_ids": r} for r in token_rows(12, seed=1)],
            data_collator=collator,
            processing_class=tokenizer(),
        )
    )
    result = _quiet(trainer.train)
    metrics = dict(result.metrics)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.save_model()
        trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_loss": 1.5})
    trainer.save_state()
    return {
        "trainer": trainer,
        "metrics": metrics,
        "printed": printed.getvalue().splitlines(),
        "files": {p.name for p in out.iterdir()},
        "zero": (trainer.is_world_process_zero(), trainer.is_local_process_zero()),
    }


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("scripts")
    return {kind: _example_script(kind, root / kind) for kind in FACTORIES}


def test_save_model_writes_a_folder_from_pretrained_loads_with_the_trained_weights(scripts):
    hf_run, ours = scripts["hf"], scripts["hookloop"]
    written_by_hf = {"config.json", "model.safetensors", "training_args.bin", "tokenizer.json"}
    assert written_by_hf <= hf_run["files"]
    assert hf_run["files"] - {"runs"} <= ours["files"]  # every file transformers writes
    out = Path(ours["trainer"].args.output_dir)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, value in ours["trainer"].model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)
    assert transformers.AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer().get_vocab()
    saved_args = torch.load(out / "training_args.bin", weights_only=False)
    assert saved_args.output_dir == str(out) and saved_args.max_steps == 3


def test_save_metrics_and_log_metrics_match_transformers(scripts):
    hf_run, ours = scripts["hf"], scripts["hookloop"]
    hf_out, out = (Path(r["trainer"].args.output_dir) for r in (hf_run, ours))
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        theirs, mine = (json.loads((d / name).read_text()) for d in (hf_out, out))
        assert sorted(mine) == sorted(theirs), name
        assert (out / name).read_text().startswith("{\n    ")  # HF's indent of 4
    merged = json.loads((out / "all_results.json").read_text())
    assert merged["eval_loss"] == 1.5 and merged["train_loss"] == ours["metrics"]["train_loss"]
    # The printout: a header, then one aligned line per metric, sorted by key.
    assert ours["printed"][0] == hf_run["printed"][0] == "***** train metrics *****"
    keys = [line.split("=")[0].strip() for line in ours["printed"][1:]]
    assert keys == [line.split("=")[0].strip() for line in hf_run["printed"][1:]]
    assert keys == sorted(ours["metrics"])
    assert len({line.index("=") for line in ours["printed"][1:]}) == 1  # aligned
    runtime = next(line for line in ours["printed"] if "train_runtime" in line)
    assert runtime.split("=")[1].strip().startswith("0:00:")  # H:MM:SS.cc
    assert ours["zero"] == hf_run["zero"] == (True, True)


def test_save_state_writes_trainer_state_json_with_transformers_keys(scripts):
    hf_run, ours = scripts["hf"], scripts["hookloop"]
    theirs, mine = (
        json.loads((Path(r["trainer"].args.output_dir) / "trainer_state.json").read_text())
        for r in (hf_run, ours)
    )
    assert mine["global_step"] == theirs["global_step"] == 3
    assert set(theirs) - {"train_batch_size"} <= set(mine)
    losses = [[e["loss"] for e in s["log_history"] if "loss" in e] for s in (theirs, mine)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_save_metrics_refuses_a_damaged_all_results_json_by_name(tmp_path: Path):
    trainer = _quiet(lambda: hf.Trainer(RegressionModel(), _args(tmp_path, max_steps=1)))
    (tmp_path / "all_results.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"all_results\.json is not JSON"):
        trainer.save_metrics("train", {"train_loss": 1.0})
    assert (tmp_path / "all_results.json").read_text() == "{not json"  # left as it was
    with pytest.raises(ValueError, match="split must be"):
        trainer.save_metrics("", {})


# -- the loss ----------------------------------------------------------------------------


def _penalised(base: type) -> type:
    """A subclass of ``base`` whose ``compute_loss`` doubles its parent's loss and adds an
    L1 penalty, calling ``super()`` as a user's override does; it counts its calls."""

    class Penalised(base):  # type: ignore[misc, valid-type]
        calls = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            type(self).calls += 1
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            loss = 2 * loss + 0.01 * sum(p.abs().sum() for p in model.parameters())
            return (loss, outputs) if return_outputs else loss

    return Penalised


def _regression_run(factory: Any, out: Path, **kwargs: Any) -> Any:
    args = kwargs.pop("args", None) or _args(out, max_steps=6, gradient_accumulation_steps=2)
    model = None if "model_init" in kwargs else kwargs.pop("model", None) or RegressionModel()
    trainer = _quiet(
        lambda: factory(
            model,
            args,
            train_dataset=RegressionDataset(40),
            eval_dataset=RegressionDataset(16, seed=7),
            **kwargs,
        )
    )
    _quiet(trainer.train)
    trainer.eval_metrics = _quiet(trainer.evaluate)
    return trainer


def test_a_compute_loss_override_is_called_as_transformers_calls_it(tmp_path: Path):
    penalised = {kind: _penalised(factory) for kind, factory in FACTORIES.items()}
    theirs = _regression_run(penalised["hf"], tmp_path / "hf")
    ours = _regression_run(penalised["hookloop"], tmp_path / "hookloop")
    _assert_same_run(theirs, ours)
    assert ours.eval_metrics["eval_loss"] == pytest.approx(theirs.eval_metrics["eval_loss"])
    # 6 steps x 2 micro-batches, then 2 evaluation batches
    assert penalised["hookloop"].calls == penalised["hf"].calls == 14


def test_compute_loss_func_replaces_the_models_loss_without_dividing_it(tmp_path: Path):
    seen: dict[str, list[Any]] = {"hf": [], "hookloop": []}

    def loss_func(kind: str) -> Any:
        def mse_sum(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
            seen[kind].append(num_items_in_batch)
            return ((outputs[0] - labels) ** 2).sum() / 8  # the group's 8 samples

        return mse_sum

    runs = {
        kind: _regression_run(FACTORIES[kind], tmp_path / kind, compute_loss_func=loss_func(kind))
        for kind in FACTORIES
    }
    _assert_same_run(runs["hf"], runs["hookloop"])
    assert [int(n) for n in seen["hookloop"]] == [int(n) for n in seen["hf"]]


def test_setting_model_accepts_loss_kwargs_false_divides_the_loss_as_transformers(
    tmp_path: Path,
):
    def run(kind: str) -> Any:
        args = _args(tmp_path / kind, max_steps=3, gradient_accumulation_steps=2,
                     per_device_train_batch_size=2)  # fmt: skip
        trainer = _quiet(
            lambda: FACTORIES[kind](
                gpt2(),
                args,
                train_dataset=[{"input_ids": r} for r in token_rows(12, seed=1)],
                data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
            )
        )
        assert trainer.model_accepts_loss_kwargs is True  # GPT-2 takes them
        trainer.model_accepts_loss_kwargs = False
        _quiet(trainer.train)
        return trainer

    theirs, ours = run("hf"), run("hookloop")
    _assert_same_run(theirs, ours)


def _override_points(base: type, calls: list[Any]) -> type:
    """A subclass of ``base`` overriding transformers' documented override points the way
    users do (calling ``super()``, changing what it returns), recording each call."""

    class Custom(base):  # type: ignore[misc, valid-type]
        def create_optimizer(self, model=None):
            calls.append("create_optimizer")
            if self.optimizer is None:
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
            return self.optimizer

        def create_scheduler(self, num_training_steps, optimizer=None):
            calls.append(("create_scheduler", num_training_steps))
            if self.lr_scheduler is None:
                halve = lambda step: 0.5 if step >= num_training_steps // 2 else 1.0  # noqa: E731
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, halve)
            return self.lr_scheduler

        def training_step(self, model, inputs, num_items_in_batch=None):
            calls.append("training_step")
            if len(calls) % 3 == 0:  # every third micro-batch: its own backward, halved
                loss = self.compute_loss(model, inputs) / self.current_gradient_accumulation_steps
                (0.5 * loss).backward()
                return 0.5 * loss.detach()
            return super().training_step(model, inputs, num_items_in_batch)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            calls.append(("prediction_step", prediction_loss_only))
            loss, logits, labels = super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys
            )
            return 2 * loss, (None if logits is None else logits + 1), labels

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            calls.append(("evaluate", ignore_keys))
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
            metrics[f"{metric_key_prefix}_extra"] = 1.0  # after the log: evaluate()'s alone
            return metrics

        def log(self, logs, start_time=None):
            calls.append("log")
            logs["seen_at"] = self.state.global_step
            super().log(logs, start_time)

    return Custom


def test_every_honoured_override_point_is_called_as_transformers_calls_it(tmp_path: Path):
    calls: dict[str, list[Any]] = {kind: [] for kind in FACTORIES}
    runs = {}
    for kind, factory in FACTORIES.items():
        args = _args(tmp_path / kind, max_steps=6, gradient_accumulation_steps=2,
                     logging_steps=2, eval_strategy="steps", eval_steps=3)  # fmt: skip
        trainer = _regression_run(
            _override_points(factory, calls[kind]),
            tmp_path / kind,
            args=args,
            compute_metrics=lambda p: {"mean": float(np.mean(p.predictions))},
            preprocess_logits_for_metrics=lambda logits, labels: logits * 10,
        )
        trainer.predicted = _quiet(lambda t=trainer: t.predict(RegressionDataset(10, seed=5)))
        runs[kind] = trainer
    theirs, ours = runs["hf"], runs["hookloop"]
    assert calls["hookloop"] == calls["hf"]  # the same calls, in the same order
    assert isinstance(ours.optimizer, torch.optim.SGD)
    _assert_same_run(theirs, ours)

    def history(trainer: Any) -> list[dict[str, Any]]:
        return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
                for e in trainer.state.log_history]  # fmt: skip

    assert [sorted(e) for e in history(ours)] == [sorted(e) for e in history(theirs)]
    for mine, their in zip(history(ours), history(theirs), strict=True):
        assert mine == pytest.approx(their, rel=1e-5)
    assert ours.eval_metrics["eval_mean"] == pytest.approx(theirs.eval_metrics["eval_mean"])
    assert ours.eval_metrics["seen_at"] == theirs.eval_metrics["seen_at"] == 6
    assert ours.eval_metrics["eval_extra"] == theirs.eval_metrics["eval_extra"] == 1.0
    np.testing.assert_allclose(ours.predicted.predictions, theirs.predicted.predictions, rtol=1e-5)
    assert ours.predicted.metrics["test_loss"] == pytest.approx(
        theirs.predicted.metrics["test_loss"], rel=1e-5
    )


def test_prediction_loss_only_and_ignore_keys_for_eval_as_in_transformers(tmp_path: Path):
    outcome = {}
    for kind, factory in FACTORIES.items():
        args = _args(tmp_path / kind, max_steps=2, prediction_loss_only=True,
                     eval_strategy="steps", eval_steps=2)  # fmt: skip
        trainer = _quiet(
            lambda f=factory, a=args: f(
                RegressionModel(), a, train_dataset=RegressionDataset(16),
                eval_dataset=RegressionDataset(8, seed=3),
                compute_metrics=lambda p: {"never": 1.0},
            )
        )  # fmt: skip
        _quiet(lambda t=trainer: t.train(ignore_keys_for_eval=["unused"]))
        predicted = _quiet(lambda t=trainer: t.predict(RegressionDataset(6, seed=4)))
        evaluated = [e for e in trainer.state.log_history if "eval_loss" in e]
        outcome[kind] = (predicted.predictions, sorted(predicted.metrics), sorted(evaluated[0]))
    assert outcome["hookloop"] == outcome["hf"]
    assert outcome["hookloop"][0] is None  # the loss only: no predictions, no metrics


def test_batch_eval_metrics_computes_metrics_batch_by_batch_as_transformers(tmp_path: Path):
    def batched() -> Any:
        seen: list[float] = []

        def metrics(pred: Any, compute_result: bool) -> Any:
            predictions, labels = pred  # tensors, one batch
            seen.append(float((predictions - labels).abs().mean()))
            return {"mae": sum(seen) / len(seen), "batches": len(seen)} if compute_result else None

        return metrics

    outcome = {}
    for kind, factory in FACTORIES.items():
        args = _args(tmp_path / kind, batch_eval_metrics=True, per_device_eval_batch_size=4)
        trainer = _quiet(
            lambda f=factory, a=args: f(RegressionModel(), a, compute_metrics=batched(),
                                        preprocess_logits_for_metrics=lambda lg, lb: lg + 1)
        )  # fmt: skip
        evaluated = _quiet(lambda t=trainer: t.evaluate(RegressionDataset(10, seed=2)))
        predicted = _quiet(lambda t=trainer: t.predict(RegressionDataset(10, seed=2)))
        outcome[kind] = (evaluated, predicted)
    (their_eval, theirs), (our_eval, ours) = outcome["hf"], outcome["hookloop"]
    assert our_eval["eval_batches"] == their_eval["eval_batches"] == 3
    assert our_eval["eval_mae"] == pytest.approx(their_eval["eval_mae"], rel=1e-5)
    np.testing.assert_allclose(ours.predictions, theirs.predictions, rtol=1e-5)
    assert ours.metrics["test_mae"] == pytest.approx(theirs.metrics["test_mae"], rel=1e-5)


class CastingRegression(RegressionModel):
    """Takes its inputs in its own dtype (as half-precision evaluation needs)."""

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        dtype = self.head.weight.dtype
        return super().forward(input_x.to(dtype), None if labels is None else labels.to(dtype))


@pytest.mark.parametrize("setting", ["fp16_full_eval", "bf16_full_eval"])
def test_full_half_precision_evaluation_casts_the_model_as_transformers(tmp_path, setting):
    outcome = {}
    for kind, factory in FACTORIES.items():
        args = _args(tmp_path / kind, **{setting: True})
        trainer = _quiet(lambda f=factory, a=args: f(CastingRegression(), a))
        metrics = _quiet(lambda t=trainer: t.evaluate(RegressionDataset(8, seed=2)))
        outcome[kind] = (metrics["eval_loss"], trainer.model.head.weight.dtype)
    assert outcome["hookloop"] == outcome["hf"]
    assert outcome["hf"][1] in (torch.float16, torch.bfloat16)


def test_memory_metrics_carry_transformers_keys(tmp_path: Path):
    keys = {}
    for kind, factory in FACTORIES.items():
        args = _args(tmp_path / kind, max_steps=2, skip_memory_metrics=False)
        trainer = _quiet(
            lambda f=factory, a=args: f(RegressionModel(), a, train_dataset=RegressionDataset(8))
        )
        trained = _quiet(trainer.train).metrics
        evaluated = _quiet(lambda t=trainer: t.evaluate(RegressionDataset(8)))
        predicted = _quiet(lambda t=trainer: t.predict(RegressionDataset(8))).metrics
        logged = trainer.state.log_history[-1]
        keys[kind] = [sorted(k for k in d if "mem" in k)
                      for d in (trained, evaluated, predicted, logged)]  # fmt: skip
    assert keys["hookloop"] == keys["hf"]
    assert (
        "train_mem_cpu_alloc_delta" in keys["hf"][0] and "init_mem_cpu_alloc_delta" in keys["hf"][0]
    )


def test_neftune_noise_trains_as_in_transformers_and_is_removed_after(tmp_path: Path):
    runs = {}
    for kind in FACTORIES:  # one after the other: new arguments reset accelerate's state
        trainer = _lm_trainer(kind, tmp_path / kind, save_strategy="no", max_steps=3,
                              neftune_noise_alpha=5.0)  # fmt: skip
        _quiet(trainer.train)
        assert not trainer.model.get_input_embeddings()._forward_hooks
        runs[kind] = trainer
    _assert_same_run(runs["hf"], runs["hookloop"])
    plain = _lm_trainer("hookloop", tmp_path / "plain", save_strategy="no", max_steps=3)
    _quiet(plain.train)
    assert _losses(plain) != pytest.approx(_losses(runs["hookloop"]), rel=1e-6)  # noise applied


def test_jit_checkpoint_saves_and_stops_when_asked_as_in_transformers(tmp_path: Path):
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    class AskAtStepTwo(transformers.TrainerCallback):  # as a SIGTERM's timer would
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                jit = next(c for c in self.trainer.callback_handler.callbacks
                           if isinstance(c, JITCheckpointCallback))  # fmt: skip
                jit.jit_manager.is_checkpoint_requested = True

    outcome = {}
    for kind, factory in FACTORIES.items():
        ask = AskAtStepTwo()
        args = _args(tmp_path / kind, max_steps=6, enable_jit_checkpoint=True)
        trainer = _quiet(lambda f=factory, a=args, c=ask: f(
            RegressionModel(), a, train_dataset=RegressionDataset(32), callbacks=[c]))  # fmt: skip
        ask.trainer = trainer
        try:
            _quiet(trainer.train)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the callback's handler, put back
        folders = sorted(p.name for p in (tmp_path / kind).glob("checkpoint-*"))
        saved = json.loads((tmp_path / kind / folders[0] / "trainer_state.json").read_text())
        outcome[kind] = (trainer.state.global_step, folders, saved["global_step"])
    # asked at step 2's end, saved at step 3's start (the state after step 2), then stopped
    assert outcome["hookloop"] == outcome["hf"] == (3, ["checkpoint-2"], 2)


def test_a_dict_of_evaluation_datasets_is_evaluated_set_by_set_as_in_transformers(tmp_path):
    outcome = {}
    for kind, factory in FACTORIES.items():
        args = _args(tmp_path / kind, max_steps=4, eval_strategy="steps", eval_steps=2)
        sets = {"near": RegressionDataset(8, seed=3), "far": RegressionDataset(8, seed=4)}
        trainer = _quiet(lambda f=factory, a=args, e=sets: f(
            RegressionModel(), a, train_dataset=RegressionDataset(16), eval_dataset=e))  # fmt: skip
        _quiet(trainer.train)
        evaluated = _quiet(trainer.evaluate)
        loader = trainer.get_eval_dataloader("far")
        outcome[kind] = (_history(trainer), evaluated, loader.dataset is sets["far"],
                         loader.total_batch_size)  # fmt: skip
    (history, evaluated, same, total), theirs = outcome["hookloop"], outcome["hf"]
    assert [sorted(e) for e in history] == [sorted(e) for e in theirs[0]]
    assert sorted(evaluated) == sorted(theirs[1])
    assert evaluated["eval_far_loss"] == pytest.approx(theirs[1]["eval_far_loss"], rel=1e-5)
    assert (same, total) == (theirs[2], theirs[3]) == (True, 8)


def test_optimizer_and_schedule_appear_as_in_transformers(tmp_path: Path):
    seen = {}
    for kind, factory in FACTORIES.items():
        args = _args(tmp_path / kind, max_steps=6, lr_scheduler_type="cosine", warmup_steps=1)
        trainer = _quiet(lambda f=factory, a=args: f(
            RegressionModel(), a, train_dataset=RegressionDataset(24)))  # fmt: skip
        before = (trainer.optimizer, trainer.lr_scheduler)
        trainer.create_optimizer_and_scheduler(num_training_steps=3)  # a schedule to look at
        looked = [trainer.lr_scheduler.lr_lambdas[0](step) for step in range(4)]
        _quiet(trainer.train)  # trains with its own 6-step schedule, as transformers does
        seen[kind] = (before, looked, trainer)
    (before, looked, ours), (their_before, their_looked, theirs) = seen["hookloop"], seen["hf"]
    assert before == their_before == (None, None)
    assert looked == pytest.approx(their_looked)
    _assert_same_run(theirs, ours)
    assert ours.lr_scheduler is not None and ours.optimizer is not None


def test_log_level_governs_transformers_training_summary_on_its_logger(tmp_path: Path):
    import logging

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage().split("=")[0].strip())

    said = {}
    hf_logger = logging.getLogger("transformers.trainer")
    try:
        for kind, factory in FACTORIES.items():
            for level in ("info", "error"):
                args = _args(tmp_path / kind, max_steps=1, log_level=level)
                trainer = _quiet(lambda f=factory, a=args: f(
                    RegressionModel(), a, train_dataset=RegressionDataset(8)))  # fmt: skip
                seen = Lines()
                hf_logger.addHandler(seen)
                try:
                    _quiet(trainer.train)
                finally:
                    hf_logger.removeHandler(seen)
                last = "Number of trainable parameters"  # the summary's end
                lines = seen.lines
                said[kind, level] = lines[: lines.index(last) + 1] if last in lines else lines
    finally:
        logging.getLogger("transformers").setLevel(logging.WARNING)
    assert said["hookloop", "info"] == said["hf", "info"]
    assert said["hf", "info"][0] == "***** Running training *****"
    assert "***** Running training *****" not in said["hookloop", "error"]


def test_label_smoothing_trains_a_causal_lm_as_in_transformers(tmp_path: Path):
    runs = {}
    for kind in FACTORIES:
        trainer = _lm_trainer(kind, tmp_path / kind, save_strategy="no", max_steps=2,
                              label_smoothing_factor=0.1)  # fmt: skip
        _quiet(trainer.train)
        runs[kind] = trainer
    _assert_same_run(runs["hf"], runs["hookloop"])
    plain = _lm_trainer("hookloop", tmp_path / "plain", save_strategy="no", max_steps=2)
    _quiet(plain.train)
    assert _losses(plain) != pytest.approx(_losses(runs["hookloop"]), rel=1e-4)


def test_resuming_with_other_intervals_warns_as_transformers(saved, tmp_path, caplog):
    import logging

    trainer = _lm_trainer("hookloop", tmp_path, save_steps=3, per_device_train_batch_size=3)
    with caplog.at_level(logging.WARNING, logger="transformers.trainer"):
        _quiet(lambda: trainer.train(str(saved["root"] / "hookloop" / "checkpoint-2")))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "save_steps: 3 (from args) != 2 (from trainer_state.json)" in said
    assert "per_device_train_batch_size: 3 (from args) != 2 (from trainer_state.json)" in said


def test_overrides_of_the_hf_step_are_refused_with_a_native_loss(tmp_path: Path):
    custom = _override_points(hf.Trainer, [])
    with pytest.raises(ValueError, match="training_step, prediction_step apply when"):
        custom(RegressionModel(), _args(tmp_path), train_dataset=RegressionDataset(8),
               loss_fn=lambda out, batch: out[0])  # fmt: skip
    with pytest.raises(TypeError, match="preprocess_logits_for_metrics must be a function"):
        hf.Trainer(RegressionModel(), _args(tmp_path), preprocess_logits_for_metrics=3)


def test_callbacks_added_or_removed_by_a_callback_act_in_the_same_dispatch(tmp_path: Path):
    seen: dict[str, list[Any]] = {}

    def recorder(kind: str, name: str) -> Any:
        class Recorder(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                seen[kind].append((name, state.global_step))

        return Recorder()

    def editor(kind: str, removed: Any) -> Any:
        class Editor(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 2:
                    self.trainer.add_callback(recorder(kind, "added"))
                    self.trainer.remove_callback(removed)

        return Editor()

    for kind, factory in FACTORIES.items():
        seen[kind] = []
        removed = recorder(kind, "removed")
        edit = editor(kind, removed)
        trainer = _quiet(
            lambda f=factory, e=edit, r=removed, k=kind: f(
                RegressionModel(), _args(tmp_path / k, max_steps=4),
                train_dataset=RegressionDataset(16), callbacks=[e, r],
            )
        )  # fmt: skip
        edit.trainer = trainer
        _quiet(trainer.train)
    assert seen["hookloop"] == seen["hf"]
    assert ("added", 2) in seen["hf"] and ("removed", 2) not in seen["hf"]


@pytest.mark.parametrize(
    "config",
    [None, {"split_batches": True, "even_batches": False,
            "gradient_accumulation_kwargs": {"num_steps": 3, "sync_each_batch": True}}],
)  # fmt: skip
def test_accelerator_config_is_read_and_trainer_accelerator_reports_it(tmp_path: Path, config):
    seen = {}
    for kind, factory in FACTORIES.items():
        # a copy each: transformers writes num_steps=1 into the dict it was given
        args = _args(tmp_path / kind, accelerator_config=copy.deepcopy(config))
        trainer = _quiet(lambda f=factory, a=args: f(RegressionModel(), a))
        acc = trainer.accelerator
        seen[kind] = (
            acc.split_batches, acc.dispatch_batches, acc.even_batches, acc.use_seedable_sampler,
            acc.gradient_state.plugin_kwargs, trainer.args.gradient_accumulation_steps,
            acc.unwrap_model(trainer.model) is trainer.model, acc.is_main_process,
        )  # fmt: skip
    assert seen["hookloop"] == seen["hf"]


def test_accelerator_config_errors_match_transformers(tmp_path: Path):
    from transformers.trainer_pt_utils import AcceleratorConfig

    for kind, factory in FACTORIES.items():
        with pytest.raises(NotImplementedError, match="Tried passing in a callable"):
            _args(tmp_path, accelerator_config=AcceleratorConfig)
        twice = {"gradient_accumulation_kwargs": {"num_steps": 4}}
        with pytest.raises(ValueError, match="The `AcceleratorConfig`'s `num_steps` is set but"):
            args = _args(tmp_path / kind, gradient_accumulation_steps=2, accelerator_config=twice)
            _quiet(lambda f=factory, a=args: f(RegressionModel(), a))
    with pytest.raises(ValueError, match="does not carry out accelerator_config use_seedable"):
        args = _args(tmp_path, accelerator_config={"use_seedable_sampler": False})
        hf.Trainer(RegressionModel(), args, train_dataset=RegressionDataset(8))


# -- construction --------------------------------------------------------------------------


def test_model_init_and_optimizer_cls_and_kwargs_build_what_transformers_builds(
    tmp_path: Path,
):
    runs = {
        kind: _regression_run(
            FACTORIES[kind],
            tmp_path / kind,
            model_init=RegressionModel,
            optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        )
        for kind in FACTORIES
    }
    _assert_same_run(runs["hf"], runs["hookloop"])
    assert isinstance(runs["hookloop"].optimizer, torch.optim.SGD)
    assert runs["hookloop"].model_init is RegressionModel


def test_transformers_positional_arguments_land_where_they_land_in_transformers(
    tmp_path: Path,
):
    train, evaluation = RegressionDataset(8), RegressionDataset(8, seed=3)
    args = _args(tmp_path, max_steps=1)
    trainer = _quiet(lambda: hf.Trainer(RegressionModel(), args, None, train, evaluation))
    assert trainer.train_dataset is train and trainer.eval_dataset is evaluation
    assert trainer.model_wrapped is trainer.model  # one process: nothing wraps it


@pytest.mark.parametrize(
    "method", ["evaluation_loop", "get_batch_samples", "save_model", "store_flos"]
)
def test_an_override_the_loop_would_skip_is_refused_by_name(tmp_path: Path, method: str):
    subclass = type("Custom", (hf.Trainer,), {method: lambda self, *a, **k: None})
    with pytest.raises(TypeError, match=rf"Custom\.{method} overrides a method"):
        subclass(RegressionModel(), _args(tmp_path, max_steps=1))


def test_resume_from_checkpoint_true_without_one_fails_as_in_transformers(tmp_path: Path):
    messages = []
    for kind, factory in FACTORIES.items():
        out = tmp_path / kind
        trainer = _quiet(
            lambda f=factory, o=out: f(
                RegressionModel(), _args(o, max_steps=1), train_dataset=RegressionDataset(8)
            )
        )
        with pytest.raises(ValueError) as caught:
            trainer.train(resume_from_checkpoint=True)
        messages.append(str(caught.value).replace(str(out), "OUT"))
    assert messages[0] == messages[1] == "No valid checkpoint found in output directory (OUT)"


def test_a_trainer_needs_a_model_or_a_model_init(tmp_path: Path):
    with pytest.raises(RuntimeError, match="needs a model or a model_init"):
        hf.Trainer(None, _args(tmp_path))
    with pytest.raises(ValueError, match="a model or a model_init, not both"):
        hf.Trainer(RegressionModel(), _args(tmp_path), model_init=RegressionModel)


# -- TrainingArguments: honoured, without effect, or refused ---------------------------------


def test_transformers_arguments_the_dialect_would_not_carry_out_are_refused_by_name(
    tmp_path: Path,
):
    args = _args(
        tmp_path,
        max_steps=1,
        ignore_data_skip=True,
        save_only_model=True,
        full_determinism=True,
    )
    with pytest.raises(ValueError) as caught:
        hf.Trainer(RegressionModel(), args, train_dataset=RegressionDataset(8))
    message = str(caught.value)
    for name in (
        "ignore_data_skip",
        "save_only_model",
        "full_determinism",
    ):
        assert f"{name}=" in message
    assert "\n" not in message


def test_arguments_without_effect_are_accepted_and_train_as_transformers(tmp_path: Path):
    settings = {
        "do_train": True,
        "do_eval": True,
        "log_level": "info",
        "dataloader_pin_memory": False,
        "eval_accumulation_steps": 2,
        "torch_empty_cache_steps": 2,
        "ddp_timeout": 60,
        "max_steps": 4,
    }
    runs = {
        kind: _regression_run(
            FACTORIES[kind], tmp_path / kind, args=_args(tmp_path / kind, **settings)
        )
        for kind in FACTORIES
    }
    _assert_same_run(runs["hf"], runs["hookloop"])


def test_every_transformers_argument_is_classified_and_no_name_is_stale():
    import dataclasses

    from hookloop.compat.hf import arguments
    from hookloop.compat.hf.plain_args import PlainTrainingArguments as TrainingArguments

    fields = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    theirs = set(fields)
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    # our dataclass speaks transformers' names (5.x's, and two 4.x ones), all of them
    assert ours - set(arguments.TRANSFORMERS_4_FIELDS) == theirs
    defaults = TrainingArguments()
    for name in arguments.NO_EFFECT.keys() | (
        theirs - arguments.honoured_fields(TrainingArguments)
    ):
        field = fields[name]
        default = field.default if field.default is not dataclasses.MISSING else None
        assert getattr(defaults, name) == getattr(default, "value", default), name
    # each one not carried out is refused by name when set, on our dataclass too
    with pytest.raises(
        ValueError, match=r"does not carry out full_determinism=True, fsdp='full_shard'"
    ):
        hf.Trainer(RegressionModel(), TrainingArguments(full_determinism=True, fsdp="full_shard"))
    assert set(arguments.NO_EFFECT) <= theirs and set(arguments.LOADER_FIELDS) <= theirs
    # HfArgumentParser reads a script's command line into ours as into transformers'
    parser = transformers.HfArgumentParser(TrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "o", "--do_train", "--do_eval", "--max_steps", "3"]
    )
    assert (parsed.do_train, parsed.do_eval, parsed.max_steps) == (True, True, 3)


# -- checkpoint-N folders -----------------------------------------------------------------


def _lm_trainer(kind: str, out: Path, **overrides: Any) -> Any:
    settings = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2,
                "per_device_train_batch_size": 2, **overrides}  # fmt: skip
    return _quiet(
        lambda: FACTORIES[kind](
            gpt2(),
            _args(out, **settings),
            train_dataset=[{"input_ids": r} for r in token_rows(12, seed=1)],
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
            processing_class=tokenizer(),
        )
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("saved")
    runs = {}
    for kind in FACTORIES:
        trainer = _lm_trainer(kind, root / kind)
        _quiet(trainer.train)
        runs[kind] = trainer
    return {"root": root, **runs}


def _step_losses(trainer: Any) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def test_a_checkpoint_folder_holds_transformers_files_and_from_pretrained_loads_it(saved):
    root = saved["root"]
    for step in (2, 4):
        theirs = {p.name for p in (root / "hf" / f"checkpoint-{step}").iterdir()}
        ours = {p.name for p in (root / "hookloop" / f"checkpoint-{step}").iterdir()}
        assert theirs <= ours, theirs - ours
    folder = root / "hookloop" / "checkpoint-2"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(root / "hf" / "checkpoint-2")
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    transformers.TrainerState.load_from_json(str(folder / "trainer_state.json"))


def test_transformers_trainer_resumes_from_a_dialect_checkpoint(saved, tmp_path: Path):
    resumed = _lm_trainer("hf", tmp_path)
    _quiet(
        lambda: resumed.train(
            resume_from_checkpoint=str(saved["root"] / "hookloop" / "checkpoint-2")
        )
    )
    whole = _step_losses(saved["hf"])
    after = _step_losses(resumed)
    assert {s: after[s] for s in (3, 4)} == pytest.approx({s: whole[s] for s in (3, 4)}, rel=1e-5)
    for name, value in saved["hf"].model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("copy", [["cp", "-r"], ["cp", "-rL"]], ids=["cp -r", "cp -rL"])
def test_a_copied_checkpoint_folder_resumes_exactly(saved, tmp_path: Path, copy: list[str]):
    import subprocess

    copied = tmp_path / "elsewhere" / "checkpoint-2"
    copied.parent.mkdir()
    subprocess.run(
        [*copy, str(saved["root"] / "hookloop" / "checkpoint-2"), str(copied)], check=True
    )
    resumed = _lm_trainer("hookloop", tmp_path / "out")
    _quiet(lambda: resumed.train(resume_from_checkpoint=str(copied)))
    whole = _step_losses(saved["hookloop"])
    after = _step_losses(resumed)
    assert {s: after[s] for s in (3, 4)} == {s: whole[s] for s in (3, 4)}  # bitwise
    for name, value in saved["hookloop"].model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


# -- predict() and trainers that only evaluate ------------------------------------------------


def _predicted(kind: str, out: Path, model: Any, data: Any, collator: Any = None) -> Any:
    # no train_dataset: a trainer built to evaluate and predict only
    trainer = _quiet(
        lambda: FACTORIES[kind](model, _args(out, per_device_eval_batch_size=4), collator)
    )
    return trainer.predict(data), _quiet(lambda: trainer.evaluate(data))


@pytest.mark.parametrize("model_kind", ["tuple outputs", "dict outputs, padded tokens"])
def test_predict_returns_transformers_prediction_output(tmp_path: Path, model_kind: str):
    if model_kind == "tuple outputs":
        make = lambda: (RegressionModel(), RegressionDataset(10, seed=3), None)  # noqa: E731
    else:
        make = lambda: (  # noqa: E731
            gpt2(),
            [{"input_ids": r} for r in token_rows(10, seed=2)],
            transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
        )
    (theirs, their_eval), (ours, our_eval) = (
        _predicted(kind, tmp_path / kind, *make()) for kind in FACTORIES
    )
    assert type(ours).__name__ == "PredictionOutput"
    assert ours.predictions.shape == theirs.predictions.shape
    assert ours.predictions == pytest.approx(theirs.predictions, rel=1e-5, abs=1e-6)
    assert (ours.label_ids == theirs.label_ids).all()  # padded with -100 alike
    assert sorted(ours.metrics) == sorted(theirs.metrics)
    assert ours.metrics["test_loss"] == pytest.approx(theirs.metrics["test_loss"], rel=1e-5)
    assert our_eval["eval_loss"] == pytest.approx(their_eval["eval_loss"], rel=1e-5)
    assert sorted(our_eval) == sorted(their_eval)
    predictions, label_ids, metrics = ours  # unpacks as a triple
    assert (predictions is ours.predictions, label_ids is ours.label_ids) == (True, True)
    assert metrics is ours.metrics


# -- numbers: NaN/Inf steps ------------------------------------------------------------------


class SpikyRegression(RegressionModel):
    """An Inf loss on batches holding a label above 4 (no gradient through it): the
    update still happens, the logged loss must be filtered as transformers filters it."""

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        out = super().forward(input_x, labels)
        if labels is None:
            return out
        spike = torch.where(labels.max() > 4, torch.tensor(float("inf")), torch.tensor(0.0))
        return (out[0] + spike, *out[1:])


@pytest.mark.parametrize("nan_filter", [True, False])
def test_a_non_finite_loss_is_applied_and_filtered_from_the_log_as_in_transformers(
    tmp_path: Path, nan_filter: bool
):
    runs = {
        kind: _regression_run(
            FACTORIES[kind],
            tmp_path / kind,
            model=SpikyRegression(),
            args=_args(
                tmp_path / kind,
                max_steps=8,
                gradient_accumulation_steps=2,
                logging_steps=3,
                max_grad_norm=0.0,
                logging_nan_inf_filter=nan_filter,
            ),
        )
        for kind in FACTORIES
    }
    theirs, ours = (_losses(runs[k]) for k in FACTORIES)
    assert any(not np.isfinite(x) for x in theirs) != nan_filter  # the data has spikes
    assert ours == pytest.approx(theirs, rel=1e-5, nan_ok=True)
    for name, value in runs["hf"].model.state_dict().items():  # every update was applied
        torch.testing.assert_close(runs["hookloop"].model.state_dict()[name], value)


@pytest.mark.parametrize("schedule", ["reduce_lr_on_plateau", "greedy"])
def test_a_metric_driven_schedule_steps_after_each_evaluation_as_in_transformers(
    tmp_path: Path, schedule: str
):
    settings = {
        "max_steps": 12,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "logging_steps": 1,
        "learning_rate": 0.05,
        "lr_scheduler_type": schedule,
        "lr_scheduler_kwargs": {"patience": 0, "factor": 0.5},
    }
    runs = {
        kind: _regression_run(
            FACTORIES[kind], tmp_path / kind, args=_args(tmp_path / kind, **settings)
        )
        for kind in FACTORIES
    }
    _assert_same_run(runs["hf"], runs["hookloop"])
    rates = {
        kind: [e["learning_rate"] for e in runs[kind].state.log_history if "learning_rate" in e]
        for kind in FACTORIES
    }
    assert rates["hookloop"] == pytest.approx(rates["hf"])
    assert len(set(rates["hf"])) > 1  # the metric changed the rate at least once


def test_the_native_loop_refuses_a_plateau_scheduler_it_cannot_step(tmp_path: Path):
    from hookloop import TrainConfig
    from hookloop import Trainer as NativeTrainer

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(ValueError, match="ReduceLROnPlateau scheduler steps on a metric"):
        NativeTrainer(
            model,
            opt,
            train_data=[(torch.randn(4, 2), torch.randn(4, 1))],
            loss_fn=torch.nn.functional.mse_loss,
            scheduler=plateau,
            config=TrainConfig(max_steps=1, device="cpu"),
        )


# -- the best checkpoint ---------------------------------------------------------------------


@pytest.mark.parametrize("limit", [None, 1], ids=["no limit", "save_total_limit=1"])
def test_the_best_checkpoint_and_the_folders_kept_match_transformers(tmp_path: Path, limit):
    # 40 samples / 4 = 10 steps an epoch; evaluations at epoch ends, saves every 5 steps:
    # the epoch's save comes before its evaluation, so the best is noted at a later save
    settings = {
        "num_train_epochs": 3,
        "eval_strategy": "epoch",
        "save_strategy": "steps",
        "save_steps": 5,
        "metric_for_best_model": "loss",
        "save_total_limit": limit,
        "learning_rate": 0.05,
    }
    runs = {}
    for kind in FACTORIES:
        out = tmp_path / kind
        runs[kind] = _regression_run(FACTORIES[kind], out, args=_args(out, **settings))
    names = {}
    for kind, trainer in runs.items():
        best = trainer.state.best_model_checkpoint
        folders = sorted(p.name for p in (tmp_path / kind).glob("checkpoint-*"))
        names[kind] = (Path(best).name if best else None, trainer.state.best_global_step, folders)
    assert names["hookloop"] == names["hf"]
    assert names["hf"][0] is not None


# -- hyperparameter_search ------------------------------------------------------------------


def test_hyperparameter_search_with_optuna_finds_what_transformers_finds(tmp_path: Path):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def space(trial: Any) -> dict[str, Any]:
        return {
            "learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True),
            "per_device_train_batch_size": trial.suggest_categorical(
                "per_device_train_batch_size", [2, 4]
            ),
        }

    found = {}
    for kind in FACTORIES:
        out = tmp_path / kind
        trainer = _quiet(
            lambda f=FACTORIES[kind], o=out: f(
                None,
                _args(o, max_steps=4, eval_strategy="steps", eval_steps=2),
                train_dataset=RegressionDataset(24),
                eval_dataset=RegressionDataset(8, seed=7),
                model_init=RegressionModel,
            )
        )
        storage = f"sqlite:///{tmp_path / (kind + '.db')}"
        best = _quiet(
            lambda t=trainer, s=storage: t.hyperparameter_search(
                hp_space=space,
                n_trials=3,
                direction="minimize",
                backend="optuna",
                sampler=optuna.samplers.TPESampler(seed=0),
                storage=s,
                study_name="search",
            )
        )
        study = optuna.load_study(study_name="search", storage=storage)
        found[kind] = (
            best,
            [(t.params, t.value, dict(t.intermediate_values)) for t in study.trials],
        )
    (hf_best, hf_trials), (best, trials) = found["hf"], found["hookloop"]
    assert type(best).__name__ == "BestRun"
    assert (best.run_id, best.hyperparameters) == (hf_best.run_id, hf_best.hyperparameters)
    assert best.objective == pytest.approx(hf_best.objective, rel=1e-5)
    for (params, value, steps), (hf_params, hf_value, hf_steps) in zip(
        trials, hf_trials, strict=True
    ):
        assert params == hf_params and value == pytest.approx(hf_value, rel=1e-5)
        assert steps == pytest.approx(hf_steps, rel=1e-5)  # reported at each evaluation's step


def test_a_multi_objective_search_returns_transformers_pareto_runs(tmp_path: Path):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    found = {}
    for kind, factory in FACTORIES.items():
        trainer = _quiet(
            lambda f=factory, o=tmp_path / kind: f(
                None, _args(o, max_steps=2, eval_strategy="steps", eval_steps=1),
                train_dataset=RegressionDataset(8), eval_dataset=RegressionDataset(8, seed=7),
                model_init=RegressionModel,
            )
        )  # fmt: skip
        found[kind] = _quiet(
            lambda t=trainer: t.hyperparameter_search(
                hp_space=lambda trial: {"learning_rate": trial.suggest_float("lr", 1e-3, 1e-1)},
                compute_objective=lambda m: [m["eval_loss"], m["epoch"]],
                n_trials=2,
                direction=["minimize", "maximize"],
                sampler=optuna.samplers.RandomSampler(seed=0),
            )
        )
    ours, theirs = found["hookloop"], found["hf"]
    assert [(r.run_id, r.hyperparameters) for r in ours] == [
        (r.run_id, r.hyperparameters) for r in theirs
    ]
    for mine, their in zip(ours, theirs, strict=True):
        assert mine.objective == pytest.approx(their.objective, rel=1e-5)


def test_model_init_trains_from_scratch_at_each_train_call_as_transformers(tmp_path: Path):
    weights = {}
    for kind, factory in FACTORIES.items():
        trainer = _quiet(
            lambda f=factory, o=tmp_path / kind: f(
                None, _args(o, max_steps=3, learning_rate=0.1),
                train_dataset=RegressionDataset(16), model_init=RegressionModel,
            )
        )  # fmt: skip
        runs = []
        for seed in (42, 42, 314):
            trainer.args.seed = seed
            _quiet(trainer.train)
            runs.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
        weights[kind] = runs
    ours, theirs = weights["hookloop"], weights["hf"]
    torch.testing.assert_close(ours[1], ours[0])  # the second train() starts over
    for mine, their in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, their)


def test_a_subclass_of_training_arguments_keeps_fields_of_its_own(tmp_path: Path):
    import dataclasses

    @dataclasses.dataclass
    class WithExtras(hf.TrainingArguments):
        a: float = 0.0
        b: float = 0.0

    args = WithExtras(output_dir=str(tmp_path), a=1.5, b=2.5, report_to="none", max_steps=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    trainer = _quiet(lambda: hf.Trainer(model, args))  # a=, b= are the user's: not refused
    assert trainer.get_num_trainable_parameters() == 4 * 3 + 3 + 3 * 2 + 2
    model[1].requires_grad_(False)
    assert trainer.get_num_trainable_parameters() == 4 * 3 + 3
    with pytest.raises(ValueError, match="optimizer is None"):  # as transformers, before one
        trainer.get_learning_rates()
    groups = trainer.create_optimizer().param_groups
    assert trainer.get_learning_rates() == [args.learning_rate] * len(groups)


def test_hyperparameter_search_needs_model_init_and_optuna(tmp_path: Path):
    trainer = _quiet(lambda: hf.Trainer(RegressionModel(), _args(tmp_path, max_steps=1)))
    with pytest.raises(RuntimeError, match="needs the model through model_init"):
        trainer.hyperparameter_search(n_trials=1)
    with pytest.raises(ValueError, match="backend 'ray' is not supported"):
        trainer.hyperparameter_search(n_trials=1, backend="ray")


@pytest.mark.parametrize(
    ("optim", "optim_args", "expected"),
    [
        ("sgd", "momentum=0.9,nesterov=True", torch.optim.SGD),
        ("adagrad", "lr_decay=0.01", torch.optim.Adagrad),
        ("rmsprop", "alpha=0.9,centered=yes", torch.optim.RMSprop),
        ("adafactor", None, None),
    ],
)
def test_optim_builds_transformers_optimizer_and_trains_alike(
    tmp_path: Path, optim, optim_args, expected
):
    settings = {"max_steps": 5, "optim": optim, "optim_args": optim_args, "learning_rate": 0.01,
                "weight_decay": 0.1}  # fmt: skip
    runs = {
        kind: _regression_run(
            FACTORIES[kind], tmp_path / kind, args=_args(tmp_path / kind, **settings)
        )
        for kind in FACTORIES
    }
    _assert_same_run(runs["hf"], runs["hookloop"])
    ours, theirs = runs["hookloop"].optimizer, runs["hf"].optimizer
    assert type(ours).__name__ == type(getattr(theirs, "optimizer", theirs)).__name__
    if expected is not None:
        assert isinstance(ours, expected)
    assert [g["weight_decay"] for g in ours.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize(
    "settings",
    [
        {"logging_steps": 0.25, "max_steps": 8},
        {"learning_rate": 0.0, "max_steps": 3},
        {"eval_strategy": "steps", "eval_steps": 0.5, "save_strategy": "steps",
         "save_steps": 0.5, "max_steps": 8},
    ],
    ids=["fractional logging_steps", "learning_rate=0", "fractional eval and save steps"],
)  # fmt: skip
def test_fractional_intervals_and_a_zero_learning_rate_run_as_in_transformers(
    tmp_path: Path, settings
):
    runs = {
        kind: _regression_run(
            FACTORIES[kind], tmp_path / kind, args=_args(tmp_path / kind, **settings)
        )
        for kind in FACTORIES
    }
    _assert_same_run(runs["hf"], runs["hookloop"])
    steps = {k: [(e["step"], sorted(e)) for e in t.state.log_history] for k, t in runs.items()}
    assert steps["hookloop"] == steps["hf"]
    folders = {k: sorted(p.name for p in (tmp_path / k).glob("checkpoint-*")) for k in FACTORIES}
    assert folders["hookloop"] == folders["hf"]


# -- an ordinary script, crashed and resumed in a second process --------------------------------


def test_a_causal_lm_script_crashed_and_resumed_ends_as_with_transformers(tmp_path: Path):
    import sys

    from safetensors.torch import load_file

    import _zygote as zygote  # torch and hookloop imported once for the four runs

    script = Path(__file__).with_name("_hf_clm_script.py")
    ends = {}
    for kind in FACTORIES:
        out = tmp_path / kind
        crashed = zygote.run([sys.executable, str(script), kind, str(out), "crash"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert crashed.returncode == 3, crashed.stderr[-2000:]
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
        resumed = zygote.run([sys.executable, str(script), kind, str(out), "resume"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        result = json.loads((out / "result.json").read_text())
        ends[kind] = {
            "steps": [(e["step"], e.get("loss")) for e in result["log_history"]],
            "keys": [sorted(e) for e in result["log_history"]],
            "metrics": sorted(result["metrics"]),
            "folders": sorted(p.name for p in out.glob("checkpoint-*")),
            "files": sorted(p.name for p in (out / "checkpoint-8").iterdir()),
            "state": json.loads((out / "checkpoint-8" / "trainer_state.json").read_text()),
            "weights": load_file(out / "model.safetensors"),
        }
    theirs, ours = ends["hf"], ends["hookloop"]
    assert [s for s, _ in ours["steps"]] == [s for s, _ in theirs["steps"]]
    losses = [[x for _, x in run["steps"] if x is not None] for run in (ours, theirs)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and len(losses[1]) == 8
    assert ours["keys"] == theirs["keys"]
    assert ours["metrics"] == theirs["metrics"]
    assert ours["folders"] == theirs["folders"]
    assert set(theirs["files"]) <= set(ours["files"])
    assert set(theirs["state"]) - {"train_batch_size"} <= set(ours["state"])
    assert ours["state"]["global_step"] == theirs["state"]["global_step"] == 8
    for name, value in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


# -- the loaders a subclass builds ----------------------------------------------------------


class Reversed(torch.utils.data.Sampler):
    def __init__(self, data: Any) -> None:
        self.n = len(data)

    def __iter__(self) -> Any:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def _reversed_loaders(base: type) -> type:
    """A subclass whose loaders walk the data in reverse, 4 samples a batch."""

    def loader(self: Any, data: Any) -> Any:
        return torch.utils.data.DataLoader(
            data,
            batch_size=4,
            sampler=Reversed(data),
            collate_fn=transformers.default_data_collator,
        )

    return type(
        f"Reversed{base.__name__}",
        (base,),
        {
            "get_train_dataloader": lambda self: loader(self, self.train_dataset),
            "get_eval_dataloader": lambda self, ds=None: loader(self, ds or self.eval_dataset),
            "get_test_dataloader": lambda self, ds: loader(self, ds),
        },
    )


def test_a_subclass_s_loaders_are_the_ones_training_evaluation_and_predict_use(tmp_path: Path):
    runs = {
        kind: _regression_run(
            _reversed_loaders(FACTORIES[kind]),
            tmp_path / kind,
            args=_args(tmp_path / kind, max_steps=6, eval_strategy="steps", eval_steps=3),
        )
        for kind in FACTORIES
    }
    _assert_same_run(runs["hf"], runs["hookloop"])
    evals = {
        k: [e["eval_loss"] for e in t.state.log_history if "eval_loss" in e]
        for k, t in runs.items()
    }
    assert evals["hookloop"] == pytest.approx(evals["hf"], rel=1e-5)
    data = RegressionDataset(7, seed=5)
    predicted = {k: _quiet(lambda t=t: t.predict(data)) for k, t in runs.items()}
    assert predicted["hookloop"].predictions == pytest.approx(predicted["hf"].predictions, rel=1e-5)
    assert predicted["hookloop"].label_ids.tolist() == predicted["hf"].label_ids.tolist()


def test_save_strategy_best_saves_at_each_new_best_as_transformers(tmp_path: Path):
    settings = {"max_steps": 12, "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "best",
                "metric_for_best_model": "loss", "learning_rate": 0.2}  # fmt: skip
    runs = {
        kind: _regression_run(
            FACTORIES[kind], tmp_path / kind, args=_args(tmp_path / kind, **settings)
        )
        for kind in FACTORIES
    }
    _assert_same_run(runs["hf"], runs["hookloop"])
    folders = {k: sorted(p.name for p in (tmp_path / k).glob("checkpoint-*")) for k in FACTORIES}
    assert folders["hookloop"] == folders["hf"]
    assert 0 < len(folders["hf"]) < 6  # only the evaluations that set a new best
    for kind, factory in FACTORIES.items():  # the arguments accept it; both Trainers refuse it
        with pytest.raises(ValueError, match="metric_for_best_model` must be provided"):
            args = _args(tmp_path / kind, save_strategy="best", eval_strategy="steps")
            data = RegressionDataset(8)
            factory(RegressionModel(), args, train_dataset=data, eval_dataset=data)


def test_transformers_early_stopping_and_load_best_model_at_end_end_alike(tmp_path: Path):
    settings = {"max_steps": 40, "eval_strategy": "steps", "eval_steps": 2,
                "save_strategy": "steps", "save_steps": 2, "metric_for_best_model": "loss",
                "load_best_model_at_end": True, "learning_rate": 0.3,
                "save_total_limit": 2}  # fmt: skip
    runs = {
        kind: _regression_run(
            FACTORIES[kind],
            tmp_path / kind,
            args=_args(tmp_path / kind, **settings),
            callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=2)],
        )
        for kind in FACTORIES
    }
    theirs, ours = runs["hf"], runs["hookloop"]
    assert ours.state.global_step == theirs.state.global_step < 40  # stopped early
    assert (
        Path(ours.state.best_model_checkpoint).name == Path(theirs.state.best_model_checkpoint).name
    )
    folders = {k: sorted(p.name for p in (tmp_path / k).glob("checkpoint-*")) for k in FACTORIES}
    assert folders["hookloop"] == folders["hf"]
    _assert_same_run(theirs, ours)  # the best checkpoint's weights, loaded at the end


def test_a_sequence_classifier_script_ends_as_with_transformers(tmp_path: Path):
    pytest.importorskip("optuna").logging.set_verbosity(30)
    import _hf_classifier_script as script

    theirs = _quiet(lambda: script.run(transformers.Trainer, tmp_path / "hf"))
    ours = _quiet(lambda: script.run(hf.Trainer, tmp_path / "hookloop"))
    history = [[(e["step"], sorted(e)) for e in run["log_history"]] for run in (ours, theirs)]
    assert history[0] == history[1]
    for mine, real in zip(ours["log_history"], theirs["log_history"], strict=True):
        for key in ("loss", "eval_loss", "eval_accuracy"):
            if key in real:
                assert mine[key] == pytest.approx(real[key], rel=1e-5), (real["step"], key)
    assert set(ours["train_metrics"]) == set(theirs["train_metrics"])  # the summary only
    assert ours["trial_dirs"] == theirs["trial_dirs"] == ["run-0", "run-1"]
    for key in ("best_model_checkpoint", "folders", "label_ids"):
        assert (
            np.array_equal(ours[key], theirs[key])
            if key == "label_ids"
            else ours[key] == theirs[key]
        )
    assert ours["predictions"] == pytest.approx(theirs["predictions"], rel=1e-4, abs=1e-6)
    assert sorted(ours["predict_metrics"]) == sorted(theirs["predict_metrics"])
    assert ours["best_run"][0] == theirs["best_run"][0]
    assert ours["best_run"][1] == pytest.approx(theirs["best_run"][1], rel=1e-5)
    assert ours["best_run"][2] == theirs["best_run"][2]


def test_arguments_changed_after_construction_are_the_ones_train_uses(tmp_path: Path):
    runs = {}
    for kind in FACTORIES:
        trainer = _quiet(
            lambda f=FACTORIES[kind], k=kind: f(
                RegressionModel(), _args(tmp_path / k, max_steps=4),
                train_dataset=RegressionDataset(40),
            )
        )  # fmt: skip
        trainer.args.learning_rate = 0.07  # as a script sets the best run's values, then trains
        trainer.args.per_device_train_batch_size = 2
        _quiet(trainer.train)
        runs[kind] = trainer
    _assert_same_run(runs["hf"], runs["hookloop"])
    rates = [
        [e["learning_rate"] for e in t.state.log_history if "loss" in e] for t in runs.values()
    ]
    assert rates[0][0] == rates[1][0] == pytest.approx(0.07)  # the new rate, not the built one
    assert len(rates[0]) == len(rates[1]) == 4  # batch size: transformers keeps the built one


def test_a_rebuild_for_changed_arguments_keeps_added_callbacks_and_the_logits_hook(
    tmp_path: Path,
):
    """transformers' callback handler and ``preprocess_logits_for_metrics`` outlive a
    ``train()`` that sees changed arguments; so must the dialect's (rebuilt) loop."""
    seen: dict[str, dict[str, int]] = {}
    for kind in FACTORIES:
        counts = seen.setdefault(kind, {"train_begin": 0, "preprocess": 0})

        class Added(transformers.TrainerCallback):
            def __init__(self, counts: dict[str, int]) -> None:
                self.counts = counts

            def on_train_begin(self, args, state, control, **kwargs):
                self.counts["train_begin"] += 1

        def preprocess(logits: Any, labels: Any, counts: dict[str, int] = counts) -> Any:
            counts["preprocess"] += 1
            return logits

        trainer = _quiet(
            lambda f=FACTORIES[kind], k=kind: f(
                RegressionModel(), _args(tmp_path / k, max_steps=2, eval_strategy="no"),
                train_dataset=RegressionDataset(16), eval_dataset=RegressionDataset(8, seed=7),
                preprocess_logits_for_metrics=preprocess, compute_metrics=lambda p: {"m": 0.0},
            )
        )  # fmt: skip
        trainer.add_callback(Added(counts))
        trainer.args.learning_rate = 0.07  # changed after construction: the loop is rebuilt
        _quiet(trainer.train)
        _quiet(trainer.evaluate)
    assert seen["hookloop"] == seen["hf"]
    assert seen["hf"]["train_begin"] == 1 and seen["hf"]["preprocess"] >= 1


def _history(trainer: Any) -> list[dict[str, Any]]:
    timing = ("runtime", "per_second")
    return [
        {k: v for k, v in e.items() if not any(t in k for t in timing)}
        for e in trainer.state.log_history
    ]


def _assert_same_history(ours: Any, theirs: Any) -> None:
    mine, their = _history(ours), _history(theirs)
    assert [sorted(e) for e in mine] == [sorted(e) for e in their]
    for a, b in zip(mine, their, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_the_dialect_resumes_from_a_folder_transformers_wrote_as_transformers_does(
    saved, tmp_path: Path
):
    folder = saved["root"] / "hf" / "checkpoint-2"  # GPT-2: its head tied to its embedding
    resumed = {}
    for kind in FACTORIES:
        trainer = _lm_trainer(kind, tmp_path / kind)
        _quiet(lambda t=trainer: t.train(resume_from_checkpoint=str(folder)))
        resumed[kind] = trainer
    theirs, ours = resumed["hf"], resumed["hookloop"]
    _assert_same_history(ours, theirs)
    assert ours.state.global_step == theirs.state.global_step == 4
    _assert_same_run(theirs, ours)
    torch.testing.assert_close(ours.model.state_dict(), saved["hf"].model.state_dict())


def test_a_transformers_folder_across_epochs_and_accumulation_resumes_alike(tmp_path: Path):
    settings = dict(max_steps=9, gradient_accumulation_steps=2, save_strategy="steps",
                    save_steps=5, logging_steps=2, per_device_train_batch_size=3)  # fmt: skip

    def run(kind: str, out: Path, resume: Any = None) -> Any:
        trainer = _quiet(
            lambda: FACTORIES[kind](
                RegressionModel(), _args(out, **settings), train_dataset=RegressionDataset(20)
            )
        )
        _quiet(lambda: trainer.train(resume_from_checkpoint=resume))
        return trainer

    whole = run("hf", tmp_path / "whole")  # 4 steps an epoch (7 batches, the last group of 1)
    folder = tmp_path / "whole" / "checkpoint-5"
    theirs, ours = (run(kind, tmp_path / kind, str(folder)) for kind in FACTORIES)
    _assert_same_history(ours, theirs)
    _assert_same_run(theirs, ours)
    # the data went on where the uninterrupted run's did: the same final weights
    torch.testing.assert_close(ours.model.state_dict(), whole.model.state_dict())


def test_a_damaged_transformers_folder_is_refused_naming_the_file(saved, tmp_path: Path):
    import shutil

    folder = tmp_path / "checkpoint-2"
    shutil.copytree(saved["root"] / "hf" / "checkpoint-2", folder)
    (folder / "optimizer.pt").write_bytes(b"not a torch file")
    trainer = _lm_trainer("hookloop", tmp_path / "out")
    with pytest.raises(ValueError, match=r"optimizer\.pt cannot be loaded") as caught:
        trainer.train(resume_from_checkpoint=str(folder))
    assert "\n" not in str(caught.value)
    (folder / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"optimizer\.pt is missing"):
        _lm_trainer("hookloop", tmp_path / "out2").train(resume_from_checkpoint=str(folder))
