"""What the dialects share (hookloop.compat._toolkit) as a user meets it: one adapter
mechanism, the same checks in every dialect, stateful HF callbacks that resume as
themselves, and other systems' names found in compat, not in the native hookloop.callbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import hookloop.callbacks
import hookloop.compat.hpo as hpo
from hookloop.compat._toolkit import DialectAdapter, adapt, adapter_class, is_stateful
from hookloop.compat.hf import Trainer, TrainerCallback, TrainingArguments
from hookloop.compat.megatron_bridge.training.callbacks import Callback as MegatronCallback
from hookloop.compat.megatron_bridge.training.callbacks import CallbackManager
from hookloop.manager import CallbackManager as NativeManager
from hookloop.testing import TinyModel, ToyData


# -- one adapter mechanism -------------------------------------------------------------
class Counts(hpo.TrainingCallback):
    def __init__(self) -> None:
        self.ends = 0

    def on_train_end(self, trainer: Any, **kwargs: Any) -> None:
        self.ends += 1


def test_an_adapter_class_handles_exactly_the_native_events_it_was_made_for():
    made = adapter_class(hpo.HpoAdapter, frozenset({"on_train_end"}), False)
    assert made is adapter_class(hpo.HpoAdapter, frozenset({"on_train_end"}), False)  # once
    assert issubclass(made, hpo.HpoAdapter) and made.__name__ == "HpoAdapter"
    manager = NativeManager([hpo.adapt(Counts())])
    assert [e for e in manager.index if manager.has_callbacks(e)] == [
        "on_before_log",
        "on_train_end",
    ]


def test_an_adapter_base_called_directly_says_how_to_build_one():
    with pytest.raises(TypeError, match=r"HpoAdapter\(\.\.\.\) alone would handle no event.*adapt"):
        hpo.HpoAdapter(Counts())
    with pytest.raises(TypeError, match=r"DialectAdapter\(\.\.\.\) alone"):
        DialectAdapter(object())


def test_a_wrapped_callback_with_state_dict_is_checkpointed_through_its_adapter():
    class Stateful(Counts):
        def state_dict(self) -> dict[str, int]:
            return {"ends": self.ends}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.ends = state["ends"]

    adapter = hpo.adapt(Stateful())
    adapter.load_state_dict({"ends": 3})
    assert adapter.callback.ends == 3 and adapter.state_dict() == {"ends": 3}
    assert not is_stateful(hpo.adapt(Counts()))  # no state of its own: nothing checkpointed
    assert isinstance(adapt(hpo.HpoAdapter, Stateful(), ["on_train_end"]), hpo.HpoAdapter)


# -- the same checks in every dialect ---------------------------------------------------
class MegatronTypo(MegatronCallback):
    def on_train_ends(self, context: Any) -> None: ...


class HpoTypo(hpo.TrainingCallback):
    def on_train_ends(self, trainer: Any, **kwargs: Any) -> None: ...


class HFTypo(TrainerCallback):
    def on_train_ends(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...


def test_every_dialect_names_a_mistyped_hook_and_the_event_it_meant(caplog):
    meant = r"on_train_ends matches no .*event, so it would never run\. Did you mean 'on_train_end'"
    # Megatron-Bridge accepts other on_* methods: its dialect only logs a warning
    with caplog.at_level("WARNING"):
        CallbackManager().add(MegatronTypo())
    assert "MegatronTypo.on_train_ends matches no event" in caplog.text
    assert "Did you mean 'on_train_end'" in caplog.text
    with pytest.raises(ValueError, match="HpoTypo." + meant):
        hpo.CallbackRunner([HpoTypo()])
    with pytest.warns(UserWarning, match="HFTypo." + meant):
        Trainer(TinyModel(), _args(max_steps=1), train_dataset=ToyData(n=8), callbacks=[HFTypo()])


@pytest.mark.parametrize("priority", ["first", 2.5, False])
def test_every_dialect_that_orders_by_priority_refuses_one_that_is_not_an_int(priority):
    # (Megatron-Bridge's callbacks have no priority: they run in registration order.)
    counts = Counts()
    counts.priority = priority
    with pytest.raises(ValueError, match=r"Counts\.priority must be an int"):
        hpo.CallbackRunner([counts])


# -- stateful HF callbacks: several instances of one class -------------------------------
class StepCounter(TrainerCallback):
    """Counts the steps divisible by ``every``; checkpointed with state_dict (Forgather's way)."""

    def __init__(self, every: int) -> None:
        self.every, self.seen = every, 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every == 0:
            self.seen += 1

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _args(**fields: Any) -> TrainingArguments:
    defaults: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "logging_strategy": "no",
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": True,
    }
    return TrainingArguments(**{**defaults, **fields})


def test_two_instances_of_one_stateful_hf_callback_each_resume_their_own_state(tmp_path: Path):
    def run(max_steps: int, resume: str | None) -> tuple[StepCounter, StepCounter, Trainer]:
        every_step, every_other = StepCounter(1), StepCounter(2)
        args = _args(max_steps=max_steps, save_strategy="steps", save_steps=4)
        args.output_dir = str(tmp_path)
        trainer = Trainer(
            TinyModel(),
            args,
            train_dataset=ToyData(n=64),
            loss_fn=TinyModel.loss_fn,
            callbacks=[every_step, every_other],
            resume=resume,
        )
        trainer.train()
        return every_step, every_other, trainer

    first, second, _ = run(4, resume=None)
    assert (first.seen, second.seen) == (4, 2)
    first, second, trainer = run(6, resume="auto")
    # each resumed from its own count: 4 + steps 5, 6 and 2 + step 6 (swapped: 4 and 5)
    assert (first.seen, second.seen) == (6, 3)
    names = [cb.name for cb in trainer.callbacks.callbacks if "StepCounter" in cb.name]
    assert names == ["StepCounter", "StepCounter#2"]


# -- other systems' names live in compat ------------------------------------------------
@pytest.mark.parametrize(
    ("name", "home", "native"),
    [
        ("NaNDetectionCallback", "hookloop.compat.hpo", "NaNDetection"),
        ("EarlyStoppingCallback", "hookloop.compat.hpo", "EarlyStopping"),
        ("CheckpointCallback", "hookloop.compat.hpo", "CheckpointPolicy"),
        ("PrunerCallback", "hookloop.compat.hpo", "OptunaPruning"),
        ("ProgressCallback", "hookloop.compat.forgather", "ProgressBar"),
        ("DiLoCoCallback", "hookloop.compat.forgather", "DiLoCo"),
    ],
)
def test_a_name_imported_from_native_callbacks_names_the_compat_module(
    name: str, home: str, native: str
):
    with pytest.raises(ImportError, match=rf"from {home} import {name}.*{native}"):
        exec(f"from hookloop.callbacks import {name}", {})
    with pytest.raises(ImportError, match=home):
        getattr(hookloop.callbacks, name)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchCallback'"):
        hookloop.callbacks.NoSuchCallback  # noqa: B018
    assert name not in hookloop.callbacks.__all__
    assert native in hookloop.callbacks.__all__
