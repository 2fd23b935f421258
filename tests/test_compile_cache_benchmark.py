"""A quick run of benchmarks.compile_cache (its smallest settings: what its result holds, not its numbers),
and what it refuses. Its reader of recorded trials is tested in test_benchmark_readers.py."""

from __future__ import annotations

import json

import pytest

from benchmarks import compile_cache


@pytest.mark.e2e  # it runs the benchmark's own processes
def test_compile_cache_quick_runs_cold_and_warm_and_the_warm_run_loads_what_the_cold_one_compiled(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert compile_cache.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result) == ["cold", "warm"] and result["cold"]["trials"] == result["warm"]["trials"] == 1
    assert result["cold"]["hits"] == 0 and result["cold"]["misses"] > 0 and result["cold"]["compile_s"] > 0
    assert result["warm"]["hits"] == result["cold"]["misses"] and result["warm"]["misses"] == 0
    assert result["warm"]["fold_losses"] == result["cold"]["fold_losses"] and result["cold"]["fold_losses"]
    assert "every fold's recorded losses the same with the cache cold, warm: yes" in capsys.readouterr().out


def test_compile_cache_refuses_a_single_epoch_whose_compile_time_no_trial_measures(capsys):
    with pytest.raises(SystemExit) as refused:
        compile_cache.main(["--one-trial", "--epochs", "1"])
    assert refused.value.code == 2
    assert "--epochs: at least 2, for the trials to measure their compile_s; got 1" in capsys.readouterr().err
