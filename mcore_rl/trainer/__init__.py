"""The RL driver: the step (``grpo.py``), the run around it (``trainer.py``), the hybrid worker it drives
(``worker.py``) and the typed handle on the worker group (``actor_group.py``).

    from mcore_rl.trainer import Trainer
    with Trainer.from_config("recipes/demo_cpu.yaml", ["trainer.total_training_steps=20"]) as trainer:
        summary = trainer.fit()        # held-out accuracy before / after SFT / after RL, plot path
        trainer.records                # every logged record (stage, step, metrics)

    summary = run_sft("recipes/demo_cpu.yaml", ["sft.total_steps=200"])   # ``mcore-rl sft``
    # then Trainer.from_config(recipe, [f"model.path={summary.model_dir}", "sft.enable=false"])
"""

from mcore_rl.trainer.sft import SFTSummary, run_sft
from mcore_rl.trainer.trainer import Trainer

__all__ = ["SFTSummary", "Trainer", "run_sft"]
