"""vLLM's distributed state (its GroupCoordinators: world, TP, DP, EP) on ranks whose
torch.distributed process group already exists (a RankPool's gloo ranks, or one CUDA rank).

Real vLLM code throughout: ``init_distributed_environment`` reuses the initialized default group
and ``initialize_model_parallel`` builds vLLM's groups (and their device communicators, where
our patched communicator hook runs) under the given vLLM config."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional


@contextlib.contextmanager
def vllm_parallel_state(rank: int, world: int, tp: int, all2all_backend: str,
                        backend: str = "gloo", additional_config: Optional[dict] = None,
                        local_rank: Optional[int] = None, **parallel: Any) -> Iterator[Any]:
    """Inside: vLLM's current config (``ParallelConfig(tensor_parallel_size=tp,
    enable_expert_parallel=True, all2all_backend=..., **parallel)``, ``--additional-config``
    ``additional_config``) and its model-parallel groups over the ``world`` ranks of the default
    process group; with ``data_parallel_size`` > 1 vLLM counts ``rank`` and ``world`` within
    the DP rank ``data_parallel_rank`` (its world spans all DP ranks). ``local_rank``: the
    device index vLLM binds the groups to (default: ``rank`` on gloo, 0 otherwise; several
    ranks sharing one GPU pass 0). Yields the VllmConfig; destroys vLLM's groups on exit."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as every vLLM process does first: our entry point registers

    config = VllmConfig(parallel_config=ParallelConfig(
        tensor_parallel_size=tp, enable_expert_parallel=True, all2all_backend=all2all_backend,
        **parallel), additional_config=additional_config or {})
    with set_current_vllm_config(config):
        if local_rank is None:
            local_rank = rank if backend == "gloo" else 0
        ps.init_distributed_environment(world, rank, local_rank=local_rank, backend=backend)
        try:
            ps.initialize_model_parallel(tp, backend=backend)
            yield config
        finally:
            ps.destroy_model_parallel()
            # Not destroy_distributed_environment(): it also destroys the default process group,
            # which belongs to the caller (the RankPool keeps serving on it).
            if ps._WORLD is not None:
                ps._WORLD.destroy()
                ps._WORLD = None
