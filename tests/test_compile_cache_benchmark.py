"""A quick run of benchmarks.compile_cache (its smallest settings: what its result holds, not its numbers),
and what it refuses. Its reader of recorded trials is tested in test_benchmark_readers.py."""

from __future__ import annotations

import json

import pytest

from benchmarks import compile_cache


@pytest.mark.e2e  # it runs the benchmark's own process
def test_compile_cache_quick_runs_the_one_trial_with_an_empty_cache_and_reads_what_it_compiled(tmp_path):
    out = tmp_path / "result.json"
    assert compile_cache.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result) == ["cold"] and result["cold"]["trials"] == 1
    assert result["cold"]["hits"] == 0 and result["cold"]["misses"] > 0 and result["cold"]["compile_s"] > 0
    losses = result["cold"]["fold_losses"]
    assert len(losses) == 1 and all(len(curve) == 2 for curve in next(iter(losses.values())).values())


def test_compile_cache_refuses_a_single_epoch_whose_compile_time_no_trial_measures(capsys):
    with pytest.raises(SystemExit) as refused:
        compile_cache.main(["--one-trial", "--epochs", "1"])
    assert refused.value.code == 2
    assert "--epochs: at least 2, for the trials to measure their compile_s; got 1" in capsys.readouterr().err
