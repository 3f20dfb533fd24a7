"""The HPO trainer's dialect (hookloop.compat.hpo): its documented example as written,
priorities shared with native callbacks, the trainer-attribute convention, a hand-written
loop, the event trace."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import Dataset

import hookloop.compat.hpo as hpo
from _golden import golden_run_config
from _reference_examples import example, with_imports
from hookloop import Callback, CallbackManager, Trainer
from hookloop.callbacks import JsonLogger, read_jsonl
from hookloop.callbacks.optuna_pruning import objective_value
from hookloop.compat.hpo import (
    EVENTS,
    FIELDS,
    CallbackRunner,
    GradientMonitorCallback,
    HpoAdapter,
    HpoTrainer,
    LossPredictionCallback,
    NaNDetectionCallback,
    OptimizerModeCallback,
    OverfitDetectionCallback,
    TrainingCallback,
    as_native,
)
from hookloop.testing import TinyModel, ToyData

HPO_IMPORT = {"from callbacks import": "from hookloop.compat.hpo import TrainingCallback"}


def hpo_best_loss_tracker() -> type:
    """The documented BestLossTrackerCallback, cut out of the HPO trainer's text, its import
    line swapped."""
    code = example("hpo_trainer_callbacks", "from callbacks import TrainingCallback", ")")
    namespace: dict = {}
    exec(with_imports(code, HPO_IMPORT), namespace)
    return namespace["BestLossTrackerCallback"]


class EvalLosses(Callback):
    """Native: every evaluation loss during training, with its (0-based) epoch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_eval_end(self, ctx):
        self.seen.append((ctx.state.epoch, ctx.metrics["eval_loss"]))


class Record(TrainingCallback):
    """HPO-trainer style: appends (label, event, step) to a shared list for every hook."""

    def __init__(self, log: list, label: str = "", priority: int = 50) -> None:
        self.log, self.label, self.priority = log, label, priority
        self.fields: dict[str, set[str]] = {}

    def _seen(self, event, trainer, kwargs):
        self.fields[event] = set(kwargs)
        step = trainer.step if isinstance(trainer, HpoTrainer) else None
        self.log.append((self.label, event, step) if self.label else (event, step))

    def on_train_begin(self, trainer, **kwargs):
        self._seen("on_train_begin", trainer, kwargs)

    def on_train_epoch_begin(self, trainer, **kwargs):
        self._seen("on_train_epoch_begin", trainer, kwargs)

    def on_train_step_end(self, trainer, **kwargs):
        self._seen("on_train_step_end", trainer, kwargs)

    def on_val_begin(self, trainer, **kwargs):
        self._seen("on_val_begin", trainer, kwargs)

    def on_val_end(self, trainer, **kwargs):
        self._seen("on_val_end", trainer, kwargs)

    def on_epoch_end(self, trainer, **kwargs):
        self._seen("on_epoch_end", trainer, kwargs)

    def on_train_end(self, trainer, **kwargs):
        self._seen("on_train_end", trainer, kwargs)


# -- the HPO trainer's example, as written -------------------------------------------------


def test_the_documented_best_loss_tracker_runs_in_a_hookloop_run_and_prints_its_summary(
    make_trainer, capsys
):
    tracker = hpo_best_loss_tracker()()
    evals = EvalLosses()
    runner = CallbackRunner([NaNDetectionCallback(), tracker, OptimizerModeCallback()])
    trainer = make_trainer([*runner.native(), evals], eval_n=8, max_epochs=4)
    trainer.train()

    best_epoch, best = min(evals.seen, key=lambda seen: seen[1])
    assert len(evals.seen) == 4
    assert capsys.readouterr().out == (
        f"Training complete. Best val_loss: {best:.4e} at epoch {best_epoch}\n"
    )
    # "Store on trainer": the value lives in user_state, where native callbacks read it.
    assert trainer.callbacks.user_state["best_val_loss"] == best
    assert HpoTrainer(trainer.ctx)._best_val_loss == best


