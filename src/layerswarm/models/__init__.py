"""What servers load: the architectures (vit.py, config.py; text/ for the text encoder), the weights
format (checkpoint.py), exits and policies (exits.py, policy.py, adaptive_policy.py), the block choice
rule of a pruned path (paths.py), image decoding (images.py) and the shipped models (zoo.py, zoo/).

Imports only wire; training/ sits above it."""
