"""The ``hookloop`` commands that never train start light and end quietly.

``jobs``, ``ctl``, ``runs``, ``--help`` and ``--version`` import no torch (nor numpy,
optuna, matplotlib or aiohttp): each runs in a fresh interpreter here and the test reads
its ``sys.modules``. Modules are counted rather than seconds timed, so the check holds on
a loaded machine. A reader that closes the pipe early ends the command with exit code 141
and nothing on stderr. ``import hookloop`` keeps every public name importable.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hookloop
from hookloop.app.cli import build_parser

#: Libraries a command that does not train has no use for.
HEAVY = ("torch", "numpy", "optuna", "matplotlib", "aiohttp")
#: Modules a light command may import in all (the interpreter's own ~60 included); torch
#: alone brings about a thousand.
LIGHT_MODULES = 350

#: Runs ``hookloop ARGV`` in this interpreter, then prints its exit code and sys.modules.
PROBE = """
import json, sys
from hookloop.app.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def _modules_after(argv: list[str], cwd: Path) -> tuple[int, list[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HOOKLOOP_JOBS_DIR": str(cwd / "jobs")},
    )  # fmt: skip
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return report["code"], report["modules"], done.stdout


def _a_run(where: Path, step: int = 4) -> Path:
    where.mkdir(parents=True)
    records = [
        {"kind": "start", "time": 1.0, "step": 0, "epoch": 0, "max_steps": step},
        {"kind": "end", "time": 2.0, "step": step, "epoch": 0, "stop_reason": "max_steps"},
    ]
    (where / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return where


LIGHT_COMMANDS = {
    "jobs": ["jobs"],
    "jobs --json": ["jobs", "--json"],
    "ctl status": ["ctl", "nosuchjob", "status"],
    "ctl set": ["ctl", "set", "nosuchjob", "lr=3e-4"],
    "runs": ["runs", "runs"],
    "runs --json": ["runs", "--json", "runs"],
    "--help": ["--help"],
    "--version": ["--version"],
    "no command": [],
}


@pytest.mark.parametrize("argv", LIGHT_COMMANDS.values(), ids=LIGHT_COMMANDS.keys())
def test_commands_that_do_not_train_import_no_torch(argv, tmp_path):
    _a_run(tmp_path / "runs" / "a")

    code, modules, _ = _modules_after(argv, tmp_path)

    assert code in (0, 2)  # no job "nosuchjob": a one-line refusal, exit 2
    assert [m for m in modules if m.split(".")[0] in HEAVY] == []
    assert len(modules) < LIGHT_MODULES, len(modules)


def test_version_comes_from_the_package_without_torch(tmp_path):
    code, modules, out = _modules_after(["--version"], tmp_path)
    assert code == 0
    assert out == f"hookloop {hookloop.__version__}\n"
    assert hookloop.__version__ == importlib.metadata.version("hookloop") == "0.1.0"
    assert "torch" not in modules


def test_the_help_lists_every_command_with_its_own_help_line():
    """The placeholders that keep ``hookloop --help`` light say what the real parsers say."""
    assert build_parser([]).format_help() == build_parser(None).format_help()


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(tmp_path):
    for n in range(400):  # ~100 kB of JSON: more than a pipe holds, so a write must fail
        _a_run(tmp_path / "runs" / f"run-{n:03d}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hookloop", "runs", "--json", "runs"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    first = json.loads(proc.stdout.readline())
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=120)

    assert first["name"] == "run-000"
    assert err == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert code == 141  # 128 + SIGPIPE, what a shell reports for `git log | head -1`


def test_the_shell_sees_the_same_as_git_and_coreutils(tmp_path):
    for n in range(400):
        _a_run(tmp_path / "runs" / f"run-{n:03d}")
    script = f"set -o pipefail; {sys.executable} -m hookloop runs --json runs | head -1"
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.stderr == ""
    assert done.returncode == 141
    assert json.loads(done.stdout)["name"] == "run-000"


# -- the public names ------------------------------------------------------------------

PUBLIC = [
    "Callback", "CallbackContext", "CallbackManager", "CheckpointConfig", "Config", "Control",
    "DataConfig", "Event", "ExitCode", "LoggingConfig", "ModelConfig", "OptimizerConfig",
    "RunDir", "RunInfo", "SchedulerConfig", "Stateful", "TrainConfig", "TrainResult",
    "TrainState", "Trainer", "finetune", "pretrain", "seed_everything",
]  # fmt: skip


def test_the_public_names_are_pinned_and_each_is_its_modules_object():
    assert hookloop.__all__ == PUBLIC
    homes = {
        "Trainer": "hookloop.trainer", "finetune": "hookloop.entry", "pretrain": "hookloop.entry",
        "seed_everything": "hookloop.entry", "Event": "hookloop.events",
        "CallbackManager": "hookloop.manager", "RunDir": "hookloop.rundir",
    }  # fmt: skip
    for name in PUBLIC:
        value = getattr(hookloop, name)
        if name in homes:
            assert value is getattr(importlib.import_module(homes[name]), name)
        assert name in dir(hookloop)
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        _ = hookloop.Trainr


def test_import_hookloop_and_a_star_import_work_in_a_fresh_interpreter():
    probe = (
        "import sys, hookloop; light = 'torch' not in sys.modules\n"
        "from hookloop import *\n"
        "missing = [name for name in hookloop.__all__ if name not in globals()]\n"
        "print(light, Trainer.__name__, len(missing))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "Trainer", "0"]
