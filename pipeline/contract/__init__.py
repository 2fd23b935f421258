"""Contract: the typed vocabulary between the engine and the records: a trial's execution plan
and its results (epochs, folds, throughput, NaN events, statuses), flattened in one place each.
May import: pipeline.base, pipeline.inputs.
"""
