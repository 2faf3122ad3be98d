"""Megatron-core engines: model builders, actor, critic, checkpoints."""
