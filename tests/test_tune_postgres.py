"""Several machines on one study, on a real PostgreSQL server that the test starts
(``pgserver``, a pip-installable PostgreSQL): two ``hookloop tune`` drivers with their own
directories and host names (``HOOKLOOP_TUNE_HOST``) on a fresh database, then the same
with one of them SIGKILLed for good while it runs a trial.

Skipped, with the reason, where ``pgserver`` or ``psycopg2`` is not installed or the
server cannot start (``pip install -e '.[test]'`` installs both)."""

from __future__ import annotations

import pytest
import yaml

from test_tune_machines import ALPHA_RUNNING, check_shared_study, run_two_drivers

optuna = pytest.importorskip("optuna")
pytest.importorskip("psycopg2", reason="psycopg2 is not installed: pip install psycopg2-binary")
pgserver = pytest.importorskip("pgserver", reason="pgserver is not installed: pip install pgserver")
sqlalchemy = pytest.importorskip("sqlalchemy")


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    """One PostgreSQL server for the module; each test creates its own database on it."""
    pgdata = tmp_path_factory.mktemp("pg")
    try:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
    except Exception as err:  # pgserver raises whatever initdb or pg_ctl reported
        reason = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
        pytest.skip(f"pgserver cannot start PostgreSQL here: {type(err).__name__}: {reason}")
    try:
        yield server
    finally:
        server.cleanup()


def _fresh_database(server, name: str) -> str:
    """A new, empty database; its URL names the psycopg2 driver (SQLAlchemy 2.1 reads a
    bare postgresql:// as psycopg 3)."""
    server.psql(f"CREATE DATABASE {name};")
    return server.get_uri(name).replace("postgresql://", "postgresql+psycopg2://", 1)


@pytest.mark.slow
def test_two_machines_share_a_study_on_a_fresh_postgresql_database(postgres, tmp_path):
    url = _fresh_database(postgres, "tune_shared")
    run_two_drivers(tmp_path, url)  # both exit 0 (a schema-creation race is retried)
    study = optuna.load_study(study_name="hookloop", storage=url)
    check_shared_study(study, tmp_path, alpha_lost=False)
    lr = study.best_params["optimizer.lr"]
    for host in ("alpha", "beta"):  # each writes the best config from the storage alone
        best = yaml.safe_load((tmp_path / host / "best_config.yaml").read_text())
        assert best["optimizer"]["lr"] == lr


@pytest.mark.slow
def test_a_lost_machines_trial_is_finished_by_the_other_on_postgresql(postgres, tmp_path):
    url = _fresh_database(postgres, "tune_lost")
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
