"""The garbage collector paused while the large libraries load, and what they loaded frozen.

Each check runs in a process of its own: freezing this test process's objects would keep every
later test's garbage cycles from being collected.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


def run_python(code: str) -> dict:
    """What ``code`` prints as JSON on its last line, run in a new Python."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_block_runs_without_the_collector_and_what_it_made_is_frozen_after():
    seen = run_python(
        """
        import gc, json
        from pipeline.base.collector import collector_paused

        frozen_before = gc.get_freeze_count()
        with collector_paused():
            inside = gc.isenabled()
            made = [[i] for i in range(50_000)]
        after = gc.isenabled()
        frozen = gc.get_freeze_count() - frozen_before
        print(json.dumps({"inside": inside, "after": after, "frozen": frozen, "made": len(made)}))
        """
    )
    assert seen["inside"] is False
    assert seen["after"] is True
    assert seen["frozen"] > seen["made"]  # the lists made inside, and what was there before


def test_what_the_block_left_unreachable_is_collected_not_frozen():
    """A model built only to be checked, dropped in a reference cycle, is not kept for good."""
    seen = run_python(
        """
        import gc, json, weakref
        from pipeline.base.collector import collector_paused

        class Node:
            pass

        with collector_paused():
            checked = Node()
            checked.itself = checked  # a cycle: only the collector frees it
            gone = weakref.ref(checked)
            del checked
        print(json.dumps({"collected": gone() is None}))
        """
    )
    assert seen == {"collected": True}


def test_a_block_that_only_loads_modules_freezes_what_it_left_unreachable_without_a_collection():
    """Loading TensorFlow and Keras leaves some thousands of cycles, kept frozen: finding them
    would be a full collection of 0.3 s in every process."""
    seen = run_python(
        """
        import gc, json, weakref
        from pipeline.base.collector import collector_paused

        class Node:
            pass

        with collector_paused(collect=False):
            loaded = Node()
            loaded.itself = loaded
            gone = weakref.ref(loaded)
            del loaded
        gc.collect()  # frozen objects are never collected
        print(json.dumps({"kept": gone() is not None, "enabled": gc.isenabled()}))
        """
    )
    assert seen == {"kept": True, "enabled": True}


def test_an_error_in_the_block_still_gives_the_collector_back():
    seen = run_python(
        """
        import gc, json
        from pipeline.base.collector import collector_paused

        try:
            with collector_paused():
                raise ValueError("bad input")
        except ValueError:
            pass
        print(json.dumps({"enabled": gc.isenabled()}))
        """
    )
    assert seen == {"enabled": True}


def test_a_collector_already_off_stays_off_and_nothing_is_frozen():
    """The researcher's own ``gc.disable()``, or a pause around this one, is left as it was."""
    seen = run_python(
        """
        import gc, json
        from pipeline.base.collector import collector_paused

        gc.disable()
        with collector_paused():
            made = [[i] for i in range(1_000)]
        outer_enabled = gc.isenabled()
        frozen_off = gc.get_freeze_count()
        gc.enable()
        with collector_paused():
            with collector_paused():
                inner_enabled = gc.isenabled()
            between = gc.isenabled()
            frozen_between = gc.get_freeze_count()
        print(json.dumps({"outer_enabled": outer_enabled, "frozen_off": frozen_off, "inner": inner_enabled,
                          "between": between, "frozen_between": frozen_between, "end": gc.isenabled()}))
        """
    )
    assert seen["outer_enabled"] is False
    assert seen["frozen_off"] == 0
    assert seen["inner"] is False
    assert seen["between"] is False  # the inner block's end does not resume the outer pause
    assert seen["frozen_between"] == 0  # ...nor freeze before the outer block ends
    assert seen["end"] is True


@pytest.mark.e2e
def test_a_process_that_loads_the_engine_has_tensorflow_and_keras_frozen_its_collector_on_and_no_matplotlib_or_sklearn():
    """What a Ray worker does with its first trial: loading the engine loads TensorFlow and Keras
    with the collector paused, and gives it back; the matplotlib Keras imports for its galleries
    is not loaded until they draw, nor scikit-learn until Keras' wrappers or KerasTuner's
    Bayesian and scikit-learn tuners use it, nor SciPy's optimizers until the Bayesian tuner
    does (``pipeline.base.deferred``)."""
    seen = run_python(
        """
        import gc, json, sys
        import pipeline.engine.trainable
        def loaded(package):
            return sorted(name for name in sys.modules if name.split(".")[0] == package)
        seen = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "keras": "keras" in sys.modules,
                "matplotlib": loaded("matplotlib"), "sklearn": loaded("sklearn"),
                "scipy_optimize": [name for name in loaded("scipy") if name.startswith("scipy.optimize")]}
        from keras.src.visualization import plot_image_gallery
        seen["gallery_draws"] = callable(plot_image_gallery.plt.subplots)
        seen["loaded_on_use"] = type(sys.modules["matplotlib.pyplot"]).__name__
        import keras
        from keras_tuner.src.tuners import bayesian, sklearn_tuner
        from sklearn.base import BaseEstimator
        from sklearn.gaussian_process.kernels import Matern
        from sklearn.model_selection import KFold
        seen["wrappers"] = [issubclass(keras.wrappers.SKLearnClassifier, BaseEstimator),
                            issubclass(keras._tf_keras.keras.wrappers.SKLearnRegressor, BaseEstimator)]
        seen["tuners"] = [bayesian.sklearn.gaussian_process.kernels.Matern is Matern,
                          sklearn_tuner.sklearn.model_selection.KFold is KFold]
        from scipy.optimize import minimize
        seen["optimizer"] = bayesian.scipy.optimize.minimize is minimize
        print(json.dumps(seen))
        """
    )
    assert seen["enabled"] is True
    assert seen["keras"] is True
    assert seen["frozen"] > 300_000  # ~665,000 objects once Keras and TensorFlow have loaded
    assert seen["matplotlib"] == []
    assert seen["gallery_draws"] is True
    assert seen["loaded_on_use"] == "module"
    assert seen["sklearn"] == []
    assert seen["wrappers"] == [True, True]
    assert seen["tuners"] == [True, True]
    assert seen["scipy_optimize"] == []
    assert seen["optimizer"] is True
