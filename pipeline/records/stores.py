"""Tracking stores before anything touches them: is a URI one MLflow can open, from here, as the
user who runs the command; the lock that keeps two processes from creating one SQLite store at
once; a store made ready (created or upgraded) under it; and a new SQLite store started as a
copy of the empty store this MLflow made once, in foldsweep's cache.

Every check reads and nothing writes: a store that is refused is left byte for byte as it was.
This module imports neither MLflow nor Ray, so a bad URI is refused at once.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

from pipeline.base.environment import cache_directory, installed_version
from pipeline.base.errors import TrackingError
from pipeline.base.mlflow_private import MLFLOW_STORE_TABLES

SQLITE_HEADER = b"SQLite format 3\x00"
OTHER_SCHEMES = ("postgresql", "mysql", "databricks")
SERVER_TIMEOUT_S = 10


class ExperimentSearcher(Protocol):
    """What opening a store asks of its client (MlflowClient has it): a search that reads the store."""

    def search_experiments(self, *, max_results: int) -> Any: ...


Client = TypeVar("Client", bound=ExperimentSearcher)


def check_tracking_uri(uri: str, *, source: str = "tracking.uri") -> None:
    """Refuse a tracking URI that cannot work, before anything starts; ``source`` is what the
    user wrote it in (``tracking.uri`` of a spec, or ``--tracking-uri``).

    Raises:
        TrackingError: no scheme or an unsupported one; a SQLite path where no store can be
            created, or a file that is not an MLflow store; a server that does not answer as
            MLflow, or refuses this client's credentials.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite" and not uri.startswith("sqlite:///") and uri != "sqlite://":
        raise TrackingError(
            f"{source} must be sqlite:/// and the SQLite file's path (sqlite:///mlflow.db, "
            f"sqlite:////home/me/mlflow.db), got {uri!r} (did you mean sqlite:///{uri[len('sqlite://') :]}?)"
        )
    if parsed.scheme == "file":
        raise TrackingError(
            f"{source}: the installed MLflow refuses its file store (an mlruns directory, 'in maintenance mode'): "
            f"record to a database store, e.g. sqlite:///mlflow.db, got {uri!r}"
        )
    if parsed.scheme == "sqlite":
        database = sqlite_path(uri)
        if database is not None:
            _check_sqlite_file(uri, database, source)
    elif parsed.scheme in ("http", "https"):
        _check_server(uri, source)
    elif parsed.scheme not in OTHER_SCHEMES:
        hint = f" (did you mean sqlite:///{uri}?)" if not parsed.scheme and uri.strip() else ""
        raise TrackingError(
            f"{source} must be sqlite:///FILE (e.g. sqlite:///mlflow.db), http(s)://HOST:PORT or another "
            f"MLflow store URI, got {uri!r}{hint}"
        )


def require_existing_store(
    uri: str, *, source: str = "--tracking-uri", purpose: str = "there is no recorded sweep to read"
) -> None:
    """Commands that read a recorded sweep refuse a SQLite store that does not exist, rather
    than create an empty one to find nothing in.

    Raises:
        TrackingError: the URI is refused by ``check_tracking_uri``, or names no file.
    """
    check_tracking_uri(uri, source=source)
    database = sqlite_path(uri)
    if database is not None and not database.is_file():
        raise TrackingError(f"{source}: no MLflow store at {uri!r} ({str(database)!r} does not exist), so {purpose}")


