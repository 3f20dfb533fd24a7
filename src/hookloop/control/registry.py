"""Where running jobs announce themselves on this machine, and how they are found.

Each job that serves a control endpoint owns one directory::

    <jobs dir>/<job_id>/        mode 0700
        auth_token              mode 0600: the bearer token, nothing else
        endpoint.json           job_id, pid, url, host, port, started, out_dir ...
                                and Forgather's started_at, output_dir, logging_dir

``<jobs dir>`` is ``$HOOKLOOP_JOBS_DIR`` when set (tests use it), else
``$XDG_RUNTIME_DIR/hookloop/jobs`` (a per-user tmpfs on systemd machines,
emptied at logout), else ``~/.config/hookloop/jobs``.

Forgather's registries are read and announced in too, so that each side's
tools see the other's jobs with nothing to configure: Forgather's current
clients look in ``<Forgather config dir>/jobs`` (``$XDG_CONFIG_HOME/forgather/jobs``
or ``~/.config/forgather/jobs`` on Linux), its older ones in ``~/.forgather/jobs``.
A job writes the same ``endpoint.json`` (and token) into each of them and removes
them all when it ends; :func:`list_jobs` reads all three, hookloop's first. A
registry named explicitly (``$HOOKLOOP_JOBS_DIR``, ``--jobs-dir``, ``jobs_dir=``)
is the only one used, for both reading and announcing.

The token is only ever written into a file this process has just created
(``O_EXCL``, mode 0600, ``fchmod`` and checked through the open descriptor)
and then renamed over the final name. Whatever was at that name before —
a file someone pre-created with mode 0644, a symlink, a stale token — is
replaced, never written through, and no descriptor opened by anyone else
can see the new token.

The directory is removed when the job ends; a job that died without
cleaning up (SIGKILL, power loss) is noticed by :func:`list_jobs`, which
checks that the recorded process still exists and removes the leftovers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hookloop.processes import process_alive

JOBS_DIR_ENV = "HOOKLOOP_JOBS_DIR"
TOKEN_FILE = "auth_token"
ENDPOINT_FILE = "endpoint.json"
#: A directory without endpoint.json younger than this is a job still starting.
STARTING_GRACE_S = 600.0

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class RegistryError(RuntimeError):
    """The job directory or its token cannot be made private; nothing is served."""


def jobs_dir() -> Path:
    """The directory holding one sub-directory per live job of this user."""
    override = os.environ.get(JOBS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "hookloop" / "jobs"
    return Path.home() / ".config" / "hookloop" / "jobs"


def forgather_jobs_dirs() -> list[Path]:
    """Forgather's job registries: ``<its config dir>/jobs``, then the older ``~/.forgather/jobs``.

    The config dir is platformdirs' ``user_config_dir("forgather", <user>)``, as
    Forgather computes it (``$XDG_CONFIG_HOME/forgather`` or ``~/.config/forgather`` on Linux).
    """
    config: Path | None = None
    try:
        import getpass

        from platformdirs import user_config_dir

        config = Path(user_config_dir("forgather", getpass.getuser()))
    except Exception:  # platformdirs missing, or no user name to be found
        xdg = os.environ.get("XDG_CONFIG_HOME", "")
        root = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".config"
        config = root / "forgather"
    return [config / "jobs", Path.home() / ".forgather" / "jobs"]


def registries(base: str | Path | None = None) -> list[Path]:
    """Where jobs are looked for and announced, the first being hookloop's own.

    ``base`` (or ``$HOOKLOOP_JOBS_DIR``) names the only registry; otherwise hookloop's
    default one and Forgather's two (:func:`forgather_jobs_dirs`).
    """
    if base is not None:
        return [Path(base)]
    if os.environ.get(JOBS_DIR_ENV):
        return [jobs_dir()]
    places: list[Path] = []
    for place in (jobs_dir(), *forgather_jobs_dirs()):
        if place not in places:
            places.append(place)
    return places


def valid_job_id(job_id: object) -> bool:
    """Letters, digits, ``.``, ``_``, ``-``; at most 128; not starting with a dot or dash."""
    return isinstance(job_id, str) and _JOB_ID.fullmatch(job_id) is not None


def check_job_id(job_id: str) -> str:
    if not valid_job_id(job_id):
        raise ValueError(
            f"job_id must be 1-128 characters of letters, digits, '.', '_' or '-', starting "
            f"with a letter or digit (it names a directory and a URL path), got {job_id!r}"
        )
    return job_id


_issued: set[str] = set()


def new_job_id() -> str:
    """Forgather's ``job_<unix time>_<host>_<pid>``; a second id in the same second gets ``_<n>``.

    The host name keeps only the characters a job id allows.
    """
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"
    base = f"job_{int(time.time())}_{host}_{os.getpid()}"
    job_id, n = base, 1
    while job_id in _issued:
        n += 1
        job_id = f"{base}_{n}"
    _issued.add(job_id)
    return job_id


@dataclass
class JobRecord:
    """What ``endpoint.json`` says about one job (plus where its directory is)."""

    job_id: str
    pid: int
    url: str
    host: str
    port: int
    started: float
    out_dir: str | None = None
    recipe: str | None = None
    pid_start: int | None = None
    hookloop: str | None = None
    logging_dir: str | None = None
    auth_disabled: bool = False
    dir: Path = field(default=Path(), compare=False, repr=False)

    @property
    def token_path(self) -> Path:
        return self.dir / TOKEN_FILE

    def api(self, route: str) -> str:
        """Absolute URL of ``/jobs/<job_id>/<route>``."""
        return f"{self.url.rstrip('/')}/jobs/{self.job_id}/{route}"

    @property
    def foreign(self) -> bool:
        """Written by Forgather's trainer (hookloop's records name the hookloop version)."""
        return self.hookloop is None

    def read_token(self) -> str:
        """The bearer token (readable only by the user who runs the job); "" without auth.

        A Forgather job without a token file serves without authentication (its older
        trainers have none), so "" is its token; a hookloop job says so in its record.
        """
        if self.auth_disabled:
            return ""
        try:
            raw = self.token_path.read_bytes()
        except FileNotFoundError:
            if self.foreign:
                return ""
            raise RegistryError(
                f"job {self.job_id} has no token file at {self.token_path} "
                "(the job has ended, or it runs without authentication)"
            ) from None
        except PermissionError:
            raise RegistryError(
                f"cannot read {self.token_path}: the job belongs to another user"
            ) from None
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise RegistryError(
                f"the token file {self.token_path} is not ASCII; a token is printable ASCII"
            ) from None
        if not token:
            raise RegistryError(f"the token file {self.token_path} is empty")
        if not token.isprintable() or any(c.isspace() for c in token):
            raise RegistryError(
                f"the token file {self.token_path} holds spaces or control characters; a token "
                "is printable ASCII without spaces"
            )
        return token

    def to_json(self) -> dict[str, Any]:
        """hookloop's fields and Forgather's names for the same facts."""
        data = asdict(self)
        data.pop("dir")
        data["started_at"] = self.started
        data["output_dir"] = self.out_dir
        return data

    @classmethod
    def load(cls, job_dir: Path) -> JobRecord:
        """Read ``endpoint.json``; ``ValueError`` if it is missing fields or malformed."""
        data = json.loads((job_dir / ENDPOINT_FILE).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("endpoint.json does not hold an object")
        try:  # Forgather's trainer writes started_at / output_dir and no url
            host, port = str(data["host"]), int(data["port"])
            record = cls(
                job_id=str(data["job_id"]),
                pid=int(data["pid"]),
                url=str(data.get("url") or f"http://{_url_host(host)}:{port}"),
                host=host,
                port=port,
                started=float(data["started"] if "started" in data else data["started_at"]),
                out_dir=data.get("out_dir", data.get("output_dir")),
                recipe=data.get("recipe"),
                pid_start=data.get("pid_start"),
                hookloop=data.get("hookloop"),
                logging_dir=data.get("logging_dir"),
                auth_disabled=bool(data.get("auth_disabled", False)),
                dir=job_dir,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"endpoint.json is incomplete: {err!r}") from None
        if not 0 < record.port <= 65535 or record.pid <= 0:
            raise ValueError(
                f"endpoint.json has port {record.port} and pid {record.pid}; a port lies in "
                "[1, 65535] and a pid is positive"
            )
        if record.job_id != job_dir.name:
            raise ValueError(f"endpoint.json names job {record.job_id!r}, not {job_dir.name!r}")
        return record


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


# -- the job's own side ---------------------------------------------------------


class JobDir:
    """The per-job directory a serving process creates, fills, and removes."""

    def __init__(self, job_id: str, base: str | Path | None = None) -> None:
        self.job_id = check_job_id(job_id)
        self.base = Path(base) if base is not None else jobs_dir()
        self.path = self.base / job_id

    @property
    def token_path(self) -> Path:
        return self.path / TOKEN_FILE

    @property
    def endpoint_path(self) -> Path:
        return self.path / ENDPOINT_FILE

    def create(self) -> None:
        """Make the directory (0700, owned by us, not a symlink)."""
        self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            self.path.mkdir(mode=0o700)
        info = os.lstat(self.path)
        if not stat.S_ISDIR(info.st_mode):
            raise RegistryError(f"{self.path} exists and is not a directory")
        if info.st_uid != os.geteuid():
            raise RegistryError(f"{self.path} belongs to another user (uid {info.st_uid})")
        os.chmod(self.path, 0o700)

    def write_token(self, token: str) -> Path:
        """Write the token at mode 0600 (see the module docstring); return its path."""
        _write_private(self.token_path, token.encode("ascii"))
        return self.token_path

    def write_endpoint(self, record: JobRecord) -> Path:
        data = json.dumps(record.to_json(), indent=2, sort_keys=True).encode("utf-8")
        _write_private(self.endpoint_path, data + b"\n")
        return self.endpoint_path

    def remove(self) -> None:
        """Delete token, endpoint and the directory; quiet if already gone."""
        for path in (self.token_path, self.endpoint_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _write_private(path: Path, data: bytes) -> None:
    """Create a fresh 0600 file beside ``path``, verify it, fill it, rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only remove bits; make the mode exact anyway
        info = os.fstat(fd)
        if stat.S_IMODE(info.st_mode) != 0o600 or info.st_uid != os.geteuid():
            raise RegistryError(
                f"{tmp} has mode {stat.S_IMODE(info.st_mode):o} and owner {info.st_uid} after "
                "chmod 0600; refusing to write a secret into it"
            )
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    os.replace(tmp, path)
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or stat.S_IMODE(info.st_mode) != 0o600:
        raise RegistryError(f"{path} is not a private regular file after writing it")


