"""No value wedges a run, no failure deletes a run's data, no journal is replayed unchecked.

Each test is one case a red-team round found. Its docstring says what happened before;
where the old behaviour can still be shown (a raw optimizer step, the unchecked reader)
the test shows it first, then asserts what hookloop does now.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _cli_run import run_cli as _run
from _quiet import SERVICES_OFF
from hookloop import Callback
from hookloop.app.cli import main
from hookloop.journal import Journal, JournalWriteError, read_records
from hookloop.loop import changes as changes_module
from hookloop.loop.changes import append_change, read_changes, read_replayable
from hookloop.loop.live import SettingError
from hookloop.loop.live_values import positive

QUIET = ("logging.progress=false", "callbacks.info=false", *SERVICES_OFF)
MLP = ("--recipe", "mlp-regression")


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 4-step mlp-regression run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("safety") / "run"
    code, _, err = _run(["train", *MLP, "--out", run, "train.max_steps=4", "checkpoint.every=2",
                         *QUIET])  # fmt: skip
    assert code == 0, err
    return run


def _copy(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest)
    (dest / ".lock").unlink(missing_ok=True)
    return dest


def _back_to_step_2(run: Path) -> None:
    """As if the run had been killed after its checkpoint at step 2."""
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-00000004")
    (run / "checkpoints" / "latest").write_text("step-00000002")


def _record(ident: str, step: int, values: dict, **extra) -> dict:
    return {"id": ident, "step": step, "values": values, "client": "test", "time": 0.0, **extra}


# -- 1. no value wedges a run ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"lr": 1e39}, ["lr=1e+39 is out of range: allowed (0, 1000]"]),
        ({"lr_scale": 1e300}, ["lr_scale=1e+300 is out of range", "lr is allowed (0, 1000]"]),
        ({"weight_decay": 1e39}, ["weight_decay=1e+39 is out of range: allowed [0, 1000]"]),
        ({"eps": 1e39}, ["eps=1e+39 is out of range: allowed (0, 1000]"]),
    ],
)
def test_a_live_value_the_optimizer_cannot_take_is_refused_in_one_line(values, words):
    """Before: the value is finite and positive, so it was accepted; the next optimizer step
    overflowed (a traceback, exit 1) and every --resume auto replayed it and died again."""
    from test_live_settings import make

    key, value = next(iter(values.items()))
    assert positive(key, value) == value  # the old check: finite and > 0, accepted
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="overflow"):  # what the optimizer then did
        torch.optim.SGD([weight], lr=1e39).step()
    trainer = make()
    before = trainer.parts.live.values()
    with pytest.raises(SettingError) as refused:
        trainer.parts.live.check(values)
    message = str(refused.value)
    assert all(w in message for w in words) and "\n" not in message, message
    assert trainer.parts.live.values() == before


def test_a_start_lr_typo_is_one_line_and_leaves_nothing(tmp_path):
    """Before: optimizer.lr=3e40 (for 3e-4) gave a traceback from torch's SGD at step 1."""
    run = tmp_path / "run"
    code, _, err = _run(["train", *MLP, "--out", run, "optimizer.lr=3e40", *QUIET])
    assert code == 2, err
    assert "lr=3e+40 is out of range: allowed (0, 1000]" in _error_line(err)
    assert not run.exists()  # refused before training began: nothing to keep


class Boom(Callback):
    """A callback whose settable attribute cannot be set (its setter fails)."""

    settable = ("limit",)

    def __init__(self) -> None:
        self._limit = 1.0

    @property
    def limit(self) -> float:
        return self._limit

    @limit.setter
    def limit(self, value: float) -> None:
        if value > 1.5:
            raise RuntimeError("limit cannot go above 1.5")
        self._limit = value


def test_a_change_that_fails_half_applied_is_rolled_back_and_not_recorded(tmp_path, capsys):
    """Before: the lr of the same set was already changed when the next key failed, and the
    record was in changes.jsonl: the run went on half-changed, and a resume replayed it."""
    from test_live_settings import RecordLR, Steer, make

    lrs = RecordLR()
    out = tmp_path / "run"
    steer = Steer({2: {"lr": 0.02, "weight_decay": 0.3, "Boom.limit": 2.0}})
    trainer = make(out, [Boom(), steer, lrs], steps=4, schedule="constant")
    trainer.train()
    live = trainer.parts.live
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]
    assert set(lrs.lrs.values()) == {0.01}  # never changed, not even for one step
    assert live.history == [] and not (out / "changes.jsonl").exists()
    (refused,) = live.refused
    assert refused["step"] == 2 and "limit cannot go above 1.5" in refused["reason"]
    assert "hookloop: set refused at step 2: applying it failed" in capsys.readouterr().err


