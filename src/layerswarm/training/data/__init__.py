"""Training data, all local: data specs (generated shapes, digits, image folders), generated image-folder
tasks (synthetic.py), and the seeded held-out splits every evaluation and trainer uses (split.py)."""
