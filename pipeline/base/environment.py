"""The environment a sweep runs in, as tags of its parent run: what to recreate to reproduce it;
and how its programs are named in the commands foldsweep prints.

The lock (``uv.lock`` of the checkout foldsweep is installed from) is named by its SHA-256, and
the installed version of every direct dependency is recorded beside it, with whether they are the
lock's: a sweep run from a hand-changed environment says so.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

LOCK_FILE = "uv.lock"
DISTRIBUTION = "foldsweep"
LOCK_HASH_TAG = "foldsweep.lock_hash"
LOCK_MATCHES_TAG = "foldsweep.lock_matches"
VERSION_TAG_PREFIX = "foldsweep.version."
NO_LOCK = "none"


def cache_directory() -> Path:
    """foldsweep's own directory in the user's cache, as ``cache_directory_name`` names it."""
    cache_home = _xdg_cache_home()
    return (cache_home if cache_home is not None else Path.home() / ".cache") / "foldsweep"


def cache_directory_name() -> str:
    """``$XDG_CACHE_HOME/foldsweep``, or ``~/.cache/foldsweep`` where that variable is not used."""
    return "$XDG_CACHE_HOME/foldsweep" if _xdg_cache_home() is not None else "~/.cache/foldsweep"


def _xdg_cache_home() -> Path | None:
    # The XDG spec: an unset, empty or relative $XDG_CACHE_HOME is ignored.
    cache_home = os.environ.get("XDG_CACHE_HOME", "")
    return Path(cache_home) if os.path.isabs(cache_home) else None


def program_name() -> str:
    """This command as the user can type it again: ``foldsweep`` when that is on the PATH, else
    the path it was invoked by (``.venv/bin/foldsweep``)."""
    program = "foldsweep"
    invoked = Path(sys.argv[0])
    on_path = shutil.which("foldsweep")
    if invoked.name == "foldsweep" and (on_path is None or Path(on_path).resolve() != invoked.resolve()):
        program = (
            os.path.relpath(invoked)
            if not invoked.is_absolute() or invoked.is_relative_to(Path.cwd())
            else str(invoked)
        )
    return shlex.quote(program)


def programs_off_path() -> Path | None:
    """The directory of this environment's programs (its ``python``, ``mlflow``) where they are
    not the ones on the PATH; None where they are."""
    here = Path(sys.executable).parent
    on_path = shutil.which("python")
    return None if on_path is not None and Path(on_path).parent.resolve() == here.resolve() else here


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``; None where it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def project_lock() -> Path | None:
    """The lock beside the package's checkout, when foldsweep is installed from one."""
    lock = Path(__file__).resolve().parents[2] / LOCK_FILE  # pipeline/base/ -> the checkout
    return lock if lock.is_file() else None


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def direct_dependencies(distribution: str = DISTRIBUTION) -> list[str]:
    """The names of the distribution's own runtime dependencies (not those of its extras)."""
    names = []
    for requirement in metadata.requires(distribution) or []:
        if "extra ==" in requirement.partition(";")[2]:
            continue
        names.append(_normalized(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]))
    return sorted(set(names))


def locked_versions(lock: Path) -> dict[str, str]:
    """Each package's version in a uv lock."""
    packages = tomllib.loads(lock.read_text(encoding="utf-8")).get("package", [])
    return {_normalized(package["name"]): package["version"] for package in packages if "version" in package}


@dataclass(frozen=True)
class Environment:
    lock_hash: str  # "sha256:<hex>" of the lock, or "none"
    versions: Mapping[str, str]  # distribution (and "python") -> installed version
    differences: tuple[str, ...]  # "<name> <installed> (uv.lock <locked>)" where the two differ

    @classmethod
    def current(cls) -> Environment:
        versions = {"python": platform.python_version(), DISTRIBUTION: metadata.version(DISTRIBUTION)}
        for name in direct_dependencies():
            versions[name] = installed_version(name) or "not installed"
        lock = project_lock()
        if lock is None:
            return cls(NO_LOCK, versions, ())
        locked = locked_versions(lock)
        differences = tuple(
            f"{name} {version} ({LOCK_FILE} {locked[name]})"
            for name, version in versions.items()
            if name in locked and name != DISTRIBUTION and locked[name] != version
        )
        return cls("sha256:" + hashlib.sha256(lock.read_bytes()).hexdigest(), versions, differences)

    def tags(self) -> dict[str, str]:
        """The parent run's tags: the lock's hash, whether the installed versions are the lock's, each version."""
        if self.lock_hash == NO_LOCK:
            matches = f"false: no {LOCK_FILE} (foldsweep is not installed from its checkout)"
        else:
            matches = "true" if not self.differences else "false: " + ", ".join(self.differences)
        return {
            LOCK_HASH_TAG: self.lock_hash,
            LOCK_MATCHES_TAG: matches,
            **{f"{VERSION_TAG_PREFIX}{name}": version for name, version in self.versions.items()},
        }


def recorded_environment(tags: Mapping[str, str]) -> list[str]:
    """A recorded sweep's environment as lines to print: the lock, then each version ([] before it was recorded)."""
    if LOCK_HASH_TAG not in tags:
        return []
    versions = sorted(
        (key.removeprefix(VERSION_TAG_PREFIX), value)
        for key, value in tags.items()
        if key.startswith(VERSION_TAG_PREFIX)
    )
    return [
        f"lock {tags[LOCK_HASH_TAG]} (installed versions match it: {tags.get(LOCK_MATCHES_TAG, '?')})",
        ", ".join(f"{name} {version}" for name, version in versions),
    ]


def environment_change(tags: Mapping[str, str], current: Environment) -> str:
    """What differs between a recorded sweep's environment (its tags) and ``current``: "" if nothing."""
    if LOCK_HASH_TAG not in tags:
        return ""
    recorded = {
        key.removeprefix(VERSION_TAG_PREFIX): value for key, value in tags.items() if key.startswith(VERSION_TAG_PREFIX)
    }
    changes = [
        f"{name} {recorded[name]} -> {version}"
        for name, version in current.versions.items()
        if name in recorded and recorded[name] != version
    ]
    if tags[LOCK_HASH_TAG] != current.lock_hash:
        changes.insert(0, f"lock {tags[LOCK_HASH_TAG][:19]} -> {current.lock_hash[:19]}")
    return ", ".join(changes)
