"""foldsweep: hyperparameter sweeps with k-fold cross-validation of Keras CNNs.

The package is layered; each layer's ``__init__`` says what it owns and what it may import
(tests/test_pipeline_layers.py holds the code to it), from the ground up:
``base`` -> ``inputs`` -> ``contract`` -> ``engine`` | ``records`` -> the commands on top:
``checks`` (a spec against its data and model), ``sweep`` (a sweep through Ray Tune), ``refit``,
``rerun`` (one recorded trial again) and ``cli``.
"""

from pipeline.base import loaded, old_paths  # noqa: F401  (loaded: first, to time the loading)

__version__ = "0.1.0"

old_paths.install()