class _FullDisk:
    """An open journal file on a full disk: every write fails with ENOSPC."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a+b")  # noqa: SIM115 (closed by close())

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


class _FullDiskJournal(Journal):
    def _open(self):
        if self._file is None:
            super()._open()
            self._file.close()
            self._file = _FullDisk(self.path)
        return self._file


def test_a_full_disk_names_the_file_and_what_is_intact(tmp_path):
    """Before: the append raised a bare '[Errno 28] No space left on device', naming no file."""
    path = tmp_path / "changes.jsonl"
    append_change(path, _record("1", 1, {"lr": 0.02}))
    whole = path.read_bytes()
    with pytest.raises(OSError) as naive:  # what the open file itself says
        _FullDisk(path).write(b"x")
    assert str(naive.value) == "[Errno 28] No space left on device"
    journal = _FullDiskJournal(path, fsync=True)
    with pytest.raises(JournalWriteError) as full:
        journal.append(_record("2", 2, {"lr": 0.03}))
    message = str(full.value)
    assert str(path) in message and "the changes.jsonl records before it are intact" in message
    assert full.value.errno == errno.ENOSPC and path.read_bytes() == whole


def test_a_set_whose_record_cannot_be_written_is_refused_not_applied(tmp_path, monkeypatch):
    """Before: the record's append failed after the set was answered, and the run died with
    a bare '[Errno 28]'. Now the record is written before any step uses the change; if it
    cannot be, the old values come back and the set is refused, saying which file."""
    from test_live_settings import RecordLR, Steer, make

    monkeypatch.setattr(changes_module, "Journal", _FullDiskJournal)
    lrs = RecordLR()
    trainer = make(tmp_path / "run", [Steer({2: {"lr": 0.02}}), lrs], steps=4,
                   schedule="constant")  # fmt: skip
    assert trainer.train().step == 4  # the run goes on
    assert set(lrs.lrs.values()) == {0.01}
    (refused,) = trainer.parts.live.refused
    assert "its record could not be written" in refused["reason"]
    assert "changes.jsonl" in refused["reason"] and "intact" in refused["reason"]
    assert trainer.parts.live.outcome(f"{2:020d}", 0)["applied"] is False


def test_a_resume_that_meets_a_record_it_cannot_apply_names_it_and_how_to_skip_it(
    trained, tmp_path
):
    """Before: a recorded lr=1e39 (accepted when it was set) killed every --resume auto."""
    run = _copy(trained, tmp_path / "run")
    _back_to_step_2(run)
    append_change(run / "changes.jsonl", _record("00000000000000000003", 3, {"lr": 1e39}))
    argv = ["train", "--out", run, "--resume", "auto", *QUIET]
    code, _, err = _run(argv)
    assert code == 2, err
    line = _error_line(err)
    assert "change 00000000000000000003 (step 3: lr=1e+39) cannot be applied" in line
    assert "--skip-change 00000000000000000003" in line
    code, _, err = _run([*argv, "--skip-change", "nosuchid"])
    assert code == 2 and "--skip-change nosuchid: " in _error_line(err)
    code, _, err = _run([*argv, "--skip-change", "00000000000000000003"])
    assert code == 0, err


# -- 2. no failure deletes a run's data ---------------------------------------------------------


class FailAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.step:
            raise RuntimeError("the user's callback failed")


RECIPE = """
from hookloop.recipes import Recipe, default_config, get_recipe
import test_run_safety


def _config():
    cfg = default_config("mlp-regression")
    cfg.recipe = "failing_recipe:RECIPE"
    return cfg


def _build(cfg):
    parts = get_recipe("mlp-regression").build(cfg)
    parts.callbacks.append(test_run_safety.FailAt(3))
    return parts


