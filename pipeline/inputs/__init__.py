"""Inputs: what a researcher gives, read and checked: the YAML spec, the search space, the
hypermodel and its loss, the datasets (built-in, protein, files) and the folds made from them.
May import: pipeline.base.
"""
