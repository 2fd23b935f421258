"""Engine: one trial executed: the Ray trainable and its in-process runner, the training recipe,
the fold trainer and its executors (sequential, side by side, stacked), device-resident data,
and where a resumed sweep's Ray Tune trials are made.
May import: pipeline.base, pipeline.inputs, pipeline.contract.
"""