def test_a_value_an_hpo_callback_stores_on_the_trainer_reaches_the_loggers(make_trainer, tmp_path):
    tracker = hpo_best_loss_tracker()()
    jsonl = tmp_path / "metrics.jsonl"
    # 2 steps an epoch, logged every step, evaluated at each epoch end.
    callbacks = [*as_native(tracker), JsonLogger(jsonl)]
    trainer = make_trainer(callbacks, n=8, eval_n=8, max_epochs=3, log_every=1)
    trainer.train()

    records = read_jsonl(jsonl)
    evals = [r["eval_loss"] for r in records if r["kind"] == "eval"]
    logged = [(r["step"], r.get("best_val_loss")) for r in records if r["kind"] == "train"]
    # Nothing before the first evaluation; then the best so far at every log step.
    assert logged == [
        (1, None),
        (2, None),
        (3, evals[0]),
        (4, evals[0]),
        (5, min(evals[:2])),
        (6, min(evals[:2])),
    ]
    assert trainer.callbacks.user_state["best_val_loss"] == min(evals)


def test_the_documented_callback_list_runs_in_priority_order_whatever_the_insertion_order(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    code = example(
        "hpo_trainer_callbacks",
        "callbacks_list = [",
        "callback_runner = CallbackRunner(callbacks_list)",
    )
    namespace = {name: getattr(hpo, name) for name in hpo.__all__}  # the HPO trainer's names
    namespace.update(
        BestLossTrackerCallback=hpo_best_loss_tracker(),
        run_config=type("RunConfig", (), {"epochs": 10}),
    )
    exec(code, namespace)
    runner = namespace["callback_runner"]

    order = [(type(cb).__name__, cb.priority) for cb in runner.callbacks]
    assert order == [  # the HPO trainer's names and priorities
        ("NaNDetectionCallback", 5),
        ("OptimizerModeCallback", 10),
        ("GradientMonitorCallback", 12),
        ("BestLossTrackerCallback", 60),
        ("LossPredictionCallback", 70),
        ("OverfitDetectionCallback", 75),
        ("WandbLoggingCallback", 80),
    ]
    native = runner.native()
    assert [cb is theirs for cb, theirs in zip(native, runner.callbacks, strict=True)] == [
        True,
        True,
        True,
        False,  # the HPO-trainer callback is adapted; the built-ins pass through unchanged
        True,
        True,
        True,
    ]
    assert isinstance(native[3], HpoAdapter) and native[3].callback is runner.callbacks[3]


# -- priorities shared with native callbacks -----------------------------------------------


class NativeProbe(Callback):
    def __init__(self, log: list, label: str, priority: int) -> None:
        self.log, self.label, self.priority = log, label, priority

    def on_epoch_end(self, ctx):
        self.log.append((self.label, "on_epoch_end", ctx.state.step))


def test_hpo_and_native_callbacks_interleave_by_priority(make_trainer):
    log: list = []
    runner = CallbackRunner(
        [
            Record(log, "hpo-90", priority=90),
            NativeProbe(log, "native-50", priority=50),
            Record(log, "hpo-11", priority=11),
            Record(log, "hpo-50", priority=50),
        ]
    )
    trainer = make_trainer([NativeProbe(log, "native-12", 12), *runner.native()], max_steps=4)
    trainer.train()

    epoch_end = [label for label, event, _ in log if event == "on_epoch_end"]
    # Ties keep list order: the runner's native-50 was listed before hpo-50.
    assert epoch_end == ["hpo-11", "native-12", "native-50", "hpo-50", "hpo-90"]
    names = [cb.name for cb in trainer.callbacks.list_callbacks("on_epoch_end")]
    assert names == ["Record", "NativeProbe", "NativeProbe", "Record", "Record"]


def test_an_hpo_callback_is_registered_only_for_the_native_events_it_needs():
    class OnlyValEnd(TrainingCallback):
        def on_val_end(self, trainer, **kwargs):
            pass

    manager = CallbackManager(as_native(OnlyValEnd()))
    handled = [e for e in manager.index if manager.has_callbacks(e)]
    assert handled == ["on_before_log", "on_eval_end"]  # before_log: hands values to loggers


# -- the trainer-attribute convention ------------------------------------------------------


class Flipped(Dataset):
    """Evaluation data whose targets have the opposite sign: as training fits ToyData,
    the evaluation loss rises, which is what overfitting looks like."""

    def __init__(self) -> None:
        self.data = ToyData(n=8, seed=1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x, -y


class ReadsConvention(TrainingCallback):
    """An HPO-trainer consumer, as its W&B logger reads its producers."""

    priority = 80
    NAMES = ("_max_grad_norm", "_overfit_gap_ratio", "_loss_prediction")

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_epoch_end(self, trainer, **kwargs):
        self.seen.append({n: getattr(trainer, n) for n in self.NAMES if hasattr(trainer, n)})


class ReadsProducers(Callback):
    """Native, after everything: what the producers themselves hold at each epoch end."""

    priority = 100

    def __init__(self, monitor, overfit, prediction) -> None:
        self.monitor, self.overfit, self.prediction = monitor, overfit, prediction
        self.seen: list[dict] = []

    def on_epoch_end(self, ctx):
        self.seen.append(
            {
                "_max_grad_norm": self.monitor.epoch_maxima[-1],
                "_overfit_gap_ratio": self.overfit.gap_ratio,
                "_loss_prediction": self.prediction.prediction,
            }
        )


def test_trainer_attributes_are_served_from_the_native_producers(make_config):
    monitor = GradientMonitorCallback()
    overfit = OverfitDetectionCallback(warmup_epochs=0, window_size=1)
    prediction = LossPredictionCallback(min_points=2)
    consumer = ReadsConvention()
    truth = ReadsProducers(monitor, overfit, prediction)
    runner = CallbackRunner([consumer, prediction, overfit, monitor])
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(n=16),
        eval_data=Flipped(),
        loss_fn=TinyModel.loss_fn,
        config=make_config(max_epochs=3, log_every=1),
        callbacks=[*runner.native(), truth],
    )
    with pytest.warns(UserWarning, match="OverfitDetection"):
        trainer.train()

    assert consumer.seen == truth.seen
    # Epoch 1: no trend and no fit yet, so None (the producers are there); then values.
    assert consumer.seen[0]["_overfit_gap_ratio"] is None
    assert consumer.seen[0]["_loss_prediction"] is None
    assert all(isinstance(s["_max_grad_norm"], float) for s in consumer.seen)
    assert isinstance(consumer.seen[2]["_overfit_gap_ratio"], float)
    assert isinstance(consumer.seen[2]["_loss_prediction"], float)


def test_without_their_producers_the_attributes_do_not_exist(make_trainer):
    consumer = ReadsConvention()
    make_trainer(as_native(consumer), eval_n=8, max_epochs=2).train()
    assert consumer.seen == [{}, {}]


def test_trainer_view_reads_the_run_and_refuses_to_overwrite_it(make_trainer):
    seen = {}

    class Looks(TrainingCallback):
        def on_train_step_end(self, trainer, **kwargs):
            seen.update(
                model=trainer.model,
                optimizer=trainer.optimizer,
                native=trainer.native,
                epoch=trainer.epoch,
                max_epochs=trainer.max_epochs,
            )
            with pytest.raises(AttributeError, match=r"read-only.*trainer._model"):
                trainer.model = None
            with pytest.raises(AttributeError, match="no attribute 'modle'"):
                trainer.modle  # noqa: B018

    trainer = make_trainer(as_native(Looks()), max_epochs=2)
    trainer.train()
    assert seen == {
        "model": trainer.model,
        "optimizer": trainer.optimizer,
        "native": trainer,
        "epoch": 1,
        "max_epochs": 2,
    }


# -- stop signals --------------------------------------------------------------------------


class StopsAt(TrainingCallback):
    def __init__(self, epoch: int, flag: str) -> None:
        self.epoch, self.flag = epoch, flag

    def on_val_end(self, trainer, epoch, **kwargs):
        if epoch == self.epoch:
            setattr(self, self.flag, True)


def test_should_stop_ends_a_hookloop_run_after_that_epoch(make_trainer):
    result = make_trainer(as_native(StopsAt(1, "should_stop")), eval_n=8, max_epochs=5).train()
    assert (result.epoch, result.step) == (2, 8)
    assert result.stop_reason == "StopsAt set should_stop (HPO-trainer stop signal)"


def test_nan_detected_ends_the_run_and_scores_it_as_failed(make_trainer):
    result = make_trainer(as_native(StopsAt(0, "nan_detected")), eval_n=8, max_epochs=5).train()
    assert result.epoch == 1
    assert "nan_detected" in result.stop_reason
    assert objective_value(result) == math.inf


# -- keyword fields ------------------------------------------------------------------------


def test_each_event_gets_its_documented_fields_with_the_runs_numbers(make_trainer):
    class Keeps(TrainingCallback):
        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.epochs: list[dict] = []
            self.vals: list[dict] = []

        def on_train_step_end(self, trainer, **kwargs):
            self.steps.append(kwargs)

        def on_val_end(self, trainer, **kwargs):
            self.vals.append(kwargs)

        def on_epoch_end(self, trainer, **kwargs):
            self.epochs.append(kwargs)

    class StepLosses(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_step_end(self, ctx):
            self.losses.append(ctx.loss_dict["loss"].item())

    keeps, losses, evals = Keeps(), StepLosses(), EvalLosses()
    make_trainer([*as_native(keeps), losses, evals], eval_n=8, max_epochs=2).train()

    assert [set(s) for s in keeps.steps] == [set(FIELDS["on_train_step_end"])] * 8
    assert [(s["epoch"], s["step"], s["batch_idx"]) for s in keeps.steps[:5]] == [
        (0, 1, 0),
        (0, 2, 1),
        (0, 3, 2),
        (0, 4, 3),
        (1, 5, 0),
    ]
    assert [s["loss"].item() for s in keeps.steps] == losses.losses
    assert [(v["epoch"], v["val_loss"]) for v in keeps.vals] == evals.seen
    assert keeps.vals[0]["metrics"] == {"eval_loss": evals.seen[0][1]}
    for epoch, fields in enumerate(keeps.epochs):
        assert set(fields) == set(FIELDS["on_epoch_end"])
        assert fields["epoch"] == epoch
        assert fields["train_loss"] == pytest.approx(
            sum(losses.losses[4 * epoch : 4 * epoch + 4]) / 4
        )
        assert fields["val_loss"] == evals.seen[epoch][1]
        assert fields["lr"] == pytest.approx(1e-3)


def test_without_evaluation_data_epoch_end_says_so_with_none(make_trainer):
    log: list = []
    keeps = Record(log)

    class Epochs(TrainingCallback):
        def __init__(self) -> None:
            self.val_losses: list = []

        def on_epoch_end(self, trainer, val_loss, metrics, **kwargs):
            self.val_losses.append((val_loss, metrics))

    epochs = Epochs()
    make_trainer(as_native(keeps) + as_native(epochs), max_epochs=2).train()
    assert epochs.val_losses == [(None, {}), (None, {})]
    assert "on_val_end" not in keeps.fields


# -- golden trace --------------------------------------------------------------------------

# The same run as tests/test_trace.py (2 epochs of 2 steps, evaluation every 3 steps and
# at each epoch end), seen through the HPO trainer's seven events: (event, step).
EXPECTED = [
    ("on_train_begin", 0),
    # epoch 1
    ("on_train_epoch_begin", 0),
    ("on_train_step_end", 1),
    ("on_train_step_end", 2),
    ("on_val_begin", 2),  # epoch-end evaluation
    ("on_val_end", 2),
    ("on_epoch_end", 2),
    # epoch 2
    ("on_train_epoch_begin", 2),
    ("on_train_step_end", 3),
    ("on_val_begin", 3),  # eval_every=3
    ("on_val_end", 3),
    ("on_train_step_end", 4),
    ("on_val_begin", 4),  # epoch-end evaluation
    ("on_val_end", 4),
    ("on_epoch_end", 4),
    ("on_train_end", 4),
]


def test_hpo_event_order_matches_the_golden_trace():
    log: list = []
    recorder = Record(log)
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(n=16),
        eval_data=ToyData(n=8, seed=1),
        loss_fn=TinyModel.loss_fn,
        config=golden_run_config(),
        callbacks=as_native(recorder),
    )
    result = trainer.train()

    assert log == EXPECTED
    assert (result.step, result.epoch) == (4, 2)
    assert recorder.fields == {event: set(fields) for event, fields in FIELDS.items()}


# -- standalone, in a hand-written loop ----------------------------------------------------


class PatienceStop(TrainingCallback):
    """HPO-trainer style early stopping on val_loss, for the hand-written loop."""

    priority = 90

    def __init__(self, patience: int) -> None:
        self.patience, self.bad, self.best = patience, 0, math.inf
        self.should_stop = False

    def on_val_end(self, trainer, val_loss, **kwargs):
        self.bad = 0 if val_loss < self.best else self.bad + 1
        self.best = min(self.best, val_loss)
        self.should_stop = self.bad >= self.patience


class MyTrainer:
    """A user's own trainer object: the runner passes it to hooks as it is."""

    def __init__(self) -> None:
        self.model = TinyModel()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)