RECIPE = Recipe("failing", "mlp-regression failing at step 3", _config, _build)
"""


def test_a_run_that_fails_before_its_first_checkpoint_keeps_its_logs(tmp_path, monkeypatch):
    """Before: the whole run directory (metrics, changes.jsonl, TensorBoard, progress.txt)
    was removed as a 'failed start'."""
    (tmp_path / "failing_recipe.py").write_text(RECIPE)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    argv = ["train", "--recipe", "failing_recipe:RECIPE", "--out", run, "train.log_every=1",
            "checkpoint.every=100", "logging.progress=false", "control.enabled=false"]  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(RuntimeError, match="user's callback"):
        main([str(a) for a in argv])  # the user's bug: its traceback
    assert f"the run failed at step 3; what it wrote is kept in {run}" in err.getvalue()
    steps = [r["step"] for r in read_records(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert steps == [1, 2]
    assert (run / "progress.txt").stat().st_size and any((run / "tb").iterdir())


# -- 3. no journal is replayed unchecked -------------------------------------------------------


def _chained(path: Path, n: int = 3) -> list[dict]:
    for step in range(1, n + 1):
        append_change(path, _record(f"{step:020d}", step, {"lr": 0.01 * step}))
    return path.read_text().splitlines()


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def _hand_added(lines):
    return [*lines, json.dumps(_record("9" * 20, 9, {"lr": 1e9}))]


def _duplicated(lines):
    return [*lines, lines[1]]


def _copied_under_a_new_id(lines):
    copy = json.loads(lines[1])
    copy["id"], copy["step"] = "8" * 20, 8
    return [*lines, json.dumps(copy)]


def _edited(lines):
    edited = json.loads(lines[2])
    edited["values"] = {"lr": 1e9}
    return [*lines[:2], json.dumps(edited)]


def _reordered(lines):
    return [lines[0], lines[2], lines[1]]


SKIP = "--skip-change {ident}, or move changes.jsonl aside"


@pytest.mark.parametrize(
    ("tamper", "line", "ident", "problem", "hint"),
    [
        (_hand_added, 4, "9" * 20, "it carries no chain hash: it was not written by hookloop",
         SKIP),
        (_duplicated, 4, f"{2:020d}", "it repeats an earlier record",
         "delete line 4 of changes.jsonl (a copy)"),
        (_copied_under_a_new_id, 4, "8" * 20, "its contents do not match its hash", SKIP),
        (_edited, 3, f"{3:020d}", "its contents do not match its hash: it was edited", SKIP),
        (_reordered, 2, f"{3:020d}", "it does not follow the record before it", SKIP),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)  # fmt: skip
def test_a_record_added_edited_reordered_or_duplicated_by_hand_is_refused_by_name(
    tmp_path, tamper, line, ident, problem, hint
):
    """Before: any record in changes.jsonl was replayed without a word (a forged lr=1e9
    drove a run to NaN)."""
    path = tmp_path / "changes.jsonl"
    _write(path, tamper(_chained(path)))
    assert len(read_changes(path)) >= 3  # the unchecked reader (the old replay) takes it all
    with pytest.raises(ValueError) as refused:
        read_replayable(path)
    message = str(refused.value)
    assert f"{path}:{line}: change {ident} (step" in message and problem in message, message
    assert hint.format(ident=ident) in message and "\n" not in message
    if hint == SKIP:  # the way on that the message names
        assert ident not in [r["id"] for r in read_replayable(path, {ident})]


def test_a_file_written_before_chaining_is_read_with_one_warning_and_goes_on_chained(
    tmp_path, capsys
):
    path = tmp_path / "changes.jsonl"
    _write(path, [json.dumps(_record(f"{s:020d}", s, {"lr": 0.01})) for s in (1, 2)])
    assert [r["step"] for r in read_replayable(path)] == [1, 2]
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "2 record(s) written before" in err
    append_change(path, _record(f"{3:020d}", 3, {"lr": 0.02}))  # a new one is chained
    assert [r["step"] for r in read_replayable(path)] == [1, 2, 3]


def test_a_record_without_a_client_is_replayed_not_a_keyerror(trained, tmp_path):
    """Before: a record without "client" stopped the resume with a KeyError traceback."""
    run = _copy(trained, tmp_path / "run")
    _back_to_step_2(run)
    record = _record(f"{3:020d}", 3, {"lr": 0.02})
    del record["client"]
    append_change(run / "changes.jsonl", record)
    code, _, err = _run(["train", "--out", run, "--resume", "auto", *QUIET])
    assert code == 0, err
    sets = [r for r in read_records(run / "metrics.jsonl") if r.get("kind") == "set"]
    assert [(r["step"], r["key"], r["new"], r["client"]) for r in sets] == [
        (3, "lr", 0.02, "unknown")
    ]


def test_replay_fails_when_a_recorded_change_cannot_be_applied(trained, tmp_path):
    """Before: --replay printed 'set not applied' and exited 0, reproducing another run."""
    source = _copy(trained, tmp_path / "source")
    append_change(source / "changes.jsonl", _record(f"{2:020d}", 2, {"lr": 1e39}))
    code, _, err = _run(["train", "--replay", source, "--out", tmp_path / "replay", *QUIET])
    assert code == 2, err
    assert f"--skip-change {2:020d}" in _error_line(err)


def test_a_resume_override_is_a_recorded_change_that_replay_reproduces(tmp_path):
    """Before: `--resume auto optimizer.lr=0.04` rewrote config.yaml and recorded nothing,
    so --replay trained with lr=0.04 from step 0 and ended on other weights, silently."""
    run, replay = tmp_path / "run", tmp_path / "replay"
    first = ["train", *MLP, "--out", run, "train.max_steps=4", "checkpoint.every=2", *QUIET]
    assert _run(first)[0] == 0
    code, _, err = _run(["train", "--out", run, "--resume", "auto", "train.max_steps=8",
                         "optimizer.lr=0.04", *QUIET])  # fmt: skip
    assert code == 0, err
    (override,) = read_changes(run / "changes.jsonl")
    assert (override["step"], override["values"]) == (4, {"lr": 0.04})
    assert override["client"] == "resume-override"
    code, _, err = _run(["train", "--replay", run, "--out", replay, *QUIET])
    assert code == 0, err
    final = "checkpoints/step-00000008/model.safetensors"
    a, b = load_file(run / final), load_file(replay / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- the control server's answer ---------------------------------------------------------------


GUARDED_RECIPE = """
import time
from hookloop import Callback
from hookloop.recipes import Recipe, default_config, get_recipe


