"""Compatibility layers for third-party libraries (megatron-core on CPU)."""