def pasteable_uri(uri: str) -> str:
    """The URI as a printed command gives it, to be pasted in any directory: a SQLite file's path
    absolute."""
    database = sqlite_path(uri)
    return f"sqlite:///{database}" if database is not None else uri


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` URI, absolute (None for an in-memory store)."""
    path = uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else None
    if not path or path == ":memory:":
        return None
    return Path(path).resolve()


def _check_sqlite_file(uri: str, database: Path, source: str) -> None:
    if database.is_dir():
        raise TrackingError(
            f"{source}: {uri!r} names a directory, not a SQLite file (e.g. sqlite:///{database / 'mlflow.db'})"
        )
    if not database.exists():
        directory = database.parent
        if not directory.is_dir():
            raise TrackingError(
                f"{source}: the directory of the SQLite file must exist, got {uri!r} (no directory {str(directory)!r})"
            )
        try:  # the only sure test (permissions, read-only mounts, /proc): a file made and removed at once
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".foldsweep-probe-"):
                pass
        except OSError as exc:
            raise TrackingError(
                f"{source}: no store can be created at {uri!r}: files cannot be created in "
                f"{str(directory)!r} ({exc.strerror or exc})"
            ) from None
        return
    if database.stat().st_size == 0:  # an empty file becomes a new store
        return
    try:
        with open(database, "rb") as file:
            header = file.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise TrackingError(f"{source}: cannot read the store {uri!r}: {exc.strerror or exc}") from None
    if header != SQLITE_HEADER:
        raise TrackingError(
            f"{source}: {str(database)!r} is not a SQLite database, so not an MLflow store "
            f"(got {uri!r}); name a new file or an existing MLflow store"
        )
    tables = _sqlite_tables(database, uri, source)
    if tables and not MLFLOW_STORE_TABLES <= tables and not _being_created(database, tables):
        shown = ", ".join(sorted(tables)[:6]) + (", ..." if len(tables) > 6 else "")
        raise TrackingError(
            f"{source}: {str(database)!r} is a SQLite database but not an MLflow store (its tables: "
            f"{shown}), got {uri!r}; name a new file or an existing MLflow store"
        )
    if not os.access(database, os.W_OK):
        raise TrackingError(f"{source}: the store {uri!r} is not writable by this user")


def _sqlite_tables(database: Path, uri: str, source: str) -> set[str]:
    try:
        # Read-only and immutable: opening it this way cannot change the file or leave a journal.
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro&immutable=1", uri=True)) as connection:
            return {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise TrackingError(f"{source}: cannot read the store {uri!r}: {exc}") from None


def server_credentials() -> dict[str, str]:
    """The HTTP headers MLflow's client sends a server, from its environment variables."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {}


def _check_server(uri: str, source: str) -> None:
    """The server answers as MLflow (``/health``) and lets this client read runs (its own
    credentials, where the server asks for some)."""
    base = uri.rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=SERVER_TIMEOUT_S) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        raise TrackingError(f"{source}: {uri!r} answered HTTP {exc.code} at /health: is it an MLflow server?") from None
    except (OSError, ValueError) as exc:
        raise TrackingError(
            f"{source}: cannot reach an MLflow server at {uri!r}: {getattr(exc, 'reason', exc)}"
        ) from None
    headers = {"Content-Type": "application/json", **server_credentials()}
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/experiments/search",
        method="POST",
        headers=headers,
        data=json.dumps({"max_results": 1}).encode(),
    )
    try:
        with urllib.request.urlopen(request, timeout=SERVER_TIMEOUT_S) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            given = "refuses the credentials of" if "Authorization" in headers else "asks for credentials: set"
            raise TrackingError(
                f"{source}: the MLflow server at {uri!r} {given} MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                f"(HTTP {exc.code})"
            ) from None
        raise TrackingError(
            f"{source}: {uri!r} answered HTTP {exc.code} to a search for experiments: is it an MLflow tracking server?"
        ) from None
    except (OSError, ValueError) as exc:
        raise TrackingError(
            f"{source}: cannot reach an MLflow server at {uri!r}: {getattr(exc, 'reason', exc)}"
        ) from None


@contextlib.contextmanager
def store_lock(database: Path) -> Iterator[None]:
    """An exclusive lock on creating or upgrading the store ``database``, shared by every process
    on this machine, kept in the system's temporary directory: not beside the store, where a
    command that only reads it would leave a file behind."""
    directory = Path(tempfile.gettempdir()) / "foldsweep-locks"
    directory.mkdir(exist_ok=True)
    name = hashlib.sha256(str(database).encode()).hexdigest()[:24]
    with open(directory / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# How often opening a store is tried while another process creates or upgrades it.
STORE_OPEN_ATTEMPTS = 40
# How long a store's schema is watched after a failed attempt, for a step of another process's
# migration (which pauses between its steps, longest on a busy machine), before the failure is
# taken for one of the store itself.
SCHEMA_WATCH_POLLS = 50
SCHEMA_WATCH_POLL_S = 0.1
# What Alembic names its copy of a SQLite table while it alters it.
INTERRUPTED_COPY_PREFIX = "_alembic_tmp_"


def ready_store(open_client: Callable[[], Client], uri: str) -> Client:
    """The client ``open_client()`` makes of ``uri``, its SQLite store created or upgraded before
    anything else here touches it, under a lock (``store_lock``).

    Another process may migrate the same new store at once without the lock (the MLflow UI, a
    script polling the runs): MLflow's migration is not safe against that, and the attempt fails
    with whatever the two interleaved steps met (``table _alembic_tmp_experiments already exists``,
    ``duplicate column name``, a KeyError, a CircularDependencyError, ``database is locked``). So
    an attempt that fails while the store's schema moves (since the attempt began, or in the
    seconds after) is tried again, and so is one that failed on what a migrator that died
    mid-step left behind (``_dropped_interrupted_copies``). One that fails on a schema nobody is
    changing is the store's own (one this MLflow cannot migrate, e.g. from a newer MLflow).
    Making the client is part of the attempt because MLflow's client migrates its store as it is
    made.

    Raises:
        TrackingError: the store cannot be opened, and nobody is changing its schema."""
    database = sqlite_path(uri)
    if database is None:
        return open_client()
    with store_lock(database):
        for attempt in range(STORE_OPEN_ATTEMPTS - 1):
            before = _schema_state(database)
            try:
                return _opened(open_client)
            except Exception as exc:
                if (
                    "database is locked" not in str(exc)
                    and not _schema_moves(database, before)
                    and not _dropped_interrupted_copies(database)
                ):
                    raise TrackingError(
                        f"the tracking store {uri!r} cannot be opened: {' '.join(str(exc).split())}"
                    ) from exc
                time.sleep(min(0.1 * (attempt + 1), 1.0))
        return _opened(open_client)


# What a new store holds once MLflow has made it, besides its empty tables: the schema's revision,
# the default workspace and the default experiment (which names the store's artifact root and its
# creation time, so an empty store keeps every row but that one: MLflow makes it as it opens a copy).
EMPTY_STORE_ROWS = {"alembic_version": 1, "workspaces": 1, "experiments": 1}
DEFAULT_EXPERIMENT_ID = 0


def start_from_empty_store(uri: str, make_client: Callable[[str], Any]) -> None:
    """A new SQLite store at ``uri`` made a copy of the empty store this MLflow, SQLAlchemy and
    Alembic made once (``empty_store``): MLflow's migrations of a new store took ~1.7 s of CPU on
    a 2-core machine, beside Ray's start, and opening a store that has its tables takes ~0.05 s.

    Nothing is done to a store that exists, nor where no empty store can be made; the copy appears
    at ``uri`` whole or not at all (linked once written), so a process that creates the same
    store at once (the MLflow UI) finds either nothing or the copy, and MLflow takes it from there.
    ``make_client(uri)`` is an MLflow client of ``uri``."""
    database = sqlite_path(uri)
    if database is None or database.exists() or not database.parent.is_dir():
        return
    template = empty_store(make_client)
    if template is None:
        return
    written = _scratch_beside(database)
    try:
        with open(template, "rb") as source, open(written, "xb") as copy:
            shutil.copyfileobj(source, copy)
        os.link(written, database)
    except OSError:  # the store appeared meanwhile, or its file system links no files
        pass
    finally:
        with contextlib.suppress(OSError):
            written.unlink()


def empty_store(make_client: Callable[[str], Any]) -> Path | None:
    """An empty store of this MLflow (its tables, the schema's revision and default workspace,
    no experiment), in foldsweep's cache directory, made there by MLflow on first use; None
    where a new store holds more than ``EMPTY_STORE_ROWS`` (a later MLflow's), or the cache
    cannot be written."""
    versions = "-".join(installed_version(library) or "none" for library in ("mlflow", "sqlalchemy", "alembic"))
    template = cache_directory() / "empty-stores" / f"mlflow-{versions}.db"
    if template.is_file():
        return template
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        made = _scratch_beside(template)
        try:
            make_client(f"sqlite:///{made}").search_experiments(max_results=1)
            with contextlib.closing(sqlite3.connect(made)) as connection, connection:
                if _row_counts(connection) != EMPTY_STORE_ROWS:
                    return None
                connection.execute("DELETE FROM experiments WHERE experiment_id = ?", (DEFAULT_EXPERIMENT_ID,))
            os.replace(made, template)
        finally:
            with contextlib.suppress(OSError):
                made.unlink()
    except Exception:  # no empty store: the store is made as MLflow makes it
        return None
    return template


def _row_counts(connection: sqlite3.Connection) -> dict[str, int]:
    names = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    counts = {name: connection.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0] for name in names}
    return {name: count for name, count in counts.items() if count}


def _scratch_beside(path: Path) -> Path:
    """A file name of this process's own beside ``path``, for what is written before it is moved there."""
    return path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.new")


def _opened(open_client: Callable[[], Client]) -> Client:
    client = open_client()
    client.search_experiments(max_results=1)
    return client


def _dropped_interrupted_copies(database: Path) -> list[str]:
    """Drop the copies that another process's interrupted migration left of tables that still
    exist, and name them. Alembic alters a SQLite table by copying it into ``_alembic_tmp_NAME``,
    dropping NAME and renaming the copy, each step committed on its own: a migrator that dies
    between the first and the second (the MLflow UI or a script that lost the race, see
    ``ready_store``) leaves a copy that makes every later migration of NAME fail with ``table
    _alembic_tmp_NAME already exists``. While NAME exists it holds the data and the copy is
    scratch; a copy whose table is gone holds the only data and is left alone."""
    try:
        with contextlib.closing(sqlite3.connect(database, timeout=5)) as connection, connection:
            names = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            copies = sorted(
                name
                for name in names
                if name.startswith(INTERRUPTED_COPY_PREFIX) and name.removeprefix(INTERRUPTED_COPY_PREFIX) in names
            )
            for copy in copies:
                connection.execute(f'DROP TABLE "{copy}"')
    except sqlite3.Error:  # the attempt's own error is the one to report
        return []
    return copies


def _being_created(database: Path, tables: set[str]) -> bool:
    """Another process is creating this MLflow store right now: MLflow makes a new store's first
    tables (experiments, runs, ...) before its migration table, and the schema moves on."""
    return {"experiments", "runs"} <= tables and _schema_moves(database, _schema_state(database))


def _schema_moves(database: Path, before: tuple[str, ...] | None) -> bool:
    """Another process is changing the store's schema: it differs from ``before``, or comes to
    within the watch (the other migration's next step, after the one ours failed on)."""
    for poll in range(SCHEMA_WATCH_POLLS + 1):
        state = _schema_state(database)
        if state is None or state != before:
            return True
        if poll < SCHEMA_WATCH_POLLS:
            time.sleep(SCHEMA_WATCH_POLL_S)
    return False


def _schema_state(database: Path) -> tuple[str, ...] | None:
    """The store's tables (with their columns) and migration revision, read without writing:
    empty while there is no store yet, None while another process holds it to write."""
    if not database.exists():
        return ()
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=1)) as connection:
            tables = sorted(connection.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
            revision = (
                list(connection.execute("SELECT version_num FROM alembic_version"))
                if any(name == "alembic_version" for name, _ in tables)
                else []
            )
    except sqlite3.Error as exc:
        return None if "locked" in str(exc) else (f"unreadable: {exc}",)
    return tuple(f"{name}: {sql}" for name, sql in tables) + tuple(row[0] for row in revision)


def quiet_mlflow() -> None:
    # Artifact downloads (reruns read the spec and config back) would draw progress bars.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # Schema migrations of a new SQLite store log a dozen INFO lines; users need none of them.
    for name in ("alembic", "mlflow.store.db.utils", "mlflow.tracking", "mlflow.store", "mlflow.system_metrics"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # The refit's model lists its requirements itself (pipeline.records.model_package); MLflow
    # warns that it cannot find pip's version for a conda.yaml nobody asked for.
    logging.getLogger("mlflow.utils.environment").setLevel(logging.ERROR)
