"""vLLM's distributed state (its GroupCoordinators: world, TP, DP, EP) on ranks whose
torch.distributed process group already exists (a RankPool's gloo ranks, or one CUDA rank).

Real vLLM code throughout: the worker's environment as vLLM's worker sets it
(:func:`moe_plugins.vllm.worker_env.set_worker_dist_env`, from an init method chosen as vLLM's
executor chooses it), ``init_distributed_environment`` reuses the initialized default group and
``initialize_model_parallel`` builds vLLM's groups (and their device communicators, where our
patched communicator hook runs) under the given vLLM config.

vLLM's CPU shared-memory communicator: vLLM's CPU communicator uses it for the ``tp``/``pp``
groups when the processor's vLLM kernels have ``torch.ops._C.init_shm_manager`` (x86 AVX-512,
Arm, POWER, s390x; not the AVX2 kernels, nor a vLLM whose compiled extension is missing) and
every rank of the group agrees on its shared-memory name, which is built from
``VLLM_DIST_IDENT``; otherwise it keeps torch.distributed. vLLM reads
no switch for it. ``cpu_shm=None`` takes whatever vLLM takes on this machine; ``cpu_shm=True``
and ``False`` choose, and check that vLLM took that path: False gives each rank its own
``VLLM_DIST_IDENT`` (as if each came from its own executor), so vLLM's own agreement check
(``CpuCommunicator._all_group_ranks_share_shm_group_name``) keeps torch.distributed, the
communicator a processor without the shared-memory kernels gets; True needs those kernels
(:func:`cpu_shm_unavailable` says why not, for a test to skip)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import torch.distributed as dist

from moe_plugins.vllm.worker_env import DIST_IDENT_ENV, set_worker_dist_env


def cpu_shm_unavailable() -> Optional[str]:
    """Why vLLM's CPU shared-memory communicator cannot run on this machine (None: it can): the
    processor conditions of ``CpuCommunicator.__init__``, after vLLM loads its kernels."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu():
        return f"vLLM's platform here is {type(current_platform).__name__}, not its CPU platform"
    arch = current_platform.get_cpu_architecture()
    if arch not in (CpuArchEnum.X86, CpuArchEnum.ARM, CpuArchEnum.POWERPC, CpuArchEnum.S390X):
        return f"vLLM has no CPU shared-memory communicator on {arch.name}"
    current_platform.import_kernels()  # what vLLM loads for this processor (AVX2 / AVX-512 / ...)
    if hasattr(torch.ops._C, "init_shm_manager"):
        return None
    extension = _kernel_extension(arch)
    import vllm

    if importlib.util.find_spec(extension) is None:
        return (f"vLLM's compiled extension {extension} is missing from the vLLM this process "
                f"imports ({vllm.__version__}, {Path(vllm.__file__).parent}: its Python "
                "alone, as a release's Python laid over another build's dependencies is), so "
                "torch.ops._C has no init_shm_manager and vLLM's CPU communicator uses "
                "torch.distributed")
    if extension.endswith("_AVX2"):
        return (f"this processor has no AVX-512, so vLLM loads {extension}, whose kernels have "
                "no torch.ops._C.init_shm_manager: vLLM's CPU communicator uses "
                "torch.distributed here")
    return (f"vLLM's kernels for this processor ({extension}) have no "
            "torch.ops._C.init_shm_manager, so vLLM's CPU communicator uses torch.distributed")


def _kernel_extension(arch: Any) -> str:
    """The compiled module vLLM's CPU platform loads for this processor
    (``CpuPlatform.import_kernels``): on x86, ``vllm._C`` with AVX-512 BF16,
    ``vllm._C_AVX512`` with AVX-512 alone, ``vllm._C_AVX2`` without; ``vllm._C`` elsewhere."""
    import torch
    from vllm.platforms import CpuArchEnum

    if arch != CpuArchEnum.X86:
        return "vllm._C"
    if not torch.cpu._is_avx512_supported():
        return "vllm._C_AVX2"
    return "vllm._C" if torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512"


