"""Per-rank hosts: one process, one rank, the engines of one or more roles (actor with its reference and
rollout engine, critic, reward model, rollout pool rank) and the collective methods the driver calls."""
