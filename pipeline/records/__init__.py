"""Records: the MLflow store and what is read from and written to it: tracking, the Ray Tune
callbacks that record trials, the report, significance tests, plots, publishing and progress,
and the MLflow UI's server.
May import: pipeline.base, pipeline.inputs, pipeline.contract.
"""
