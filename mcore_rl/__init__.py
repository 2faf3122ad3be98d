"""mcore_rl: reinforcement-learning post-training of LLMs on megatron-core."""

__version__ = "0.1.0"
