"""benchmarks.gpu_check: on a machine without a GPU (this one) it says so and exits 0; its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_says_so_and_exits_0_writing_nothing(tmp_path):
    ran = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == gpu_check.NO_GPU.format(
        reason="nvidia-smi lists none, or none is visible to this process"
    )
    assert "Traceback" not in ran.stderr and not list(tmp_path.iterdir())


def test_the_table_has_a_column_per_field_and_a_line_per_row(capsys):
    gpu_check.print_table(
        [
            gpu_check.row("memory", "1 trial per GPU (gpu: 1): driver", 0, "MiB"),
            gpu_check.row("rerun identity", "a trial twice, TF_DETERMINISTIC_OPS 1", "bit-identical"),
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["measurement", "setting", "value", "unit"]
    assert lines[1].split()[-2:] == ["0", "MiB"] and lines[2].rstrip().endswith("bit-identical")
    assert lines[1].index("1 trial") == lines[2].index("a trial") == lines[0].index("setting")
