"""Which new entries of the user's job registries the test session made (not collected).

The session fails when a test's run registers in the user's own registry instead of the
private one ``tests/conftest.py`` sets up. The user may be training meanwhile: a
``hookloop train`` in another terminal registers there too, and is not the tests' doing.
So an entry is blamed on the tests only on evidence:

- its run directory (``out_dir`` or ``logging_dir``) lies under the session's temp root
  (every test writes its runs there);
- its process, still alive, descends from the session's process;
- its process, still alive, carries :data:`SESSION_MARK` with this session's value (a test
  process that escaped the private directories, e.g. daemonized, still inherits it).

An entry the user's own job made has none of these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: Set by the session for itself and every process it starts; its value names the session.
SESSION_MARK = "HOOKLOOP_TEST_SESSION"


def user_registries(environ: dict[str, str] | None = None) -> list[Path]:
    """The user's job registries as ``environ`` finds them: hookloop's (``$HOOKLOOP_JOBS_DIR``,
    ``$XDG_RUNTIME_DIR/hookloop/jobs``, ``~/.config/hookloop/jobs``) and Forgather's two,
    which a job announces itself in too (hookloop.control.registry)."""
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME") or Path.home())
    config = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else home / ".config"
    places = [home / ".config" / "hookloop" / "jobs", config / "forgather" / "jobs"]
    places.append(home / ".forgather" / "jobs")
    if env.get("XDG_RUNTIME_DIR"):
        places.append(Path(env["XDG_RUNTIME_DIR"]) / "hookloop" / "jobs")
    if env.get("HOOKLOOP_JOBS_DIR"):
        places.append(Path(env["HOOKLOOP_JOBS_DIR"]).expanduser())
    return list(dict.fromkeys(places))


def entries(places: Iterable[Path]) -> set[Path]:
    """Every job directory in ``places`` (missing or unreadable places hold none)."""
    found: set[Path] = set()
    for place in places:
        try:
            found.update(p for p in place.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:
            continue
    return found


@dataclass(frozen=True)
class Session:
    """What marks the session's own work: its temp root, its process, its mark's value."""

    temp_root: Path
    pid: int
    mark: str

    def made(self, job_dir: Path) -> bool:
        """Whether the session (a test or a process it started) made ``job_dir``."""
        record = _record(job_dir)
        for key in ("out_dir", "output_dir", "logging_dir"):
            value = record.get(key)
            if isinstance(value, str) and value and _under(Path(value), self.temp_root):
                return True
        pid = record.get("pid")
        if not isinstance(pid, int):
            pid = _pid_in_name(job_dir.name)
        if pid is None:
            return False
        return self.pid in _ancestors(pid) or _environ(pid).get(SESSION_MARK) == self.mark

    def blamed(self, before: set[Path], places: Iterable[Path]) -> list[Path]:
        """Job directories in ``places`` that were not in ``before`` and that the session made."""
        return sorted(d for d in entries(places) - before if self.made(d))


def _record(job_dir: Path) -> dict:
    try:
        data = json.loads((job_dir / "endpoint.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a job still starting, or not a job's directory
        return {}
    return data if isinstance(data, dict) else {}


def _pid_in_name(name: str) -> int | None:
    """A job id ends with its process id (``job_<time>_<host>_<pid>``, maybe ``_<n>``)."""
    parts = name.split("_")
    if len(parts) >= 4 and parts[0] == "job" and parts[3].isdigit():
        return int(parts[3])
    return None


def _under(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, ValueError):
        return False


def _ancestors(pid: int) -> list[int]:
    """``pid`` and its parents up to init, from /proc (empty when it is gone)."""
    chain: list[int] = []
    while pid > 1 and pid not in chain and len(chain) < 256:
        chain.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
    return chain


def _environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with (empty when it is gone or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
