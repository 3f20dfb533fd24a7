"""Run directories that cannot be corrupted, resumes that never start over silently, errors
in one line: bad input, a second writer, damaged checkpoints, failed runs."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import _zygote as zygote
from _cli_run import run_cli as _run
from _quiet import SERVICES_OFF
from _resign import Opaque, replace_trainer_state
from hookloop import CallbackManager, ExitCode
from hookloop.app.cli import main
from hookloop.app.runs import list_runs
from hookloop.callbacks import read_jsonl
from hookloop.loop.changes import read_changes
from hookloop.runlock import RunDirLocked, run_lock

QUIET = ("logging.progress=false", *SERVICES_OFF)
MLP = ("--recipe", "mlp-regression")


def _tree(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with its content hash: 'nothing changed on disk'."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 4-step mlp-regression run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("rel") / "run"
    argv = ["train", *MLP, "--out", run, "train.max_steps=4", "checkpoint.every=2"]
    argv += ["train.log_every=1", *QUIET]
    code, _, err = _run(argv)
    assert code == 0, err
    return run


def _copy(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest)
    return dest


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage_all(run: Path) -> None:
    for ckpt in (run / "checkpoints").glob("step-*"):
        _flip_byte(ckpt / "model.safetensors")


# Each case: how to set up tmp (returns the argv), the exit code, words in the one line.
def _file_as_out(tmp: Path, run: Path) -> list:
    (tmp / "afile").write_text("x")
    return ["train", *MLP, "--out", tmp / "afile", *QUIET]


def _unwritable_out(tmp: Path, run: Path) -> list:
    return ["train", *MLP, "--out", "/proc/hookloop-test/run", *QUIET]


def _bad_yaml(tmp: Path, run: Path) -> list:
    (tmp / "bad.yaml").write_text("train: {max_steps: [1, 2\n")
    return ["train", *MLP, "--config", tmp / "bad.yaml", "--out", tmp / "new", *QUIET]


def _dir_as_config(tmp: Path, run: Path) -> list:
    (tmp / "confdir").mkdir()
    return ["train", *MLP, "--config", tmp / "confdir", "--out", tmp / "new", *QUIET]


def _missing_resume(tmp: Path, run: Path) -> list:
    return ["train", *MLP, "--resume", tmp / "nowhere", "--out", tmp / "new", *QUIET]


def _not_a_checkpoint(tmp: Path, run: Path) -> list:
    (tmp / "empty").mkdir()
    return ["train", *MLP, "--resume", tmp / "empty", "--out", tmp / "new", *QUIET]


def _corrupt_explicit(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    _flip_byte(copy / "checkpoints" / "step-00000004" / "model.safetensors")
    return ["train", "--resume", copy / "checkpoints" / "step-00000004", "--out", copy, *QUIET]


def _other_models_checkpoint(tmp: Path, run: Path) -> list:
    ckpt = run / "checkpoints" / "step-00000004"
    return ["train", *MLP, "--resume", ckpt, "--out", tmp / "new", "model.hidden=7", *QUIET]


def _all_damaged(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    _damage_all(copy)
    return ["train", "--resume", "auto", "--out", copy, "train.max_steps=6", *QUIET]


def _frozen_key(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    return ["train", "--resume", "auto", "--out", copy, "model.hidden=9", *QUIET]


def _second_run_same_dir(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    return ["train", *MLP, "--out", copy, *QUIET]


def _unknown_key(tmp: Path, run: Path) -> list:
    return ["train", *MLP, "--out", tmp / "new", "train.max_stepz=3", *QUIET]


def _plot_unwritable(tmp: Path, run: Path) -> list:
    return ["plot", run, "--out", "/proc/hookloop-test/plot.png"]


def _out_in_a_checkpoint(tmp: Path, run: Path) -> list:
    return ["train", *MLP, "--out", run / "checkpoints" / "step-00000004", *QUIET]


def _out_through_a_symlink(tmp: Path, run: Path) -> list:
    (tmp / "link").symlink_to(run / "checkpoints")
    return ["train", *MLP, "--out", tmp / "link" / "new", *QUIET]


def _out_spelled_with_dotdot(tmp: Path, run: Path) -> list:
    return ["train", *MLP, "--out", f"{run}/checkpoints/../mine", *QUIET]


def _local_dir_in_another_run(tmp: Path, run: Path) -> list:
    local = ["checkpoint.local_every=1", f"checkpoint.local_dir={run}/local"]
    return ["train", *MLP, "--out", tmp / "new", *local, *QUIET]


def _unpicklable_trainer_state(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    ckpt = copy / "checkpoints" / "step-00000004"
    replace_trainer_state(ckpt, {"train_state": {"step": 4}, "x": Opaque()})
    return ["train", "--resume", ckpt, "--out", copy, "train.max_steps=6", *QUIET]


def _trainer_state_without_entries(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    ckpt = copy / "checkpoints" / "step-00000004"
    replace_trainer_state(ckpt, {})
    return ["train", "--resume", ckpt, "--out", copy, "train.max_steps=6", *QUIET]


def _empty_latest(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    (copy / "checkpoints" / "latest").write_text("")
    return ["train", "--resume", copy, "--out", copy, "train.max_steps=6", *QUIET]


def _invalid_run_config(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    (copy / "config.yaml").write_text("train: {max_steps: 3\n")
    return ["train", "--resume", "auto", "--out", copy, *QUIET]


def _huge_seed(tmp: Path, run: Path) -> list:
    return ["train", *MLP, "--out", tmp / "new", f"seed={2**70}", *QUIET]


def _infinite_lr(tmp: Path, run: Path) -> list:
    return ["train", *MLP, "--out", tmp / "new", "optimizer.lr=inf", *QUIET]


def _diloco_without_a_server(tmp: Path, run: Path) -> list:
    os.environ.pop("DILOCO_SERVER", None)
    return ["train", *MLP, "--out", tmp / "new", "callbacks.diloco=true", *QUIET]


def _model_too_large(tmp: Path, run: Path) -> list:
    return ["train", *MLP, "--out", tmp / "new", f"model.hidden={10**11}", *QUIET]


def _space(tmp: Path) -> Path:
    (tmp / "space.yaml").write_text("optimizer.lr: {low: 0.0001, high: 0.01, log: true}\n")
    return tmp / "space.yaml"


def _tune_unknown_storage(tmp: Path, run: Path) -> list:
    tune = ["tune", *MLP, "--space", _space(tmp), "--trials", "1", "--out", tmp / "study"]
    return [*tune, "--storage", "bogus://x", "--no-plots"]


def _damaged_study(tmp: Path) -> Path:
    from hookloop.tune.study import TuneSpec

    study = tmp / "study"
    study.mkdir()
    space = yaml.safe_load(_space(tmp).read_text())
    TuneSpec(recipe="mlp-regression", space=space, trials=1).save(study)
    (study / "study.db").write_bytes(b"not a database " * 100)
    (study / ".tune.lock").touch()  # as every study that ran has
    return study


def _tune_damaged_study_db(tmp: Path, run: Path) -> list:
    study = _damaged_study(tmp)
    return ["tune", *MLP, "--space", tmp / "space.yaml", "--trials", "1", "--out", study]


def _plot_damaged_study_db(tmp: Path, run: Path) -> list:
    return ["plot", _damaged_study(tmp), "--out", tmp / "plot.png"]


def _plot_non_utf8_metrics(tmp: Path, run: Path) -> list:
    copy = _copy(run, tmp / "copy")
    with (copy / "metrics.jsonl").open("ab") as f:
        f.write(b'{"kind": "train", "step": 9, "x": "\xff"}\n')
    return ["plot", copy, "--out", tmp / "plot.png"]


def _ctl_unknown_job(tmp: Path, run: Path) -> list:
    (tmp / "jobs").mkdir()
    return ["ctl", "nosuchjob", "status", "--jobs-dir", tmp / "jobs"]


def _jobs_bad_timeout(tmp: Path, run: Path) -> list:
    return ["jobs", "--timeout", "soon"]


def _runs_missing_dir(tmp: Path, run: Path) -> list:
    return ["runs", tmp / "nowhere"]


DILOCO_TOKEN = "reliability-diloco-token-0123456789"


def _serve(tmp: Path, *extra) -> list:
    return ["diloco", "serve", "-o", tmp / "out", "-n", "1", "--port", "0",
            "--token", DILOCO_TOKEN, *extra]  # fmt: skip


def _server_checkpoint(where: Path, truncate: str | None = None) -> Path:
    """A DiLoCo server checkpoint of the mlp-regression model, one file cut in half."""
    from hookloop.diloco import storage
    from hookloop.recipes import default_config, get_recipe

    model = get_recipe("mlp-regression").build(default_config("mlp-regression")).model
    storage.save_initial(where, model)
    import torch

    torch.save({"outer_optimizer": {}, "sync_round": 3}, where / storage.SERVER_STATE)
    if truncate is not None:
        data = (where / truncate).read_bytes()
        (where / truncate).write_bytes(data[: len(data) // 2])
    return where


def _serve_file_as_output_dir(tmp: Path, run: Path) -> list:
    (tmp / "afile").write_text("x")
    return ["diloco", "serve", "-o", tmp / "afile", "-n", "1", "--token", DILOCO_TOKEN]


def _serve_truncated_server_state(tmp: Path, run: Path) -> list:
    ckpt = _server_checkpoint(tmp / "ckpt", truncate="server_state.pt")
    return _serve(tmp, "--from-checkpoint", ckpt)


def _serve_truncated_weights(tmp: Path, run: Path) -> list:
    ckpt = _server_checkpoint(tmp / "ckpt", truncate="model.safetensors")
    return _serve(tmp, "--from-checkpoint", ckpt)


def _serve_only_checkpoint_truncated(tmp: Path, run: Path) -> list:
    _server_checkpoint(tmp / "out" / "checkpoints" / "checkpoint-3", truncate="server_state.pt")
    return _serve(tmp)


def _serve_missing_certfile(tmp: Path, run: Path) -> list:
    ckpt = _server_checkpoint(tmp / "ckpt")
    return _serve(tmp, "-c", ckpt, "--certfile", tmp / "cert.pem", "--keyfile", tmp / "key.pem")


def _serve_zero_payload_cap(tmp: Path, run: Path) -> list:
    return _serve(tmp, "-c", _server_checkpoint(tmp / "ckpt"), "--max-payload-mb", "0")


BAD_INPUT = [
    (_file_as_out, ExitCode.USAGE, ["afile", "is a file"]),
    (_unwritable_out, ExitCode.USAGE, ["/proc/hookloop-test"]),
    (_bad_yaml, ExitCode.USAGE, ["bad.yaml"]),
    (_dir_as_config, ExitCode.USAGE, ["confdir"]),
    (_missing_resume, ExitCode.USAGE, ["nowhere", "does not exist"]),
    (_not_a_checkpoint, ExitCode.USAGE, ["empty", "manifest.json"]),
    (_corrupt_explicit, ExitCode.USAGE, ["model.safetensors", "checksum"]),
    (_other_models_checkpoint, ExitCode.USAGE, ["do not fit the model"]),
    (_all_damaged, ExitCode.USAGE, ["no intact checkpoint", "step-00000002", "--allow-restart"]),
    (_frozen_key, ExitCode.USAGE, ["model.hidden cannot change on resume"]),
    (_second_run_same_dir, ExitCode.USAGE, ["already holds a run", "--resume auto"]),
    (_unknown_key, ExitCode.USAGE, ["max_stepz"]),
    (_plot_unwritable, ExitCode.USAGE, ["/proc/hookloop-test"]),
    (_out_in_a_checkpoint, ExitCode.USAGE, ["lies inside the checkpoints folder", "another"]),
    (_out_through_a_symlink, ExitCode.USAGE, ["link/new", "lies inside the checkpoints"]),
    (_out_spelled_with_dotdot, ExitCode.USAGE, ["lies inside the run directory"]),
    (_local_dir_in_another_run, ExitCode.USAGE, ["checkpoint.local_dir", "lies inside the run"]),
    (_unpicklable_trainer_state, ExitCode.USAGE, ["trainer_state.pt cannot be loaded"]),
    (_trainer_state_without_entries, ExitCode.USAGE, ["trainer_state.pt", "no 'train_state'"]),
    (_empty_latest, ExitCode.USAGE, ["latest is empty", "--resume auto"]),
    (_invalid_run_config, ExitCode.USAGE, ["copy/config.yaml is not valid YAML", "line 2"]),
    (_huge_seed, ExitCode.USAGE, ["seed must be an int >= 0 and <= 2**47", str(2**70)]),
    (_infinite_lr, ExitCode.USAGE, ["optimizer.lr must be a finite number", "inf"]),
    (_diloco_without_a_server, ExitCode.USAGE, ["callbacks.diloco=true", "DILOCO_SERVER"]),
    (_model_too_large, ExitCode.ERROR, ["out of memory", "smaller model"]),
    (_tune_unknown_storage, ExitCode.USAGE, ["--storage bogus://x", "cannot open"]),
    (_tune_damaged_study_db, ExitCode.USAGE, ["study.db", "cannot open", "not a database"]),
    (_plot_damaged_study_db, ExitCode.USAGE, ["study.db", "cannot open", "not a database"]),
    (_plot_non_utf8_metrics, ExitCode.USAGE, ["metrics.jsonl is not UTF-8", "JSON Lines"]),
    (_ctl_unknown_job, ExitCode.USAGE, ["no live job 'nosuchjob'"]),
    (_jobs_bad_timeout, ExitCode.USAGE, ["--timeout", "soon"]),
    (_runs_missing_dir, ExitCode.USAGE, ["nowhere", "not a directory"]),
    (_serve_file_as_output_dir, ExitCode.USAGE, ["output dir", "afile is a file"]),
    (_serve_truncated_server_state, ExitCode.USAGE, ["server_state.pt is damaged or truncated"]),
    (_serve_truncated_weights, ExitCode.USAGE, ["model.safetensors is damaged or truncated"]),
    (_serve_only_checkpoint_truncated, ExitCode.USAGE, ["no intact checkpoint", "checkpoint-3"]),
    (_serve_missing_certfile, ExitCode.USAGE, ["certfile", "cert.pem does not exist"]),
    (_serve_zero_payload_cap, ExitCode.USAGE, ["max_payload_mb must be an int >= 1", "0"]),
]


@pytest.mark.parametrize(
    ("setup", "code", "words"), BAD_INPUT, ids=[c[0].__name__ for c in BAD_INPUT]
)
def test_bad_input_is_one_line_with_its_exit_code_and_changes_nothing(
    setup, code, words, trained, tmp_path
):
    _one_line_and_nothing_changed(setup(tmp_path, trained), code, words, trained, tmp_path)


def _one_line_and_nothing_changed(argv, code, words, trained, tmp_path) -> None:
    before, run_before = _tree(tmp_path), _tree(trained)

    got, _, err = _run(argv)

    assert got == code, err
    lines = [line for line in err.splitlines() if line.startswith("hookloop ")]
    error_lines = [line for line in lines if ": error: " in line]
    assert len(error_lines) == 1, err
    assert "Traceback" not in err and "<unicode string>" not in err
    for word in words:
        assert word in error_lines[0], (word, error_lines[0])
    assert _tree(tmp_path) == before  # nothing written, nothing removed
    assert _tree(trained) == run_before


# DiLoCo workers (`hookloop train` with DILOCO_SERVER) against a server in this process.
def _worker(tmp: Path, env: dict, *extra) -> tuple[dict, list]:
    env = {"DILOCO_HEARTBEAT_INTERVAL": "0", "DILOCO_TOKEN": DILOCO_TOKEN, **env}
    return env, ["train", *MLP, "--out", tmp / "new", "train.max_steps=2", *extra, *QUIET]


def _worker_server_unreachable(tmp: Path, srv) -> tuple[dict, list]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    return _worker(tmp, {"DILOCO_SERVER": f"127.0.0.1:{closed}"})


def _worker_wrong_token(tmp: Path, srv) -> tuple[dict, list]:
    return _worker(tmp, {"DILOCO_SERVER": srv.address, "DILOCO_TOKEN": "x" * 20})


def _worker_evicted(tmp: Path, srv) -> tuple[dict, list]:
    import torch

    from hookloop.diloco.client import DiLoCoClient, ServerRefused

    client = DiLoCoClient(srv.address, timeout=10, token=DILOCO_TOKEN)
    nan = {n: torch.full_like(t, float("nan")) for n, t in client.register("w-bad").items()}
    for _ in range(3):
        with contextlib.suppress(ServerRefused):
            client.submit_pseudogradients("w-bad", nan)
    return _worker(tmp, {"DILOCO_SERVER": srv.address, "DILOCO_WORKER_ID": "w-bad"})


def _worker_another_model(tmp: Path, srv) -> tuple[dict, list]:
    return _worker(tmp, {"DILOCO_SERVER": srv.address}, "model.hidden=7")


def _worker_huge_heartbeat_interval(tmp: Path, srv) -> tuple[dict, list]:
    return _worker(tmp, {"DILOCO_SERVER": srv.address, "DILOCO_HEARTBEAT_INTERVAL": "1e9"})


def _worker_missing_cafile(tmp: Path, srv) -> tuple[dict, list]:
    server = f"https://{srv.address}"
    return _worker(tmp, {"DILOCO_SERVER": server, "DILOCO_CAFILE": str(tmp / "ca.pem")})


DILOCO_WORKER_INPUT = [
    (_worker_server_unreachable, ExitCode.ERROR, ["DiLoCo server", "unreachable", "gave up"]),
    (_worker_wrong_token, ExitCode.USAGE, ["answered 401 to /register", "Bearer"]),
    (_worker_evicted, ExitCode.USAGE, ["answered 409", "w-bad was evicted after 3 refused"]),
    (_worker_another_model, ExitCode.USAGE, ["has shape", "the server runs another model"]),
    (_worker_missing_cafile, ExitCode.USAGE, ["cafile", "ca.pem does not exist"]),
    (_worker_huge_heartbeat_interval, ExitCode.USAGE, ["DILOCO_HEARTBEAT_INTERVAL=1e9", "3600"]),
]


@pytest.fixture(scope="module")
def diloco_server(tmp_path_factory):
    from hookloop.diloco.server import DiLoCoServer

    where = tmp_path_factory.mktemp("diloco")
    start = _server_checkpoint(where / "start")
    (start / "server_state.pt").unlink()
    srv = DiLoCoServer(str(where / "out"), 1, str(start), port=0, token=DILOCO_TOKEN).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    ("setup", "code", "words"),
    DILOCO_WORKER_INPUT,
    ids=[c[0].__name__ for c in DILOCO_WORKER_INPUT],
)
def test_a_diloco_worker_that_cannot_join_is_one_line_with_its_exit_code(
    setup, code, words, trained, tmp_path, diloco_server, monkeypatch
):
    from hookloop.diloco.worker import DiLoCoWorker

    monkeypatch.setitem(DiLoCoWorker.__init__.__kwdefaults__, "retry_delay", 0.01)
    env, argv = setup(tmp_path, diloco_server)
    for name in ("DILOCO_CAFILE", "DILOCO_WORKER_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _one_line_and_nothing_changed(argv, code, words, trained, tmp_path)


def test_the_traceback_is_there_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKLOOP_DEBUG", "1")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(Exception, match="is a file"):
        main(["train", *MLP, "--out", str(tmp_path / "afile"), *QUIET])


def test_resume_auto_into_an_empty_place_says_it_starts_a_new_run(tmp_path):
    run = tmp_path / "fresh"
    code, _, err = _run(
        ["train", *MLP, "--resume", "auto", "--out", run, "train.max_steps=2", *QUIET]
    )
    assert code == 0, err
    assert f"no run in {run} yet; starting a new run in it" in err


def test_allow_restart_starts_over_when_every_checkpoint_is_damaged(trained, tmp_path):
    copy = _copy(trained, tmp_path / "copy")
    _damage_all(copy)
    argv = ["train", "--resume", "auto", "--allow-restart", "--out", copy, "train.max_steps=2"]
    with pytest.warns(UserWarning, match="every checkpoint in .* is damaged; starting over"):
        code, _, err = _run([*argv, *QUIET])
    assert code == 0, err
    (end,) = [r for r in read_jsonl(copy / "metrics.jsonl") if r["kind"] == "end"][-1:]
    assert end["step"] == 2  # trained from step 0 again


def test_resume_reads_the_runs_config_and_command_line_optimizer_values_win(trained, tmp_path):
    copy = _copy(trained, tmp_path / "copy")
    logged: list[float] = []
    argv = ["train", "--resume", "auto", "--out", copy, "train.max_steps=6", "optimizer.lr=0.5"]
    code, _, err = _run([*argv, "train.log_every=1", *QUIET])  # no --recipe: the run's own
    assert code == 0, err
    assert "optimizer.lr changed: 0.001 -> 0.5" in err or "optimizer.lr changed" in err
    assert "overrides the restored optimizer state" in err
    for record in read_jsonl(copy / "metrics.jsonl"):
        if record.get("kind") == "train" and record["step"] > 4:
            logged.append(record["lr"])
    assert logged == [0.5, 0.5]
    # config.yaml keeps the lr the run started with; the override is a recorded change at
    # the resumed step, so that --replay reproduces it
    assert "lr: 0.05" in (copy / "config.yaml").read_text()
    (override,) = read_changes(copy / "changes.jsonl")
    assert (override["step"], override["values"], override["client"]) == (
        4,
        {"lr": 0.5},
        "resume-override",
    )


def test_overrides_are_accepted_after_options(tmp_path):
    run = tmp_path / "run"
    argv = ["train", "train.max_steps=3", "--out", run, *MLP, "train.log_every=1", *QUIET]
    code, _, err = _run(argv)
    assert code == 0, err
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3]


def test_a_failed_start_does_not_block_the_corrected_command(tmp_path):
    run = tmp_path / "run"
    bad = ["train", *MLP, "--out", run, "train.grad_accum=100000", *QUIET]  # fails in Trainer()
    code, _, err = _run(bad)
    assert code == ExitCode.USAGE, err
    assert "grad_accum" in err
    assert not run.exists()  # what the failed start created is gone
    code, _, err = _run(["train", *MLP, "--out", run, "train.max_steps=2", *QUIET])
    assert code == 0, err


# -- exit codes that tell the truth ---------------------------------------------------------


def test_a_run_that_skipped_most_of_its_steps_failed(make_trainer, tmp_path):
    manager = CallbackManager()
    manager.register("on_before_optimizer_step", lambda ctx: ctx.control.skip_step())
    trainer = make_trainer(manager, max_steps=8)
    result = trainer.train()
    assert result.exit_code == ExitCode.FAILED == 4
    assert result.stop_reason.startswith("failed: 8 of 8 steps skipped")
    assert trainer.state.failed


def test_a_nan_stop_exits_4_and_shows_as_failed_in_hookloop_runs(tmp_path):
    run = tmp_path / "run"
    argv = ["train", *MLP, "--out", run, "train.max_steps=20", "optimizer.lr=1e3", *QUIET]
    code, out, err = _run(argv)  # the loss overflows to NaN within a few steps
    assert code == ExitCode.FAILED == 4, err
    assert "NaNDetection: non-finite loss" in out  # the result line, on stdout
    (summary,) = list_runs(run)
    assert summary.status == "failed"
    assert summary.step < 20


def test_hookloop_runs_skips_an_unreadable_run_naming_it(trained, tmp_path):
    root = tmp_path / "runs"
    good = _copy(trained, root / "good")
    bad = _copy(trained, root / "bad")
    with (bad / "metrics.jsonl").open("ab") as f:
        f.write(b'{"kind": "train", "step": 9, "x": "\xff"}\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        runs = list_runs(root)
    assert [r.name for r in runs] == [good.name]
    assert str(bad) in err.getvalue() and "UTF-8" in err.getvalue()


# -- one writer per run directory -------------------------------------------------------


def test_the_run_lock_is_reentrant_in_one_process_and_released_after(tmp_path):
    with run_lock(tmp_path), run_lock(tmp_path):
        holder = json.loads((tmp_path / ".lock").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert (tmp_path / ".lock").read_text() == ""  # released in an orderly way
    with run_lock(tmp_path):  # and can be taken again
        pass


def _wait_for(what: str, predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(
    trained, tmp_path
):
    run = _copy(trained, tmp_path / "run")
    cmd = [sys.executable, "-m", "hookloop", "train", "--resume", "auto", "--out", str(run)]
    first = zygote.Popen(
        [*cmd, "train.max_steps=100000", "train.log_every=1", *QUIET],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for(  # the first writer is training: its own train records are appearing
            "the first run to train",
            lambda: any(
                r.get("kind") == "train" and r["step"] > 4
                for r in read_jsonl(run / "metrics.jsonl")
            ),
        )
        second = zygote.run(
            [*cmd, "train.max_steps=100000", *QUIET], capture_output=True, text=True, timeout=120
        )
        assert second.returncode == ExitCode.USAGE, second.stderr
        (line,) = [x for x in second.stderr.splitlines() if ": error: " in x]
        assert f"pid {first.pid} on host {socket.gethostname()}" in line
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock: the file still names it
        first.wait(timeout=60)
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert len(steps) == len(set(steps))  # one writer: no step twice

    third = zygote.run(
        [*cmd, "train.max_steps=6", *QUIET], capture_output=True, text=True, timeout=120
    )
    assert third.returncode == 0, third.stderr
    assert f"taking over the lock of {run} from pid {first.pid}" in third.stderr


def test_a_second_trainer_in_another_process_cannot_take_a_held_lock(tmp_path):
    with run_lock(tmp_path):
        code = (
            "import sys\n"
            "from hookloop.runlock import run_lock, RunDirLocked\n"
            "try:\n"
            f"    run_lock({str(tmp_path)!r}).__enter__()\n"
            "except RunDirLocked as err:\n"
            "    print(err); sys.exit(7)\n"
        )
        proc = zygote.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 7, proc.stderr
    assert f"pid {os.getpid()}" in proc.stdout
    assert RunDirLocked.__name__ == "RunDirLocked"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_says_so(
    make_config, tmp_path, monkeypatch, async_save
):
    import errno

    from hookloop import Trainer
    from hookloop.checkpoint import storage as ckpt
    from hookloop.testing import TinyModel, ToyData

    cfg = make_config(max_steps=4)
    cfg.checkpoint.every = 2
    cfg.checkpoint.async_save = async_save

    def trainer():
        return Trainer(
            TinyModel(),
            train_data=ToyData(n=16),
            config=cfg,
            loss_fn=TinyModel.loss_fn,
            out_dir=tmp_path,
            resume="auto",
        )

    real = ckpt.write_synced

    def full_disk(path, data):
        if "step-00000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(ckpt, "write_synced", full_disk)
    with pytest.raises(OSError, match="latest checkpoint is still step-00000002, nothing was lost"):
        trainer().train()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000002"
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".staging")]
    monkeypatch.setattr(ckpt, "write_synced", real)
    assert trainer().train().step == 4  # resumes from step 2 and finishes


def test_sigterm_during_start_up_says_so_and_leaves_nothing_behind(tmp_path):
    run = tmp_path / "run"
    # A recipe build that waits: the signal lands while the model and data are being made.
    script = (
        "import sys, time\n"
        "import hookloop.recipes.mlp as mlp\n"
        "real = mlp.build\n"
        "def slow(cfg):\n"
        "    print('building', flush=True)\n"
        "    time.sleep(60)\n"
        "    return real(cfg)\n"
        "for recipe in __import__('hookloop.recipes', fromlist=['x'])._RECIPES.values():\n"
        "    if recipe.name == 'mlp-regression':\n"
        "        object.__setattr__(recipe, 'build', slow)\n"
        "from hookloop.app.cli import main\n"
        f"sys.exit(main(['train', '--recipe', 'mlp-regression', '--out', {str(run)!r}, "
        "'control.enabled=false', 'logging.tensorboard=false']))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "building"  # observed: start-up is under way
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "SIGTERM during start-up, before training began: nothing to save" in err
    assert not run.exists()


def test_the_run_summary_shows_the_peak_learning_rate_not_the_first_warm_up_value(make_config):
    from hookloop import Trainer
    from hookloop.callbacks.info import run_info
    from hookloop.testing import TinyModel, ToyData

    cfg = make_config(max_steps=10)
    cfg.optimizer.lr = 0.02
    cfg.scheduler.warmup_steps = 4
    trainer = Trainer(TinyModel(), train_data=ToyData(n=16), config=cfg, loss_fn=TinyModel.loss_fn)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.005)  # warm-up step 1
    assert run_info(trainer.ctx)["lr"] == pytest.approx(0.02)


# -- damaged runs that resume anyway, machines that fail in one line -------------------------


def test_resume_auto_passes_over_a_checkpoint_whose_trainer_state_does_not_load(trained, tmp_path):
    copy = _copy(trained, tmp_path / "copy")
    ckpt = copy / "checkpoints" / "step-00000004"
    replace_trainer_state(ckpt, {"train_state": {"step": 4}, "x": Opaque()})
    argv = ["train", "--resume", "auto", "--out", copy, "train.max_steps=6", *QUIET]
    with pytest.warns(UserWarning, match="skipping damaged checkpoint step-00000004") as said:
        code, out, err = _run(argv)
    assert code == 0, err
    assert "trainer_state.pt cannot be loaded" in str(said[0].message)
    assert "max_steps at step 6" in out  # the result line, on stdout
    starts = [r for r in read_jsonl(copy / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in starts][-4:] == [3, 4, 5, 6]  # trained on from step 2


def test_a_deleted_run_config_is_taken_from_the_checkpoint_not_the_default_recipe(
    trained, tmp_path
):
    copy = _copy(trained, tmp_path / "copy")
    (copy / "config.yaml").unlink()
    code, _, err = _run(["train", "--resume", "auto", "--out", copy, "train.max_steps=6", *QUIET])
    assert code == 0, err
    assert "config.yaml is missing; using the copy in" in err
    assert "recipe mlp-regression" in err
    assert "recipe: mlp-regression" in (copy / "config.yaml").read_text()  # written again


def test_a_full_disk_while_metrics_are_written_is_one_line_and_exit_1(tmp_path, monkeypatch):
    import errno

    from hookloop.callbacks.jsonlog import JsonLogger

    real, written = JsonLogger.write, []

    def full_after_two(self, record):
        if len(written) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(record)
        real(self, record)

    monkeypatch.setattr(JsonLogger, "write", full_after_two)
    argv = ["train", *MLP, "--out", tmp_path / "run", "train.max_steps=8", "train.log_every=1"]
    code, _, err = _run([*argv, *QUIET])
    assert code == ExitCode.ERROR, err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if ": error: " in x]
    assert "could not write the run's logs" in line and "No space left on device" in line
