"""The text family: a tokenizer, a token + position stem, the ViT's own blocks and head, per-token depth."""