def test_runner_drives_a_hand_written_loop_until_a_callback_says_stop(capsys):
    log: list = []
    trainer = MyTrainer()
    train_x, train_y = ToyData(n=16).x, ToyData(n=16).y
    val_x, val_y = Flipped().data.x, -Flipped().data.y  # gets worse as training improves
    tracker = hpo_best_loss_tracker()()
    runner = CallbackRunner([PatienceStop(patience=2), Record(log, "rec", 0), tracker])

    runner.fire("on_train_begin", trainer)
    for epoch in range(20):
        runner.fire("on_train_epoch_begin", trainer, epoch=epoch)
        loss = torch.nn.functional.mse_loss(trainer.model(train_x), train_y)
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        runner.fire("on_train_step_end", trainer, epoch=epoch, batch_idx=0, loss=loss.item())
        runner.fire("on_val_begin", trainer, epoch=epoch)
        with torch.no_grad():
            val_loss = torch.nn.functional.mse_loss(trainer.model(val_x), val_y).item()
        runner.fire("on_val_end", trainer, epoch=epoch, val_loss=val_loss, metrics={})
        runner.fire("on_epoch_end", trainer, epoch=epoch, train_loss=loss.item(), val_loss=val_loss)
        if runner.should_stop:
            break
    runner.fire("on_train_end", trainer)

    assert epoch == tracker.best_epoch + 2  # two epochs without improvement, then stop
    assert trainer._best_val_loss == tracker.best_val_loss  # a plain attribute here
    assert [e for _, e, _ in log][:7] == [*EVENTS[:-1], "on_train_epoch_begin"]
    assert capsys.readouterr().out.startswith("Training complete. Best val_loss: ")


