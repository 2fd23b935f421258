"""foldsweep: hyperparameter sweeps with k-fold cross-validation of Keras CNNs."""

__version__ = "0.1.0"
