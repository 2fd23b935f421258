"""The experiment's code as a sweep ran it, kept with the sweep: the experiment module and the
modules beside it that it imported, logged as the parent run's ``code/`` artifacts, with each
file's digest in the tag ``foldsweep.code``. A rerun trains the files beside the experiment where
they are still these, and the recorded ones where they changed or are gone, so that a trial reruns
to its recorded numbers from the record alone."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

CODE_ARTIFACT = "code"
DIGEST_CHARACTERS = 16


def neighbour_modules(experiment_path: Path) -> list[Path]:
    """The modules beside the experiment that are imported in this process (what it imported of
    its own directory)."""
    directory = experiment_path.resolve().parent
    found = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.endswith(".py") and Path(file).resolve().parent == directory:
            found.add(Path(file).resolve())
    return sorted(found - {experiment_path.resolve()})


def experiment_files(experiment_path: Path) -> list[Path]:
    """The experiment module and the modules beside it this process imported."""
    return [experiment_path.resolve(), *neighbour_modules(experiment_path)]


def code_digests(files: Sequence[Path]) -> dict[str, str]:
    """Each file's name and the start of its content's SHA-256."""
    return {file.name: hashlib.sha256(file.read_bytes()).hexdigest()[:DIGEST_CHARACTERS] for file in files}


def code_tag(files: Sequence[Path]) -> str:
    """The tag's value: the files' digests as JSON."""
    return json.dumps(code_digests(files), sort_keys=True)


def changed_files(tag: str, directory: Path) -> list[str]:
    """The recorded files (``code_tag``'s value) that ``directory`` no longer holds as they were:
    changed or gone."""
    recorded: Mapping[str, str] = json.loads(tag)
    changed = []
    for name, digest in sorted(recorded.items()):
        path = directory / name
        if not path.is_file() or code_digests([path])[name] != digest:
            changed.append(name)
    return changed
