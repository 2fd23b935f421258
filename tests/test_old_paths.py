"""Module paths of earlier releases still resolve every name they held (``pipeline.base.old_paths``):
the engine's modules before they were named after the fold layouts (after 31e017e), and 0.1.0's flat
package. Ray Tune pickles classes by module path, and scripts import them, so a sweep recorded
before a rename still resumes and reruns."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest

from pipeline.base.old_paths import OLD_NAMES, OLD_PATHS

# What the engine's modules defined at 31e017e, but training.METRIC_NAMES (dead, deleted).
ENGINE_BEFORE_THE_LAYOUT_NAMES = {
    "trial": (
        "CHECKPOINT_FILE",
        "LAST_REPORT_FILE",
        "TrialSettings",
        "Worker",
        "configure_tensorflow",
        "use_compile_cache",
        "set_up_worker",
        "TrialRunner",
        "FoldTrainable",
        "surviving_checkpoint",
    ),
    "training": (
        "EVAL_BATCH_SIZE",
        "epoch_order",
        "fold_seed",
        "FoldSteps",
        "traced_once",
        "fold_steps",
        "launch_loop",
        "StoppedCall",
        "EpochTally",
        "tally_step",
        "CallTimer",
        "FoldEngine",
        "FoldExecutor",
        "SequentialFolds",
        "close_shared_epoch",
    ),
    "fused": ("FusedFolds",),
}
OLD_ENGINE_PATHS = [
    f"{package}.{module}" for package in ("pipeline.engine", "pipeline") for module in ENGINE_BEFORE_THE_LAYOUT_NAMES
]


@pytest.mark.parametrize("path", OLD_ENGINE_PATHS)
def test_every_old_engine_path_resolves_its_names_in_their_new_homes(path):
    module = importlib.import_module(path)
    homes = OLD_PATHS[path]
    for name in ENGINE_BEFORE_THE_LAYOUT_NAMES[path.rsplit(".", 1)[1]]:
        found = getattr(module, name)
        if inspect.isclass(found) or inspect.isfunction(found):
            assert found.__module__ in homes, f"{path}.{name} is {found.__module__}.{found.__name__}"
            assert found.__name__ == OLD_NAMES.get(path, {}).get(name, name)


def test_a_renamed_class_is_its_new_self_under_its_old_name():
    from pipeline.engine.side_by_side import SideBySideFolds
    from pipeline.engine.trainable import FoldTrainable

    assert importlib.import_module("pipeline.engine.fused").FusedFolds is SideBySideFolds
    assert importlib.import_module("pipeline.fused").FusedFolds is SideBySideFolds
    # Ray Tune records the trainable's class name (trial directories, --resume): it never changes.
    assert importlib.import_module("pipeline.engine.trial").FoldTrainable is FoldTrainable
    assert FoldTrainable.__name__ == "FoldTrainable"


def test_every_old_path_forwards_to_modules_that_exist_and_names_only_what_they_hold():
    for path, homes in OLD_PATHS.items():
        assert importlib.util.find_spec(path).origin is None, f"{path} is a module again: leave it out of OLD_PATHS"
        for home in homes:
            importlib.import_module(home)
    with pytest.raises(AttributeError, match="no attribute 'Nowhere'"):
        getattr(importlib.import_module("pipeline.engine.training"), "Nowhere")  # noqa: B009
