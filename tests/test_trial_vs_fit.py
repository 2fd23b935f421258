"""A quick run of benchmarks.trial_vs_fit (one image model, 300 images: what its row holds, not its numbers)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import trial_vs_fit

pytestmark = pytest.mark.e2e  # it runs the benchmark's own processes


def test_trial_vs_fit_times_a_trial_and_the_naive_loop_on_the_same_images(tmp_path):
    with np.load(trial_vs_fit.write_images(tmp_path / "shapes.npz")) as shapes:
        images = tmp_path / "images.npz"
        np.savez(images, x=shapes["x"][:300], y=shapes["y"][:300])
    out = tmp_path / "rows.json"
    arguments = ["--model", "image_cnn", "--epochs", "2", "--batch-size", "64", "--data", str(images)]
    assert trial_vs_fit.main([*arguments, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["model"] == "image_cnn" and row["foldsweep_s"] > 0 and row["naive_s"] > 0 and row["compile_s"] > 0
    # faster_by divides the unrounded naive wall by the trial's, rounded to 0.1 s as the row holds it
    assert row["faster_by"] == pytest.approx(row["naive_s"] / row["foldsweep_s"], rel=0.05) and row["plan"]