def test_runner_sorts_stably_by_priority_on_construction():
    log: list = []
    late, early, tie_a, tie_b = (
        Record(log, "late", 70),
        Record(log, "early", 5),
        Record(log, "tie-a", 50),
        Record(log, "tie-b", 50),
    )
    runner = CallbackRunner([late, tie_a, early, tie_b])
    assert runner.callbacks == [early, tie_a, tie_b, late]
    runner.fire("on_train_end", trainer=None)
    assert [label for label, _, _ in log] == ["early", "tie-a", "tie-b", "late"]


def test_an_exception_in_a_hook_names_the_callback_and_event():
    class Breaks(TrainingCallback):
        def on_val_end(self, trainer, **kwargs):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        CallbackRunner([Breaks()]).fire("on_val_end", trainer=None, val_loss=1.0)
    assert "raised by Breaks.on_val_end" in "\n".join(info.value.__notes__)


# -- checkpoints ---------------------------------------------------------------------------


def test_a_stateful_hpo_callback_is_checkpointed_under_its_class_name():
    class Counts(TrainingCallback):
        def __init__(self) -> None:
            self.epochs = 0

        def on_epoch_end(self, trainer, **kwargs):
            self.epochs += 1

        def state_dict(self):
            return {"epochs": self.epochs}

        def load_state_dict(self, state):
            self.epochs = state["epochs"]

    counts, plain = Counts(), Record([])
    manager = CallbackManager(as_native([counts, plain]))
    stateful = manager.stateful_callbacks()
    assert list(stateful) == ["Counts"]
    stateful["Counts"].load_state_dict({"epochs": 7})
    assert counts.epochs == 7 and stateful["Counts"].state_dict() == {"epochs": 7}


