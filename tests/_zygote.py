"""Start ``python ...`` commands of the tests without paying python's start-up each time.

A ``hookloop train`` process spends about 3 s of CPU importing torch, torch._dynamo and
hookloop before its first step; the tests that kill, stop and resume runs start dozens of
them. A zygote is a python that has done those imports once and then forks, for each
command, a child that becomes the command: it takes the caller's stdin, stdout, stderr
(passed over a Unix socket), working directory and environment, fresh signal
dispositions and a fresh ``__main__``, then runs ``-m MODULE``, ``-c CODE`` or a script
exactly as ``python`` would, through the interpreter's own exit path (SystemExit codes,
atexit handlers, death by signal, a traceback and 1 for an uncaught error).

``Popen`` and ``run`` here are ``subprocess.Popen`` and ``subprocess.run`` for a command
that starts with ``sys.executable``: the child's pid is real (signals go straight to
it), its exit status comes back from the zygote's helper that waited on it, and it stays
in the caller's process group. Only tests about what the training process does use it;
tests of the CLI's own start-up or of the installed entry point start real processes.

Fork-safety: the zygote only imports; it runs no torch op (so no intra-op thread pool
exists to be lost across fork), starts no python thread (numpy's OpenBLAS pool, started
at import, is shut down around each fork by OpenBLAS itself) and initialises no
torch.distributed.
One zygote runs per distinct set of start-up-sensitive environment variables (PYTHON*,
OMP_*, TORCH* ...): a child whose environment differs in those from the zygote's would not
be the process its command starts, so it gets a zygote of its own.

Run as a script, this file is the zygote (not collected: tests/_*.py are helpers).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

#: Imported once by each zygote: what a ``hookloop train`` run and the job scripts import.
PRELOAD = (
    "torch",
    "torch._dynamo",  # torch.optim imports it on the first add_param_group
    "hookloop.app.cli",
    "hookloop.loop",
    "hookloop.recipes.mlp",
    "hookloop.recipes.gpt",
    "hookloop.callbacks.defaults",
    "hookloop.callbacks.tensorboard",
    "hookloop.control.server",
    "hookloop.diloco.callback",
    "hookloop.tune.cli",
    "hookloop.testing",
    "safetensors.torch",
    "torch.utils.tensorboard",
)

#: Environment variables read while python starts or while PRELOAD imports: a child
#: whose values differ needs a zygote started with its values.
STARTUP_PREFIXES = (
    "PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA",
    "NVIDIA", "LD_", "MALLOC", "NUMEXPR", "NPY_", "NUMPY_", "AIOHTTP_", "LC_", "LANG",
)  # fmt: skip

_MAX_REQUEST = 1 << 20


# -- the zygote (this file run as a script) ----------------------------------------------


def _serve(ctl: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a helper per request; return in the grandchild that becomes the command.

    The helper forks the command's process, reports its pid, waits for it and reports
    its raw wait status, so the zygote itself only reaps helpers. Returns None when the
    caller hung up (the zygote then exits).
    """
    while True:
        while True:  # reap the helpers that are done
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        ready, _, _ = select.select([ctl], [], [], 1.0)
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(ctl, _MAX_REQUEST, 4)
        if not message:
            return None
        request = json.loads(message)
        reply = socket.socket(fileno=fds[3])
        stdio = fds[:3]
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            ctl.close()
            return _helper(reply, stdio, request)  # returns only in the command's process
        reply.close()
        for fd in stdio:
            os.close(fd)


def _helper(
    reply: socket.socket, stdio: list[int], request: dict[str, Any]
) -> tuple[dict[str, Any], list[int]]:
    """Fork the command's process, report its pid, then its wait status, and exit."""
    child = -1
    try:
        child = os.fork()
        if child == 0:
            reply.close()
            return request, stdio
        for fd in stdio:
            os.close(fd)
        reply.sendall(f"{child}\n".encode())
        _, status = os.waitpid(child, 0)
        reply.sendall(f"{status}\n".encode())
    finally:
        if child != 0:
            os._exit(0 if child > 0 else 1)
    raise AssertionError("unreachable")


