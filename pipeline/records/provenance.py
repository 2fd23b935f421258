"""Where a run came from and what data it saw, in MLflow's own vocabulary: the user, the command
and the git commit as MLflow's clients tag a run (the runs table's User and Source columns), and
the sweep's data splits as MLflow datasets (its Dataset column, and ``datasets.digest`` in a
search finds every run on the same data)."""

from __future__ import annotations

import getpass
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.inputs.datasets import Dataset
from pipeline.inputs.spec import DatasetSpec

# The contexts of the splits' inputs: the CV training split (folds and refit train on it) and the
# held-out test split (only the refit is scored on it).
TRAINING = "training"
TESTING = "testing"
# MLflow keeps a dataset's digest in 36 characters.
DIGEST_LENGTH = 36


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as it was typed (``foldsweep run sweeps/quickstart.yaml``)."""
    argv = sys.argv if argv is None else argv
    return shlex.join([Path(argv[0]).name, *argv[1:]]) if argv else ""


def run_source_tags(code: Path, command: str) -> dict[str, str]:
    """MLflow's source tags of a run started by ``command``: the user, the command as the
    source's name, and the git commit, branch and remote of the working tree that holds
    ``code`` (the experiment module), where there is one."""
    from mlflow.utils import git_utils
    from mlflow.utils.mlflow_tags import (
        MLFLOW_GIT_BRANCH,
        MLFLOW_GIT_COMMIT,
        MLFLOW_GIT_REPO_URL,
        MLFLOW_SOURCE_NAME,
        MLFLOW_SOURCE_TYPE,
        MLFLOW_USER,
    )

    tags = {MLFLOW_USER: _user(), MLFLOW_SOURCE_NAME: command, MLFLOW_SOURCE_TYPE: "LOCAL"}
    where = str(code.resolve().parent)
    commit = git_utils.get_git_commit(where)
    if commit is not None:
        tags[MLFLOW_GIT_COMMIT] = commit
        for key, value in (
            (MLFLOW_GIT_BRANCH, git_utils.get_git_branch(where)),
            (MLFLOW_GIT_REPO_URL, git_utils.get_git_repo_url(where)),
        ):
            if value:
                tags[key] = value
    return tags


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid without a name (some containers)
        return "unknown"


@dataclass(frozen=True)
class DataInput:
    """One split of the sweep's data as an MLflow dataset input (the fields of
    ``mlflow.entities.Dataset``, JSON where MLflow keeps JSON), in ``context``."""

    name: str
    digest: str
    source_type: str
    source: str
    schema: str
    profile: str
    context: str

    def entity(self) -> Any:
        """The ``mlflow.entities.DatasetInput`` ``MlflowClient.log_inputs`` takes."""
        from mlflow.entities import Dataset as DatasetEntity
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        dataset = DatasetEntity(
            name=self.name,
            digest=self.digest,
            source_type=self.source_type,
            source=self.source,
            schema=self.schema,
            profile=self.profile,
        )
        return DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, self.context)])


def data_inputs(dataset: Dataset, spec: DatasetSpec) -> list[DataInput]:
    """The CV training split and, where there is one, the held-out test split: each named after
    the dataset and its split, digested by the dataset's fingerprint (the sweep's param
    ``dataset_fingerprint``, computed once per dataset), sourced from its file or its built-in
    generator, profiled with its shapes and classes."""
    splits = [(TRAINING, dataset.x, dataset.y)]
    if dataset.x_test is not None and dataset.y_test is not None:
        splits.append((TESTING, dataset.x_test, dataset.y_test))
    return [_data_input(dataset, spec, context, x, y) for context, x, y in splits]


def _data_input(dataset: Dataset, spec: DatasetSpec, context: str, x: Any, y: Any) -> DataInput:
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.filesystem_dataset_source import FileSystemDatasetSource
    from mlflow.data.numpy_dataset import from_numpy

    # MLflow makes its artifact dataset sources as it is imported, one per artifact store
    from mlflow.data.sources import LocalArtifactDatasetSource  # type: ignore[attr-defined]

    source: FileSystemDatasetSource | CodeDatasetSource
    if spec.path is not None:
        source = LocalArtifactDatasetSource(str(Path(spec.path).resolve()))
    else:
        source = CodeDatasetSource({"foldsweep.builtin": str(spec.name), **_options(spec)})
    digest = dataset.fingerprint[:DIGEST_LENGTH]
    name = f"{dataset.name}-{'train' if context == TRAINING else 'test'}"
    described = from_numpy(x, targets=y, source=source, name=name, digest=digest).to_dict()
    profile = json.loads(described["profile"])
    if dataset.class_names is not None:
        profile["classes"] = list(dataset.class_names)
    elif dataset.n_classes:
        profile["classes"] = dataset.n_classes
    return DataInput(
        name=name,
        digest=digest,
        source_type=described["source_type"],
        source=described["source"],
        schema=described["schema"],
        profile=json.dumps(profile),
        context=context,
    )


@dataclass(frozen=True)
class Provenance:
    """Where a command's runs come from (MLflow's source tags) and the data they see."""

    run_tags: Mapping[str, str]
    data: Sequence[DataInput]

    @classmethod
    def of(cls, experiment_path: Path, dataset: Dataset, spec: DatasetSpec) -> Provenance:
        """This command's, running the experiment at ``experiment_path`` on ``dataset`` (read as
        ``spec``, its path resolved)."""
        return cls(run_source_tags(experiment_path, command_line()), data_inputs(dataset, spec))


def _options(spec: DatasetSpec) -> dict[str, str]:
    return {f"foldsweep.option.{key}": json.dumps(value) for key, value in sorted(spec.options.items())}
