"""The text family's training side: corpora and their encoding, per-token depth estimates (mutual
information, reconstruction) and their evaluation, and what `train`, `eval` and `depth` do on text."""
