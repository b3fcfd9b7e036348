"""Training: what turns data into model directories (trainers, recipes, data, evaluation)."""
