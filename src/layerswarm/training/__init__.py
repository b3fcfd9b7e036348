"""Training: the layer above models/ that makes and measures model directories; no server imports it.

recipe.py, size.py    every training default, and the model size a run from scratch gets (torch-free:
                      the CLI's --help shows them)
train.py              the Trainer (the loop), objective.py (what a step computes), train_state.py (the
                      resumable state), train_report.py (what the operator reads), learned.py (what a
                      run learned against chance and reference.py's small CNN), hf_import.py
runs.py, family.py    what `layerswarm train` and `family` do, from typed jobs (the CLI builds them)
data/                 datasets: generated, digits, image folders, and held-out splits
evaluation/           the paper's experiments, adaptive-compute calibration, plots, `layerswarm eval`
text/                 the text family's side: corpora, per-token depth estimates, its runs
lm/                   the generative family's side: tokenizer, tasks and corpora, trainer, evaluation
"""
