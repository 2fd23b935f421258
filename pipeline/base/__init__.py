"""Base: foldsweep's errors, a quiet TensorFlow start-up, the garbage collector paused while the
libraries load, what they import for features foldsweep never calls left unloaded, the
environment a sweep records (and foldsweep's cache directory), the GPU a process computes on
(model, driver, CUDA, cuDNN, determinism), the private library hooks it relies on (checked at
start-up) and the one module per library that uses its private names, the persistent XLA
compile cache, caches kept within a size, and stopping a tree of processes.
May import: nothing of foldsweep's.
"""
