"""What a script sees on the console when it swaps transformers' Trainer for the HF dialect.

Each case trains, evaluates and predicts a one-layer GPT-2 with transformers' own
``Trainer`` and with ``hookloop.compat.hf.Trainer`` (same arguments, data and starting
weights) and compares, line for line, what reached stdout and stderr (transformers'
tqdm bars and log dicts) and the messages of transformers' loggers. Runtime numbers
and tqdm's timing fields are masked; tqdm redraws only when forced (a huge
``mininterval``), so the bars drawn do not depend on how fast the machine is.
"""

from __future__ import annotations

import logging
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import tqdm.std  # noqa: E402

from hookloop.compat import hf  # noqa: E402
from hookloop.compat.hf import console  # noqa: E402
from test_hf_training_differential import (  # noqa: E402
    gpt2,
    one_thread,  # noqa: F401 - the module's autouse fixture: tiny models, one thread
    token_rows,
    tokenizer,
)

FACTORIES = {"hf": transformers.Trainer, "hookloop": hf.Trainer}
RUN = {"use_cpu": True, "report_to": "none", "per_device_train_batch_size": 2,
       "per_device_eval_batch_size": 4, "max_steps": 4, "logging_steps": 2,
       "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "no"}  # fmt: skip

#: tqdm's timing field, and the values of the log dicts' runtime and speed keys
TQDM_TIMING = re.compile(r"\[\d\d:\d\d<[^\]]*\]")
SPEED_VALUE = re.compile(r"'(\w*(?:runtime|per_second))': '[^']*'")
#: save_pretrained's bar, shown whatever disable_tqdm says (by transformers too)
SHARDS = "Writing model shards"
CURSOR_UP = "\x1b[A"  # tqdm moves up to clear a bar below the first


class Records(logging.Handler):
    """The messages of transformers' loggers, as ``(logger, level, message)``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.name, record.levelname, record.getMessage()))


@pytest.fixture
def verbosity() -> Iterator[Any]:
    """transformers' verbosity, set as the example scripts set it, restored afterwards."""
    before = transformers.utils.logging.get_verbosity()
    yield transformers.utils.logging.set_verbosity
    transformers.utils.logging.set_verbosity(before)


@pytest.fixture(autouse=True)
def bars_drawn_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """tqdm redraws a bar on an update only after ``mininterval`` seconds: made huge,
    bars are drawn when opened, written under and closed, however slow the machine."""
    original = tqdm.std.tqdm.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["mininterval"] = 1e9
        original(self, *args, **kwargs)

    monkeypatch.setattr(tqdm.std.tqdm, "__init__", init)


def rows(n: int, seed: int, note: bool) -> Any:
    """Token rows as a list of samples, or (``note``) a ``datasets.Dataset`` with a column
    ``note`` the model does not take."""
    samples = [{"input_ids": r} for r in token_rows(n, seed=seed)]
    if not note:
        return samples
    import datasets

    return datasets.Dataset.from_list([{**sample, "note": "x"} for sample in samples])


def trainer_of(kind: str, out: Path, note: bool = False, **overrides: Any) -> Any:
    """``kind``'s Trainer of the tiny GPT-2 writing to ``out``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(output_dir=str(out), **{**RUN, **overrides})
        return FACTORIES[kind](
            gpt2(),
            args,
            train_dataset=rows(24, 1, note),
            eval_dataset=rows(6, 2, note),
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
            processing_class=tokenizer(),
        )


def run(
    kind: str, out: Path, capsys: Any, resume: str | None = None, note: bool = False,
    **overrides: Any,
) -> tuple[list[str], list[tuple]]:  # fmt: skip
    """Train (from ``out/resume`` when given), evaluate, predict and save the model with
    ``kind``'s Trainer: the console's lines (stdout, then stderr) and transformers' log
    records, the output folder named ``OUT``."""
    records = Records()
    library = logging.getLogger("transformers")
    library.addHandler(records)
    capsys.readouterr()
    try:
        trainer = trainer_of(kind, out, note, **overrides)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=str(out / resume) if resume else None)
            trainer.evaluate()
            trainer.predict(rows(5, 3, note))
            trainer.save_model()  # as the example scripts end
    finally:
        library.removeHandler(records)
    captured = capsys.readouterr()
    lines = [*masked(captured.out, out), "-- stderr --", *redraws_sorted(masked(captured.err, out))]
    seen = [
        (name, level, message.replace(str(out), "OUT")) for name, level, message in records.seen
    ]
    return lines, seen


def masked(text: str, out: Path) -> list[str]:
    """``text`` as the lines a terminal would have drawn (each ``\\r`` starts one), with
    the timings masked and runs of spaces (tqdm's clearing, sized by the bar it clears)
    made one."""
    text = SPEED_VALUE.sub(r"'\1': 'T'", TQDM_TIMING.sub("[T]", text.replace(str(out), "OUT")))
    parts = re.split(r"[\r\n]", text)
    return [re.sub(r" +", " ", part).strip() for part in parts if part.strip()]


def redraws_sorted(lines: list[str]) -> list[str]:
    """The bars' lines with each redraw's lines sorted: after writing a line under the
    bars, tqdm redraws them in the order of a ``WeakSet`` (by memory address), which no
    two runs need share. A redraw ends where a bar is cleared (a line moving up)."""
    groups: list[list[str]] = [[]]
    for line in lines:
        if line == CURSOR_UP:
            groups += [[line], []]
        else:
            groups[-1].append(line)
    return [line for group in groups for line in sorted(group)]


def both(tmp_path: Path, capsys: Any, **overrides: Any) -> dict[str, tuple[list[str], list]]:
    return {kind: run(kind, tmp_path / kind, capsys, **overrides) for kind in FACTORIES}


def trainer_lines(records: list[tuple[str, str, str]]) -> list[str]:
    return [message for name, _, message in records if name == "transformers.trainer"]


def assert_same_console(runs: dict[str, tuple[list[str], list]]) -> None:
    (theirs, their_records), (ours, our_records) = runs["hf"], runs["hookloop"]
    assert ours == theirs
    assert trainer_lines(our_records) == trainer_lines(their_records)


def assert_same_console_but_the_tied_warning(runs: dict[str, tuple[list[str], list]]) -> None:
    """As :func:`assert_same_console`, but for the one warning transformers adds as it
    loads a checkpoint of the tied GPT-2: its own save left the tied head out and it loads
    non-strictly; the dialect's checkpoint holds it (docs/transformers-trainer.md)."""
    (theirs, their_records), (ours, our_records) = runs["hf"], runs["hookloop"]
    assert ours == theirs
    tied = "There were missing keys in the checkpoint model loaded: ['lm_head.weight']."
    assert [r for r in their_records if r[1] == "WARNING" and r[0] == "transformers.trainer"] == [
        ("transformers.trainer", "WARNING", tied)
    ]
    assert trainer_lines(our_records) == [m for m in trainer_lines(their_records) if m != tied]


def test_info_level_shows_transformers_bars_logs_and_lines(tmp_path, capsys, verbosity):
    verbosity(logging.INFO)
    runs = both(tmp_path, capsys)
    assert_same_console(runs)
    lines, records = runs["hookloop"]
    # what was compared is transformers' console: bars, log dicts, its info lines
    assert any(line.startswith("{'loss': ") and "'grad_norm': " in line for line in lines)
    assert any(line.startswith("{'train_runtime': 'T'") for line in lines)
    assert any(line.startswith("100%|██████████| 4/4") for line in lines)
    messages = trainer_lines(records)
    assert "***** Running training *****" in messages
    assert messages.count("\n***** Running Evaluation *****") == 3
    assert messages.count("\n***** Running Prediction *****") == 1
    assert "  Num examples = 5" in messages
    assert messages[-1] == "Saving model checkpoint to OUT"


def test_columns_the_model_does_not_take_are_named_as_transformers_names_them(
    tmp_path, capsys, verbosity
):
    verbosity(logging.INFO)
    runs = both(tmp_path, capsys, note=True)
    assert_same_console(runs)
    messages = trainer_lines(runs["hookloop"][1])
    named = [m.split(" don't")[0] for m in messages if m.startswith("The following columns")]
    sets = ["Training", "Evaluation", "Evaluation", "Evaluation", "test"]
    assert named == [f"The following columns in the {s} set" for s in sets]
    assert "ignored: note. If note are not expected by `GPT2LMHeadModel.forward`" in messages[1]


def test_a_saved_checkpoint_is_announced_under_its_final_name(tmp_path, capsys, verbosity):
    verbosity(logging.INFO)
    runs = both(tmp_path, capsys, save_strategy="steps", save_steps=2)
    assert_same_console(runs)
    (_, theirs), (_, ours) = runs["hf"], runs["hookloop"]
    saved = [record for record in ours if "saved in" in record[2] or "Saving" in record[2]]
    assert saved == [r for r in theirs if "saved in" in r[2] or "Saving" in r[2]]
    assert ("transformers.trainer", "INFO", "Saving model checkpoint to OUT/checkpoint-2") in ours
    assert not [record for record in ours if ".partial" in record[2]]


@pytest.mark.parametrize(
    ("greater_is_better", "best", "deleted"),
    [
        (False, "checkpoint-4", []),  # the newest is the best: step 2 went in training
        (True, "checkpoint-2", ["checkpoint-4"]),  # kept beside the best, deleted at the end
    ],
)
def test_the_best_checkpoint_is_loaded_and_the_others_deleted_aloud(
    tmp_path, capsys, verbosity, greater_is_better, best, deleted
):
    verbosity(logging.INFO)
    runs = both(tmp_path, capsys, save_strategy="steps", save_steps=2, save_total_limit=1,
                load_best_model_at_end=True, metric_for_best_model="eval_loss",
                greater_is_better=greater_is_better)  # fmt: skip
    assert_same_console_but_the_tied_warning(runs)
    messages = trainer_lines(runs["hookloop"][1])
    loading = [m for m in messages if m.startswith("Loading best model from ")]
    assert len(loading) == 1 and loading[0].startswith(f"Loading best model from OUT/{best} (")
    assert [m for m in messages if m.startswith("Deleting")] == [
        f"Deleting older checkpoint [OUT/{name}] due to args.save_total_limit" for name in deleted
    ]
    assert sorted(p.name for p in (tmp_path / "hookloop").glob("checkpoint-*")) == [best]


def test_a_resumed_run_says_where_it_resumes_as_transformers(tmp_path, capsys, verbosity):
    verbosity(logging.WARNING)
    saving = {"save_strategy": "steps", "save_steps": 2, "max_steps": 6}
    for kind in FACTORIES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer_of(
                kind, tmp_path / kind, max_steps=2, save_strategy="steps", save_steps=2
            ).train()
    verbosity(logging.INFO)
    runs = {
        kind: run(kind, tmp_path / kind, capsys, "checkpoint-2", **saving) for kind in FACTORIES
    }
    assert_same_console_but_the_tied_warning(runs)
    messages = trainer_lines(runs["hookloop"][1])
    assert "Loading model from OUT/checkpoint-2." in messages
    assert "  Resuming training from checkpoint with epoch 0 and global step 2" in messages
    assert (
        "  Fast-forwarding the dataloader past 0 epochs and 2 batches to resume from the exact "
        "training state." in messages
    )


def test_a_run_resumed_from_transformers_own_checkpoint_says_so_as_transformers(
    tmp_path, capsys, verbosity
):
    """Both Trainers resume from the same ``checkpoint-2`` that transformers' Trainer
    wrote: the dialect announces the epoch, step and batches skipped as transformers does."""
    verbosity(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer_of("hf", tmp_path / "hf", max_steps=2, save_strategy="steps", save_steps=2).train()
    shutil.copytree(tmp_path / "hf", tmp_path / "hookloop")
    verbosity(logging.INFO)
    saving = {"save_strategy": "steps", "save_steps": 2, "max_steps": 6}
    runs = {
        kind: run(kind, tmp_path / kind, capsys, "checkpoint-2", **saving) for kind in FACTORIES
    }
    assert_same_console_but_the_tied_warning(runs)
    assert "  Resuming training from checkpoint with epoch 0 and global step 2" in (
        trainer_lines(runs["hookloop"][1])
    )


def test_disable_tqdm_prints_the_log_dicts_as_transformers(tmp_path, capsys, verbosity):
    verbosity(logging.INFO)
    runs = both(tmp_path, capsys, disable_tqdm=True)
    assert_same_console(runs)
    lines, _ = runs["hookloop"]
    assert not [line for line in lines if "%|" in line and not line.startswith(SHARDS)]
    assert "{'loss': '3.178', 'grad_norm': '1.609', 'learning_rate': '3.75e-05', " \
        "'epoch': '0.1667'}" in lines  # fmt: skip


def test_warning_level_shows_the_bars_and_no_info_line(tmp_path, capsys, verbosity):
    verbosity(logging.WARNING)
    runs = both(tmp_path, capsys)
    assert_same_console(runs)
    lines, records = runs["hookloop"]
    assert any("%|" in line for line in lines)
    assert trainer_lines(records) == []


def test_error_level_turns_the_bars_off_as_transformers_decides(tmp_path, capsys, verbosity):
    # transformers' arguments leave disable_tqdm None, then decide it from their logger
    verbosity(logging.ERROR)
    runs = both(tmp_path, capsys)
    assert_same_console(runs)
    lines, _ = runs["hookloop"]
    assert not [line for line in lines if "%|" in line and not line.startswith(SHARDS)]
    assert any(line.startswith("{'eval_loss': ") for line in lines)


def test_hookloops_table_is_shown_when_asked_for(tmp_path, capsys, verbosity, monkeypatch):
    verbosity(logging.WARNING)
    monkeypatch.setenv(console.CONSOLE_VARIABLE, "hookloop")
    lines, _ = run("hookloop", tmp_path / "hookloop", capsys)
    header = [line for line in lines if line.split()[:3] == ["step", "loss", "grad_norm"]]
    assert header, lines
    assert not [line for line in lines if line.startswith("{'loss'")]


def test_an_unknown_console_is_refused_with_the_allowed_ones(tmp_path, monkeypatch):
    monkeypatch.setenv(console.CONSOLE_VARIABLE, "rich")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **RUN)
    with pytest.raises(ValueError, match=r"HOOKLOOP_HF_CONSOLE='rich'.*transformers, hookloop"):
        hf.Trainer(gpt2(), args, train_dataset=[{"input_ids": r} for r in token_rows(4, seed=1)])
