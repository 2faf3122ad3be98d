"""Where a run's metrics go: metrics.jsonl, TensorBoard, a progress bar and a plot (RL, SFT and DPO alike)."""