# -- clear errors for bad input ------------------------------------------------------------


def test_an_unknown_event_is_refused_with_a_suggestion():
    runner = CallbackRunner([Record([])])
    with pytest.raises(ValueError, match=r"unknown HPO-trainer event 'on_val_ends'.*'on_val_end'"):
        runner.fire("on_val_ends", trainer=None)
    with pytest.raises(ValueError, match=r"'on_eval_end' is a native.*calls it 'on_val_end'"):
        runner.fire("on_eval_end", trainer=None)


def test_a_misspelt_hook_is_refused_because_it_would_never_run():
    class Typo(TrainingCallback):
        def on_val_ends(self, trainer, **kwargs):
            pass

    with pytest.raises(ValueError, match=r"Typo.on_val_ends matches no HPO-trainer.*'on_val_end'"):
        CallbackRunner([Typo()])


@pytest.mark.parametrize("priority", ["high", 1.5, True, None])
def test_a_priority_that_is_not_an_int_is_refused(priority):
    class Odd(TrainingCallback):
        pass

    odd = Odd()
    odd.priority = priority
    with pytest.raises(ValueError, match=r"Odd.priority must be an int"):
        CallbackRunner([odd])
    with pytest.raises(ValueError, match=r"Odd.priority must be an int"):
        HpoAdapter(odd)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda trainer: None, "takes HPO-trainer TrainingCallback objects.*got function"),
        ("on_val_end", "takes HPO-trainer TrainingCallback objects.*got str"),
        (Record, "the class Record; write Record()"),
    ],
)
def test_objects_that_are_not_callbacks_are_refused(bad, message):
    with pytest.raises(TypeError, match=message):
        CallbackRunner([bad])