def _fresh_stdio(environ: dict[str, str]) -> None:
    """sys.stdin/stdout/stderr as a new python builds them over fds 0, 1, 2."""
    import io

    unbuffered = bool(environ.get("PYTHONUNBUFFERED"))
    encoding = environ.get("PYTHONIOENCODING", "").split(":")[0] or "utf-8"

    def stream(fd: int, write: bool, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
        tty = raw.isatty()
        if write and unbuffered:
            buffered: Any = raw
        else:
            buffered = (io.BufferedWriter if write else io.BufferedReader)(raw)
        return io.TextIOWrapper(
            buffered,
            encoding=encoding,
            errors=errors,
            line_buffering=tty or (write and fd == 2),
            write_through=write and unbuffered,
        )

    sys.stdin = sys.__stdin__ = stream(0, False, "strict")
    sys.stdout = sys.__stdout__ = stream(1, True, "strict")
    sys.stderr = sys.__stderr__ = stream(2, True, "backslashreplace")


def _ignored_signals() -> list[int]:
    """The signals this process ignores: an exec'd python inherits them ignored."""
    ignored = []
    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):
                if signal.getsignal(signum) == signal.SIG_IGN:
                    ignored.append(int(signum))
    return ignored


def _become(request: dict[str, Any], stdio: list[int]) -> None:
    """Turn this forked process into ``python *request['argv']``."""
    import runpy
    import types

    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    ignored = set(request["ignored"])  # an exec keeps what the caller ignores (e.g. nohup's HUP)
    for signum in signal.valid_signals():  # what a new python starts with
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if signum in ignored or signum in (signal.SIGPIPE, signal.SIGXFSZ):
            handler: Any = signal.SIG_IGN
        elif signum == signal.SIGINT:
            handler = signal.default_int_handler
        else:
            handler = signal.SIG_DFL
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["sigmask"])
    _fresh_stdio(request["env"])
    if "numpy" in sys.modules:  # a new process draws a fresh seed
        sys.modules["numpy"].random.seed()

    argv = request["argv"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = request["cwd"]
        runpy._run_module_as_main(argv[1], alter_argv=True)  # what `python -m` calls
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        script = os.path.join(request["cwd"], argv[0])
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


def _zygote_main() -> None:
    import importlib

    ctl = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        importlib.import_module(name)
    # A thread would not survive the fork, and a lock it held would stay held. (numpy's
    # OpenBLAS starts a native pool at import; it shuts it down around fork itself.)
    if threading.active_count() != 1:
        raise RuntimeError(f"the zygote runs threads after its imports: {threading.enumerate()}")
    # What the gc docs advise before forking workers: the children's collections (and the
    # one at their exit) then skip the objects the imports made and share with the zygote.
    gc.freeze()
    ctl.sendall(b"ready")
    became = _serve(ctl)
    if became is None:  # the caller hung up: wait for the helpers, so that they (and the
        while True:  # CPU time of the commands they waited on) are accounted to it
            try:
                os.wait()
            except ChildProcessError:
                return
    del ctl
    _become(*became)


# -- the client (imported by the tests) ---------------------------------------------------


class _Zygote:
    """One zygote process and the socket requests go over."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        self.ctl = ours
        ours.settimeout(300)
        if ours.recv(16) != b"ready":
            raise RuntimeError(f"the zygote exited with {self.proc.wait()} before it was ready")
        ours.settimeout(None)

    def spawn(self, request: dict[str, Any], stdio: list[int]) -> socket.socket:
        """Start one command; returns the socket its pid and exit status come back on."""
        reply, theirs = socket.socketpair()
        payload = json.dumps(request).encode()
        if len(payload) >= _MAX_REQUEST:
            raise ValueError(f"a zygote request is limited to {_MAX_REQUEST} bytes")
        with theirs, self.lock:
            socket.send_fds(self.ctl, [payload], [*stdio, theirs.fileno()])
        return reply


_zygotes: dict[tuple[tuple[str, str], ...], _Zygote] = {}
_zygotes_lock = threading.Lock()


@atexit.register
def _stop_zygotes() -> None:
    """Hang up on each zygote and reap it (its children's CPU time then counts as ours)."""
    for zygote in _zygotes.values():
        zygote.ctl.close()
    for zygote in _zygotes.values():
        try:
            zygote.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            zygote.proc.kill()
            zygote.proc.wait()


def _zygote_for(env: dict[str, str]) -> _Zygote:
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES)))
    with _zygotes_lock:
        if key not in _zygotes or _zygotes[key].proc.poll() is not None:
            _zygotes[key] = _Zygote(env)
        return _zygotes[key]


