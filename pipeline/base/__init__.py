"""Base: foldsweep's errors, a quiet TensorFlow start-up, the environment a sweep records, the
GPU a process computes on (model, driver, CUDA, cuDNN, determinism), the private library hooks
it relies on (checked at start-up), and the persistent XLA compile cache.
May import: nothing of foldsweep's.
"""
