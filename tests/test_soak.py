"""A quick run of benchmarks.soak (2 trials through the session's Ray: what it prints, not its numbers)."""

from __future__ import annotations

import tempfile

import pytest

from benchmarks import soak

pytestmark = pytest.mark.e2e  # a sweep on the session's Ray


def test_soak_runs_its_trials_through_a_sweep_and_finds_each_recorded_once(ray_cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # soak works in a directory of its own, under the temporary one
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    soak.main(["--trials", "2", "--every", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("MLflow: 2 trial runs, 2 FINISHED, 2 distinct trials;")
    row = lines[-2].split()
    assert row[0] == "2" and int(row[1]) >= 1