class Popen(subprocess.Popen):
    """``subprocess.Popen`` for ``[sys.executable, ...]``, run by a zygote.

    Supports what the tests use: stdin/stdout/stderr (PIPE, DEVNULL, STDOUT, files),
    ``env``, ``cwd``, ``text``. Not ``preexec_fn``, ``pass_fds``, ``start_new_session``,
    ``process_group``, user or group changes, or a shell.
    """

    def _execute_child(
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
        creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
        restore_signals, gid, gids, uid, umask, start_new_session, process_group,
    ):  # fmt: skip
        try:
            args = [os.fsdecode(a) for a in args]
            unsupported = (preexec_fn, pass_fds, shell, gid, gids, uid, start_new_session)
            if args[0] != sys.executable or any(unsupported) or executable is not None:
                raise ValueError(f"a zygote runs `{sys.executable} ...` as it is, not {args}")
            if umask >= 0 or process_group not in (None, -1):
                raise ValueError("a zygote child keeps the caller's umask and process group")
            environ = dict(os.environ if env is None else env)
            request = {
                "argv": args[1:],
                "cwd": os.path.abspath(os.fsdecode(cwd) if cwd is not None else os.getcwd()),
                "env": {os.fsdecode(k): os.fsdecode(v) for k, v in environ.items()},
                "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                "ignored": _ignored_signals(),
            }
            stdio = [
                p2cread if p2cread != -1 else 0,
                c2pwrite if c2pwrite != -1 else 1,
                errwrite if errwrite != -1 else 2,
            ]
            self._zygote_reply = _zygote_for(request["env"]).spawn(request, stdio)
            self._zygote_read = b""
            pid = self._zygote_line(block=True)
            if pid is None:
                raise RuntimeError(f"the zygote started no process for {args}")
            self.pid = pid
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _zygote_line(self, block: bool) -> int | None:
        """The next number the zygote's helper sent: the pid, then the raw wait status.

        None when nothing has come yet (not blocking) or the helper hung up.
        """
        reply = self._zygote_reply
        while b"\n" not in self._zygote_read:
            reply.setblocking(block)
            try:
                chunk = reply.recv(64)
            except BlockingIOError:
                return None
            finally:
                reply.setblocking(True)
            if not chunk:
                return None
            self._zygote_read += chunk
        line, self._zygote_read = self._zygote_read.split(b"\n", 1)
        return int(line)

    def _zygote_status(self, block: bool) -> int | None:
        """The child's raw wait status, None while it runs (only when not blocking)."""
        status = self._zygote_line(block)
        if status is None and block:
            raise RuntimeError(f"the zygote's helper for pid {self.pid} hung up")
        if status is not None:
            self._zygote_reply.close()
        return status

    def _try_wait(self, wait_flags):
        status = self._zygote_status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate=None, **_: Any):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    status = self._zygote_status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            except (OSError, RuntimeError, ValueError):
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def run(
    args: list[str],
    *,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` with a zygote's Popen (the same contract, line for line)."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
        if check and code:
            raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)


if __name__ == "__main__":
    _zygote_main()
