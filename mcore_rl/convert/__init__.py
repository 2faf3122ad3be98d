"""Checkpoint conversion between Hugging Face safetensors folders and megatron-core distributed checkpoints.

- :mod:`~mcore_rl.engine.hf.mapping`: HF <-> megatron full-state names and tensor transforms (pure);
- :mod:`~mcore_rl.convert.dist_layout`: where full-state tensors live in a torch_dist checkpoint (pure);
- :mod:`~mcore_rl.engine.hf.safetensors_io` / :mod:`~mcore_rl.convert.dcp_io`: streaming readers/writers;
- :mod:`~mcore_rl.convert.output`: output folders that appear only when complete; HF side files;
- :mod:`~mcore_rl.convert.memory`: returning freed memory to the OS between tensors;
- :mod:`~mcore_rl.convert.hf_to_mcore` / :mod:`~mcore_rl.convert.mcore_to_hf`: the two directions;
- :mod:`~mcore_rl.convert.cli`: ``mcore-rl convert``.
"""