# -- the clients' side ------------------------------------------------------------


def list_jobs(base: str | Path | None = None, *, clean: bool = True) -> list[JobRecord]:
    """Live jobs, oldest first, from every registry (:func:`registries`); a job announced in
    several is listed once, from the first. With ``clean``, leftovers of dead jobs are
    removed: anything in hookloop's registry, and only hookloop's own entries in Forgather's
    (its ``forgather control cleanup`` tidies the rest)."""
    records: dict[str, JobRecord] = {}
    for n, root in enumerate(registries(base)):
        for record in _scan(root, clean=clean, own=n == 0):
            records.setdefault(record.job_id, record)
    return sorted(records.values(), key=lambda r: (r.started, r.job_id))


def _scan(root: Path, *, clean: bool, own: bool) -> list[JobRecord]:
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    records = []
    for job_dir in entries:
        if not job_dir.is_dir() or job_dir.is_symlink() or not valid_job_id(job_dir.name):
            continue
        try:
            record = JobRecord.load(job_dir)
        except (OSError, ValueError):  # missing (a job still starting), torn or malformed
            if own and clean and _older_than(job_dir, STARTING_GRACE_S):
                _remove_tree(job_dir)
            continue
        if process_alive(record.pid, record.pid_start):
            records.append(record)
        elif clean and (own or not record.foreign):
            _remove_tree(job_dir)
    return records


def find_job(ref: str, base: str | Path | None = None) -> JobRecord:
    """A live job by exact id, unique id prefix, or pid; ``LookupError`` listing the live ones."""
    jobs = list_jobs(base)
    exact = [j for j in jobs if j.job_id == ref]
    if exact:
        return exact[0]
    if ref.isdigit():
        by_pid = [j for j in jobs if j.pid == int(ref)]
        if len(by_pid) == 1:
            return by_pid[0]
    matches = [j for j in jobs if j.job_id.startswith(ref)] if ref else []
    if len(matches) == 1:
        return matches[0]
    live = ", ".join(j.job_id for j in jobs) or "none"
    where = " and ".join(str(p) for p in registries(base))
    if len(matches) > 1:
        raise LookupError(
            f"{ref!r} matches {len(matches)} jobs: {', '.join(j.job_id for j in matches)}; "
            "give more of the job id"
        )
    raise LookupError(f"no live job {ref!r} in {where}; live jobs: {live}")


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False


def _remove_tree(path: Path) -> None:
    """Remove a dead job's directory (only our own files; best effort)."""
    with contextlib.suppress(OSError):
        shutil.rmtree(path)
