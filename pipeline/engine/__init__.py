"""Engine: one trial executed: the Ray trainable (``trainable``) and the same trial without Ray
(``runner``), the training recipe (``recipe``), the k folds trained in lockstep (``trainer``),
one fold's engine (``fold_engine``) and an executor per fold layout (``sequential``,
``side_by_side``, ``stacked``), device-resident data, and where a resumed sweep's Ray Tune
trials are made.
May import: pipeline.base, pipeline.inputs, pipeline.contract.
"""
