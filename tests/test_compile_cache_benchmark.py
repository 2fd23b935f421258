"""benchmarks.compile_cache: the sweeps it runs are valid specs, and what it refuses. Its reader of
recorded trials is tested in test_benchmark_readers.py; a run of it (`--quick`: two minutes of
sweeps) is left to the command, as make test has the package's cache tested in test_compile_cache.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from benchmarks import compile_cache
from pipeline.cli import app


@pytest.mark.parametrize("one_trial", [True, False], ids=["one trial", "12 configs"])
def test_each_sweep_it_runs_is_a_valid_spec(tmp_path, one_trial):
    path = compile_cache.spec(2, tmp_path, one_trial=one_trial)
    validated = CliRunner().invoke(app, ["validate", str(path)])
    assert validated.exit_code == 0, validated.output
    assert validated.output.startswith(f"ok {path}")


def test_compile_cache_refuses_a_single_epoch_whose_compile_time_no_trial_measures(capsys):
    with pytest.raises(SystemExit) as refused:
        compile_cache.main(["--one-trial", "--epochs", "1"])
    assert refused.value.code == 2
    assert "--epochs: at least 2, for the trials to measure their compile_s; got 1" in capsys.readouterr().err
