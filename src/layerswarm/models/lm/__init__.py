"""The generative family: a Llama-layout causal decoder whose blocks run in any order, one node each."""
