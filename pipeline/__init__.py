"""foldsweep: hyperparameter sweeps with k-fold cross-validation of Keras CNNs.

The package is layered, from the ground up: ``base`` -> ``inputs`` -> ``contract`` -> ``engine`` |
``records`` -> the commands on top. Each layer's ``__init__`` says what it owns and what it may
import (tests/test_pipeline_layers.py holds the code to it); CONTRIBUTING.md lists every module.
"""

from pipeline.base import loaded, old_paths  # noqa: F401  (loaded: first, to time the loading)

__version__ = "0.1.0"

old_paths.install()
