"""Several machines on one study, on a real PostgreSQL server that the test starts
(``pgserver``, a pip-installable PostgreSQL): two ``hookloop tune`` drivers with their own
directories and host names (``HOOKLOOP_TUNE_HOST``) on a fresh database, then the same
with one of them SIGKILLed for good while it runs a trial.

The server is PostgreSQL 16 from the ``pgserver`` wheel (:class:`Postgres`). Skipped, with
the reason, where ``pgserver`` or ``psycopg2`` is not installed or the server cannot start
(``pip install -e '.[test]'`` installs both)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from test_tune_machines import ALPHA_RUNNING, check_shared_study, run_two_drivers

optuna = pytest.importorskip("optuna")
psycopg2 = pytest.importorskip(
    "psycopg2", reason="psycopg2 is not installed: pip install psycopg2-binary"
)
sqlalchemy = pytest.importorskip("sqlalchemy")
NOBODY = 65534  # PostgreSQL refuses to run as root: as root, the server runs as nobody


class Postgres:
    """A PostgreSQL server of pgserver's wheel, run from a copy of its binaries in a
    temporary directory of its own (as ``nobody`` when the tests run as root), listening
    on 127.0.0.1 only. Unlike ``pgserver.get_server`` as root, it adds no system user and
    changes the permissions of nothing outside that directory."""

    def __init__(self, root: Path) -> None:
        spec = importlib.util.find_spec("pgserver")  # its binaries; the module is not run
        if spec is None or spec.origin is None:
            pytest.skip("pgserver is not installed: pip install pgserver")
        site = Path(spec.origin).parent.parent
        self.root, self.data = root, root / "data"
        for part in ("bin", "lib", "share"):  # the binaries find their libraries by RPATH
            shutil.copytree(site / "pgserver" / "pginstall" / part,
                            root / "pgserver" / "pginstall" / part, symlinks=True)  # fmt: skip
        shutil.copytree(site / "pgserver.libs", root / "pgserver.libs")
        self.bin = root / "pgserver" / "pginstall" / "bin"
        self.data.mkdir()
        if os.geteuid() == 0:
            root.chmod(0o711)  # nobody may pass through to its data directory
            os.chown(self.data, NOBODY, NOBODY)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]

    def _run(self, *args: str) -> None:
        def as_nobody() -> None:
            if os.geteuid() == 0:
                os.setgid(NOBODY)
                os.setuid(NOBODY)

        done = subprocess.run([str(self.bin / args[0]), *args[1:]], preexec_fn=as_nobody,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        if done.returncode != 0:
            reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"{args[0]} exited {done.returncode}: {reason[0]}")

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "--encoding=utf8")  # fmt: skip
        options = f"-k {self.data} -h 127.0.0.1 -p {self.port}"
        self._run("pg_ctl", "-D", str(self.data), "-w", "-l", str(self.data / "log"), "-o",
                  options, "start")  # fmt: skip

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def create_database(self, name: str) -> str:
        """A new, empty database; its URL names the psycopg2 driver (SQLAlchemy 2.1 reads a
        bare postgresql:// as psycopg 3)."""
        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres",
                                dbname="postgres")  # fmt: skip
        try:
            conn.autocommit = True
            with conn.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE {name}")
        finally:
            conn.close()
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{name}"


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    """One PostgreSQL server for the module; each test creates its own database on it."""
    root = Path(tempfile.mkdtemp(prefix="hookloop-pg-"))
    server = None
    try:
        server = Postgres(root)
        try:
            server.start()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            pytest.skip(f"PostgreSQL cannot start here: {err}")
        yield server
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_two_machines_share_a_study_on_a_fresh_postgresql_database(postgres, tmp_path):
    url = postgres.create_database("tune_shared")
    run_two_drivers(tmp_path, url)  # both exit 0 (a schema-creation race is retried)
    study = optuna.load_study(study_name="hookloop", storage=url)
    check_shared_study(study, tmp_path, alpha_lost=False)
    lr = study.best_params["optimizer.lr"]
    for host in ("alpha", "beta"):  # each writes the best config from the storage alone
        best = yaml.safe_load((tmp_path / host / "best_config.yaml").read_text())
        assert best["optimizer"]["lr"] == lr


@pytest.mark.slow
def test_a_lost_machines_trial_is_finished_by_the_other_on_postgresql(postgres, tmp_path):
    url = postgres.create_database("tune_lost")
    engine = sqlalchemy.create_engine(url)

    def alpha_running() -> bool:
        try:
            with engine.connect() as conn:
                return bool(conn.execute(sqlalchemy.text(ALPHA_RUNNING)).fetchall())
        except sqlalchemy.exc.ProgrammingError:  # no tables yet
            return False

    try:
        run_two_drivers(tmp_path, url, kill_alpha_when=alpha_running)
    finally:
        engine.dispose()
    study = optuna.load_study(study_name="hookloop", storage=url)
    check_shared_study(study, tmp_path, alpha_lost=True)
