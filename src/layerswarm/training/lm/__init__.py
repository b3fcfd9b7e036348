"""The generative family's trainer, data, tokenizer training and evaluation (the model is models/lm/)."""
