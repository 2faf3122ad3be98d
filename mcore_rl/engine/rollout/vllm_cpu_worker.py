"""vLLM's CPU worker, naming its shared memory after our world (vLLM imports it: the ``worker_cls`` argument).

vLLM's CPU build moves TP collectives through shared-memory segments named after ``VLLM_DIST_IDENT``, which
its worker derives from the init method's last ``:`` field. Under ``external_launcher`` the init method is
``env://`` in every job, so every job on a host names its TP group ``-tp:0-[0-1]-cpushm``, and a second TP
job on the same host fails with "create shm in SHMManager failed. errno: 17" (seen with two test runs at
once). This worker hands vLLM the identifier :class:`~mcore_rl.engine.rollout.vllm_engine.VLLMRolloutEngine`
drew for its world (the same on every rank). The init method itself is not used: the world already exists.
"""

from __future__ import annotations

import os

from vllm.v1.worker.cpu_worker import CPUWorker

from mcore_rl.engine.rollout.vllm_compat import DIST_IDENT_ENV


class ExternalWorldCPUWorker(CPUWorker):
    def init_device(self) -> None:
        self.distributed_init_method = f"env://:{os.environ[DIST_IDENT_ENV]}"  # vLLM keeps the last field
        super().init_device()