class Guard(Callback):
    settable = ("limit",)

    def __init__(self):
        self._limit = 1.0

    @property
    def limit(self):
        return self._limit

    @limit.setter
    def limit(self, value):
        if value > 1.5:
            raise RuntimeError("limit cannot go above 1.5")
        self._limit = value

    def on_train_step_end(self, ctx):
        time.sleep(0.05)


def _config():
    cfg = default_config("mlp-regression")
    cfg.recipe = "guarded_recipe:RECIPE"
    return cfg


def _build(cfg):
    parts = get_recipe("mlp-regression").build(cfg)
    parts.callbacks.append(Guard())
    return parts


RECIPE = Recipe("guarded", "mlp-regression with a setting that refuses values", _config, _build)
"""


def test_a_set_is_answered_applied_or_refused_with_its_reason(tmp_path, capsys):
    """Before: every set the server could parse was answered 'filed' (200), whether or not
    the loop then applied it: lr=1e39 was filed and the job died at its next step; a set
    whose setter failed was recorded and half-applied."""
    from test_live_settings import _cli, _client, _wait

    (tmp_path / "guarded_recipe.py").write_text(GUARDED_RECIPE)
    jobs = tmp_path / "jobs"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    path = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    env.update(HOOKLOOP_JOBS_DIR=str(jobs), OMP_NUM_THREADS="1", PYTHONPATH=path)
    argv = ["train", "--recipe", "guarded_recipe:RECIPE", "--out", str(tmp_path / "run"),
            "train.max_steps=100000", "logging.progress=false", "callbacks.info=false"]  # fmt: skip
    job = _cli(argv, env)
    try:
        client = _client(jobs, job.pid)
        _wait(client, lambda s: s["step"] >= 2, "step 2")
        ctl = ["ctl", "--jobs-dir", str(jobs), "set", client.job_id]
        assert main([*ctl, "lr=1e39"]) == 2  # checked before it is filed: HTTP 400
        assert "lr=1e+39 is out of range: allowed (0, 1000]" in capsys.readouterr().err
        assert main([*ctl, "lr=0.02"]) == 0
        assert "set applied at the end of step" in capsys.readouterr().out
        assert main([*ctl, "lr=0.03", "Guard.limit=2.0"]) == 1  # refused as applied: 409
        err = capsys.readouterr().err
        assert "set refused at step" in err and "limit cannot go above 1.5" in err
        status = client.status()
        assert status["settings"]["lr"] == 0.02 and status["settings"]["Guard.limit"] == 1.0
        assert [r["applied"] for r in status["refused"]] == [False]
        assert [r["values"] for r in status["changes"]] == [{"lr": 0.02}]
        assert main(["ctl", "--jobs-dir", str(jobs), client.job_id, "abort"]) == 0
        job.wait(60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    assert [r["values"] for r in read_changes(tmp_path / "run" / "changes.jsonl")] == [{"lr": 0.02}]


def test_a_resume_override_with_no_checkpoint_to_restore_is_config_not_a_change(trained, tmp_path):
    """A resume that finds no checkpoint trains from step 0 with the command line's values:
    they are what config.yaml records, and no change is recorded."""
    import shutil

    run = _copy(trained, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    code, _, err = _run(["train", "--out", run, "--resume", "auto", "optimizer.lr=0.04", *QUIET])
    assert code == 0, err
    assert "lr: 0.04" in (run / "config.yaml").read_text()
    assert not (run / "changes.jsonl").exists()


def test_skip_change_without_a_resume_or_replay_is_refused(tmp_path):
    code, _, err = _run(["train", *MLP, "--out", tmp_path / "run", "--skip-change", "1", *QUIET])
    assert code == 2 and "--skip-change leaves out a recorded change" in _error_line(err)
    assert not (tmp_path / "run").exists()