def test_a_runner_needs_a_list_of_distinct_callbacks():
    record = Record([])
    with pytest.raises(TypeError, match=r"got a single Record; write CallbackRunner\(\[callback"):
        CallbackRunner(record)
    with pytest.raises(ValueError, match="in the list twice"):
        CallbackRunner([record, record])
    with pytest.raises(TypeError, match="HpoAdapter wraps an HPO-trainer TrainingCallback"):
        HpoAdapter(NaNDetectionCallback())


def test_firing_a_runner_that_holds_native_callbacks_says_where_they_run():
    # The nine built-ins are fired through their HPO-trainer faces (see
    # tests/test_builtins_hpo_trainer.py); any other native callback still runs only in a Trainer.
    runner = CallbackRunner([Record([]), NativeProbe([], "probe", 30)])
    with pytest.raises(TypeError, match=r"NativeProbe are native.*runner\.native\(\)"):
        runner.fire("on_train_begin", trainer=None)
    CallbackRunner([Record([]), NaNDetectionCallback()]).fire("on_train_begin", trainer=None)


def test_a_stop_flag_left_set_after_training_does_not_stop_a_direct_evaluation(make_trainer):
    stops = StopsAt(0, "should_stop")
    trainer = make_trainer(as_native(stops), eval_n=8, max_epochs=3)
    trainer.train()
    trainer.evaluate()
    assert not trainer.control.stop_requested


@pytest.mark.slow
def test_the_w_and_b_logger_gets_what_an_hpo_callback_stored(make_trainer, monkeypatch, tmp_path):
    from hookloop.callbacks.wandb_logger import offline_history
    from hookloop.compat.hpo import WandbLoggingCallback

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    runner = CallbackRunner(
        [WandbLoggingCallback(dir=tmp_path, mode="offline"), hpo_best_loss_tracker()()]
    )
    evals = EvalLosses()
    trainer = make_trainer([*runner.native(), evals], n=8, eval_n=8, max_epochs=2, log_every=1)
    trainer.train()

    rows = offline_history(tmp_path / "wandb", wait_s=30)
    logged = {r["_step"]: r.get("train/best_val_loss") for r in rows if "train/loss" in r}
    first_eval = evals.seen[0][1]  # the best at steps 3 and 4 (the second comes after step 4)
    assert logged == {1: None, 2: None, 3: first_eval, 4: first_eval}
