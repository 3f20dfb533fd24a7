"""The zygote the kill-and-resume tests start processes from behaves as ``python`` would.

Each program runs twice, as a real ``python`` process and forked from the zygote
(tests/_zygote.py), and what a test can observe must match: exit status, death by
signal, the pid the process sees, its argv, working directory, environment, stdin,
stdout and stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import _zygote as zygote

PROGRAMS = {
    "exit-code": "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
    "exit-message": "import sys; sys.exit('a message')",
    "uncaught": "raise ValueError('boom')",
    "killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "atexit": "import atexit; atexit.register(print, 'at exit'); print('body')",
    "identity": (
        "import os, sys; print(sys.argv, os.getcwd(), os.environ.get('ZYGOTE_PROBE'), "
        "__name__, sys.path[0] == '', sys.stdin.read().upper())"
    ),
    "dispositions": (
        "import signal; print([signal.getsignal(s) for s in "
        "(signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD, signal.SIGHUP)])"
    ),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_program_forked_from_the_zygote_is_observed_as_a_real_python_process(name, tmp_path):
    cmd = [sys.executable, "-c", PROGRAMS[name], "arg"]
    env = {**os.environ, "ZYGOTE_PROBE": "probe"}
    real, forked = (
        start(cmd, input="in", capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
        for start in (subprocess.run, zygote.run)
    )
    assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout)
    # A traceback names the zygote's own frames above the program's: compare its last line.
    assert forked.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:]


def test_a_signal_the_caller_ignores_stays_ignored_as_across_an_exec(tmp_path):
    """Started under nohup, a test's children ignore SIGHUP; a forked one must too."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        real, forked = (
            start([sys.executable, "-c", PROGRAMS["dispositions"]], capture_output=True,
                  text=True, cwd=tmp_path, timeout=60)
            for start in (subprocess.run, zygote.run)
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGHUP, before)
    assert "<Handlers.SIG_IGN: 1>]" in real.stdout  # SIGHUP, the last one printed
    assert forked.stdout == real.stdout


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)]
)
def test_a_signal_reaches_the_forked_process_by_its_pid_with_pythons_default_handling(signum, code):
    # A caller that ignores the signal (a shell's background job ignores SIGINT) passes
    # that on to its children, forked or exec'd: then both must live on through it.
    ignored = signal.getsignal(signum) == signal.SIG_IGN
    program = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    for start in (subprocess.Popen, zygote.Popen):
        proc = start([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
        assert int(proc.stdout.readline()) == proc.pid
        assert proc.poll() is None
        proc.send_signal(signum)
        if ignored:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
            proc.kill()
            proc.wait(timeout=30)
        else:
            assert proc.wait(timeout=30) == code, start
        proc.stdout.close()


def test_a_run_past_its_timeout_is_killed_and_reported_as_subprocess_run_does():
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_the_zygote_refuses_what_it_cannot_start_as_python_would():
    with pytest.raises(ValueError, match=r"runs `.*` as it is"):
        zygote.Popen(["python3", "-c", "pass"])
    with pytest.raises(ValueError, match=r"runs `.*` as it is"):
        zygote.Popen([sys.executable, "-c", "pass"], start_new_session=True)
