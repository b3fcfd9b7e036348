"""Evaluation of model directories: the paper's experiments (orders, pruning, merging, ensembles),
adaptive-compute calibration and the policy files it writes, figures, and what `layerswarm eval` runs."""