def tp_uses_cpu_shm() -> bool:
    """Whether vLLM's TP group collectives run through vLLM's CPU shared-memory communicator."""
    from vllm.distributed import get_tp_group
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    comm = get_tp_group().device_communicator
    return isinstance(getattr(comm, "dist_module", None), _CPUSHMDistributed)


def _executor_init_method() -> str:
    """One distributed init method for all ranks, made as vLLM's multiprocessing executor makes
    it (``get_file_store_init_method``: unique per instance) on rank 0 and sent to the others.
    The ranks rendezvoused already; vLLM's worker derives its instance identifier from it."""
    from vllm.utils.network_utils import get_file_store_init_method

    box = [get_file_store_init_method() if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    assert isinstance(box[0], str)
    return box[0]


@contextlib.contextmanager
def vllm_parallel_state(rank: int, world: int, tp: int, all2all_backend: str,
                        backend: str = "gloo", additional_config: Optional[dict] = None,
                        cpu_shm: Optional[bool] = None, local_rank: Optional[int] = None,
                        **parallel: Any) -> Iterator[Any]:
    """Inside: vLLM's current config (``ParallelConfig(tensor_parallel_size=tp,
    enable_expert_parallel=True, all2all_backend=..., **parallel)``, ``--additional-config``
    ``additional_config``) and its model-parallel groups over the ``world`` ranks of the default
    process group; with ``data_parallel_size`` > 1 vLLM counts ``rank`` and ``world`` within
    the DP rank ``data_parallel_rank`` (its world spans all DP ranks). ``cpu_shm``: vLLM's CPU
    shared-memory communicator on the TP group as vLLM decides (None), or on / off (the module
    docstring; needs tp > 1). ``local_rank``: the device index vLLM binds the groups to
    (default: ``rank`` on gloo, 0 otherwise; several ranks sharing one GPU pass 0). Yields the
    VllmConfig; destroys vLLM's groups and restores ``VLLM_DIST_IDENT`` on exit."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.plugins import load_general_plugins

    if cpu_shm is not None and tp < 2:
        raise ValueError(f"cpu_shm={cpu_shm} chooses the communicator of the TP group, which "
                         f"vLLM builds only for tp > 1; got tp={tp}: pass cpu_shm=None")
    load_general_plugins()  # as every vLLM process does first: our entry point registers

    config = VllmConfig(parallel_config=ParallelConfig(
        tensor_parallel_size=tp, enable_expert_parallel=True, all2all_backend=all2all_backend,
        **parallel), additional_config=additional_config or {})
    init_method = _executor_init_method()
    saved_ident = os.environ.get(DIST_IDENT_ENV)
    # off: each rank as if from its own executor, so the ranks' shared-memory names differ
    set_worker_dist_env(init_method if cpu_shm is not False
                        else f"{init_method}-rank{dist.get_rank()}")
    try:
        with set_current_vllm_config(config):
            if local_rank is None:
                local_rank = rank if backend == "gloo" else 0
            ps.init_distributed_environment(world, rank, init_method, local_rank=local_rank,
                                            backend=backend)
            try:
                ps.initialize_model_parallel(tp, backend=backend)
                if cpu_shm is not None and tp_uses_cpu_shm() is not cpu_shm:
                    raise RuntimeError(
                        f"asked for vLLM's CPU shared-memory communicator "
                        f"{'on' if cpu_shm else 'off'}, vLLM built the other "
                        f"({cpu_shm_unavailable() or 'its conditions changed?'})")
                yield config
            finally:
                ps.destroy_model_parallel()
                # Not destroy_distributed_environment(): it also destroys the default process
                # group, which belongs to the caller (the RankPool keeps serving on it).
                if ps._WORLD is not None:
                    ps._WORLD.destroy()
                    ps._WORLD = None
    finally:
        if saved_ident is None:
            os.environ.pop(DIST_IDENT_ENV, None)
        else:
            os.environ[DIST_IDENT_ENV] = saved_ident


def vllm_seen(rank: int, world: int) -> tuple[str, str]:
    """Rank function: the version and the package directory of the vLLM this rank imports."""
    import vllm

    return vllm.__version__, str(Path(vllm.__file__).parent)
