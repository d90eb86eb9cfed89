"""Tiny random models of any family, built offline: the smallest config that keeps the family's
structure (`configs.shrink_config`), and a tiny Llama with its own tokenizer (`model`)."""
