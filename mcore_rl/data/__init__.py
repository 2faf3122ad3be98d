"""Prompt datasets, tokenizers and the synthetic demo task."""
