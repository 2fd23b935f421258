"""Opening a SQLite store while another process migrates it without foldsweep's lock: MLflow's
client migrates a new store as it is made (MLflow 3.17), and two migrations at once fail in
whatever way their steps met."""

import contextlib
import sqlite3
from pathlib import Path

import pytest

from pipeline.base.errors import TrackingError
from pipeline.records import stores


class Client:
    """A client whose first constructions fail as ``failures`` say, each after the other process
    took one more migration step on ``database`` (``steps``), as a racing migration does."""

    def __init__(self, database: Path, failures: list[Exception], steps: int):
        if failures:
            if steps:
                with contextlib.closing(sqlite3.connect(database)) as connection:
                    connection.execute(f"CREATE TABLE step_{len(failures)} (x)")
            raise failures.pop(0)
        self.searched = 0

    def search_experiments(self, max_results: int) -> list:
        self.searched += 1
        return []


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(stores.time, "sleep", slept.append)
    return slept


def migrated_up_to(uri: str, revision: str) -> None:
    """A new store that MLflow's own migrations took up to ``revision``, not beyond."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase

    engine = sqlalchemy.create_engine(uri)
    InitialBase.metadata.create_all(engine)
    with engine.begin() as connection:
        config = _get_alembic_config(uri)
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
    engine.dispose()


def test_an_attempt_that_fails_while_the_schema_changes_under_it_is_made_again(tmp_path, pauses):
    database = tmp_path / "mlflow.db"
    failures = [
        KeyError("dimension_attributes"),
        sqlite3.OperationalError("table _alembic_tmp_model_versions already exists"),
    ]
    client = stores.ready_store(lambda: Client(database, failures, steps=1), f"sqlite:///{database}")
    assert isinstance(client, Client) and client.searched == 1
    assert failures == [] and pauses == [0.1, 0.2]


def test_a_locked_store_is_waited_for_even_when_nothing_changed(tmp_path, pauses):
    database = tmp_path / "mlflow.db"
    failures = [sqlite3.OperationalError("database is locked")]
    client = stores.ready_store(lambda: Client(database, failures, steps=0), f"sqlite:///{database}")
    assert client.searched == 1 and pauses == [0.1]


def test_a_step_of_the_other_migration_after_the_failure_has_the_attempt_made_again(tmp_path, monkeypatch):
    """The other process added a column before this attempt began and moves its revision on only
    seconds after the attempt failed on that column (a busy machine): the watch sees the step."""
    database = tmp_path / "mlflow.db"
    with contextlib.closing(sqlite3.connect(database)) as connection:
        connection.execute("CREATE TABLE metrics (key, value)")
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            with contextlib.closing(sqlite3.connect(database)) as connection:
                connection.execute("ALTER TABLE metrics ADD COLUMN step")

    monkeypatch.setattr(stores.time, "sleep", sleep)
    failures = [sqlite3.OperationalError("duplicate column name: step")]
    client = stores.ready_store(lambda: Client(database, failures, steps=0), f"sqlite:///{database}")
    assert client.searched == 1 and failures == []
    assert slept == [stores.SCHEMA_WATCH_POLL_S] * 3 + [0.1]  # three polls of the watch, then the retry's pause


def test_an_error_on_a_schema_nobody_changes_is_raised_once_the_watch_saw_it_still(tmp_path, pauses):
    database = tmp_path / "mlflow.db"
    sqlite3.connect(database).close()
    failures = [sqlite3.OperationalError("no such column: runs.workspace")]
    with pytest.raises(TrackingError, match="mlflow.db' cannot be opened: no such column: runs.workspace") as refused:
        stores.ready_store(lambda: Client(database, failures, steps=0), f"sqlite:///{database}")
    assert isinstance(refused.value.__cause__, sqlite3.OperationalError)
    assert pauses == [stores.SCHEMA_WATCH_POLL_S] * stores.SCHEMA_WATCH_POLLS


def test_a_store_of_a_schema_this_mlflow_does_not_know_is_refused_as_it_is(tmp_path, monkeypatch):
    """A store migrated by a newer MLflow: MLflow's own reason, one message, the file untouched."""
    from mlflow.tracking import MlflowClient

    database = tmp_path / "mlflow.db"
    # Not through a client: MLflow keeps the stores its clients opened, checked, for its process.
    migrated_up_to(f"sqlite:///{database}", "heads")
    with contextlib.closing(sqlite3.connect(database)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = 'ffffffffffff'")
    before = database.read_bytes()
    monkeypatch.setattr(stores, "SCHEMA_WATCH_POLLS", 1)
    with pytest.raises(
        TrackingError,
        match="cannot be opened: Detected out-of-date database schema "
        r"\(found version ffffffffffff",
    ):
        stores.ready_store(lambda: MlflowClient(f"sqlite:///{database}"), f"sqlite:///{database}")
    assert database.read_bytes() == before


def test_a_store_still_changing_after_every_attempt_raises_the_last_error(tmp_path, pauses):
    database = tmp_path / "mlflow.db"
    failures = [KeyError(f"step {n}") for n in range(stores.STORE_OPEN_ATTEMPTS)]
    with pytest.raises(KeyError, match=f"step {stores.STORE_OPEN_ATTEMPTS - 1}"):
        stores.ready_store(lambda: Client(database, failures, steps=1), f"sqlite:///{database}")
    assert failures == [] and len(pauses) == stores.STORE_OPEN_ATTEMPTS - 1


@pytest.mark.parametrize("moves", [True, False], ids=["being created", "still"])
def test_a_store_another_process_is_creating_is_not_taken_for_another_programs_database(tmp_path, monkeypatch, moves):
    """MLflow makes a new store's first tables before its migration table: a sweep that looks at
    that moment waits for the schema to move; a database that stays so is not an MLflow store."""
    database = tmp_path / "mlflow.db"
    with contextlib.closing(sqlite3.connect(database)) as connection:
        connection.execute("CREATE TABLE experiments (experiment_id)")
        connection.execute("CREATE TABLE runs (run_uuid)")

    def sleep(seconds: float) -> None:
        if moves:
            with contextlib.closing(sqlite3.connect(database)) as connection:
                connection.execute("CREATE TABLE IF NOT EXISTS alembic_version (version_num)")

    monkeypatch.setattr(stores.time, "sleep", sleep)
    monkeypatch.setattr(stores, "SCHEMA_WATCH_POLLS", 3)
    if moves:
        stores.check_tracking_uri(f"sqlite:///{database}")
    else:
        with pytest.raises(
            TrackingError,
            match="is a SQLite database but not an MLflow store "
            r"\(its tables: experiments, runs\)",
        ):
            stores.check_tracking_uri(f"sqlite:///{database}")


def test_a_migration_that_died_mid_step_in_another_process_leaves_nothing_that_stops_the_next(tmp_path, monkeypatch):
    """The other opener lost the race and died between Alembic's copy of ``experiment_tags`` and
    its swap (revision 17e22815139b): the copy is dropped, the table's rows kept, the store
    migrated to the end."""
    from mlflow.tracking import MlflowClient

    database = tmp_path / "mlflow.db"
    uri = f"sqlite:///{database}"
    migrated_up_to(uri, "1971f2d9a75b")
    with contextlib.closing(sqlite3.connect(database)) as connection, connection:
        connection.execute(
            "INSERT INTO experiments (experiment_id, name, lifecycle_stage) VALUES (7, 'kept', 'active')"
        )
        connection.execute("INSERT INTO experiment_tags (key, value, experiment_id) VALUES ('owner', 'ada', 7)")
        connection.execute("CREATE TABLE _alembic_tmp_experiment_tags (key VARCHAR(250), value TEXT, experiment_id)")
    monkeypatch.setattr(stores, "SCHEMA_WATCH_POLLS", 3)  # nobody else migrates it: no need to watch long
    client = stores.ready_store(lambda: MlflowClient(uri), uri)
    assert client.get_experiment("7").tags == {"owner": "ada"}
    with contextlib.closing(sqlite3.connect(database)) as connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "experiment_tags" in tables and not any(name.startswith("_alembic_tmp_") for name in tables)


def test_the_copy_of_a_table_a_migration_already_dropped_is_kept(tmp_path, pauses):
    """Then the copy holds the table's only rows: the attempt's error is raised, nothing dropped."""
    database = tmp_path / "mlflow.db"
    with contextlib.closing(sqlite3.connect(database)) as connection, connection:
        connection.execute("CREATE TABLE _alembic_tmp_tags (key, value)")
        connection.execute("INSERT INTO _alembic_tmp_tags VALUES ('owner', 'ada')")
    failures = [sqlite3.OperationalError("no such table: tags")]
    with pytest.raises(TrackingError, match="cannot be opened: no such table: tags"):
        stores.ready_store(lambda: Client(database, failures, steps=0), f"sqlite:///{database}")
    with contextlib.closing(sqlite3.connect(database)) as connection:
        assert list(connection.execute("SELECT * FROM _alembic_tmp_tags")) == [("owner", "ada")]
