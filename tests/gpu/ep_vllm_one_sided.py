"""vLLM's in-tree ``FlashInferNVLinkOneSidedPrepareAndFinalize`` beside ours
(``moe_plugins_flashinfer_nvlink_one_sided``) in the vLLM-path jobs of the EP matrix
(tests/gpu/ep_vllm_ranks.py) and the CPU tests of vLLM 0.33 / 0.34
(tests/vllm_glue/test_vllm_one_sided_in_tree.py).

The in-tree side is built as vLLM builds it for ``--all2all-backend
flashinfer_nvlink_one_sided``: vLLM's own ``FlashInferNVLinkOneSidedManager`` over the EP group's
CPU group (what vLLM's CUDA communicator puts in its ``all2all_manager`` slot for that name),
then vLLM's ``maybe_make_prepare_finalize`` (its dispatch layout from the quant config, the
scheduler's ``max_num_batched_tokens`` as its capacity). Our plugin holds that slot for our
name, so it holds vLLM's manager only while the in-tree class is built (the class keeps its
manager). Both sides make their calls inside a vLLM forward context with DP metadata, as vLLM's
model runner sets it: the in-tree class reads its per-call bound there (and has no other), ours
its batch hint.

What differs from a GPU run, on CPU ranks only: the emulated flashinfer of the release vLLM
pins (tests/emulation/flashinfer_one_sided.py; vLLM 0.33 pins 0.7.2.post1, vLLM 0.34 pins
0.7.3, whose API the emulated 0.7.4 has: ``dispatch(runtime_max_tokens_per_rank=)``), and for
the in-tree manager's set-up alone ``torch.accelerator``'s ``current_device_index`` (0),
``empty_cache`` and ``synchronize`` (nothing to do), which raise on a machine without an
accelerator. vLLM uses them to name the device in flashinfer's ``BootstrapConfig`` (the
emulation's memory is host memory) and to free cached memory before the workspace is mapped;
a MoE layer's call uses none of them. vLLM's flashinfer probes see the emulated modules
(module specs) and its kernels (``VLLM_HAS_FLASHINFER_CUBIN=1``, vLLM's switch for flashinfer's
prebuilt kernels: the emulated ones are there).

Which in-tree rows cannot run here, and why: FP8 block-128 and NVFP4. The in-tree prepare
quantizes with vLLM's ``moe_kernel_quantize_input``: FP8 block-128 through
``per_token_group_quant_fp8``, which on a CUDA platform calls the compiled op
``torch.ops._C.per_token_group_fp8_quant`` (absent from a release's Python without vLLM's
compiled extension, as the GPU kit runs it) and elsewhere a Triton kernel (no Triton driver on
a CPU: "0 active drivers"); NVFP4 through ``scaled_fp4_quant``, a compiled CUDA op. Ours
quantizes with its own torch quantizer on both, so those rows compare ours with the reference
only (our layer's jobs).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

__all__ = ["NAME", "OURS_NAME", "IN_TREE_NAME", "in_tree_runs_here", "emulated_flavor",
           "flashinfer_for_vllm", "in_tree_one_sided", "dp_forward_context", "call_context",
           "destroy_in_tree"]

NAME = "flashinfer_nvlink_one_sided"
OURS_NAME = "moe_plugins_flashinfer_nvlink_one_sided"
IN_TREE_NAME = "FlashInferNVLinkOneSidedPrepareAndFinalize"

# vLLM's in-tree managers built in this process (cleaned up by destroy_in_tree)
_MANAGERS: list[Any] = []


def _vllm_release() -> tuple[int, int]:
    """(major, minor) of the installed vLLM, from its distribution's metadata (vLLM is not
    imported); (0, 0) where none is installed."""
    from moe_plugins.vllm.version import installed_vllm

    try:
        version = installed_vllm()[1]
    except ImportError:
        return (0, 0)
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def in_tree_runs_here() -> bool:
    """Whether the installed vLLM's in-tree class is the one compared here (vLLM 0.33 and
    later: over ``flashinfer.moe_ep``'s class; vLLM 0.32's drives flashinfer.comm's
    ``MoeAlltoAll`` itself, which the emulation does not present)."""
    return _vllm_release() >= (0, 33)


def emulated_flavor() -> str:
    """The emulated flashinfer release whose API the installed vLLM's in-tree class calls: vLLM
    0.33's pin (0.7.2.post1: ``dispatch(max_tokens_per_rank=)``), else 0.7.4 (vLLM 0.34 pins
    0.7.3; both take ``dispatch(runtime_max_tokens_per_rank=)``)."""
    return "0.7.2.post1" if _vllm_release() < (0, 34) else "0.7.4"


@contextlib.contextmanager
def flashinfer_for_vllm(device: str) -> Iterator[None]:
    """The flashinfer both sides run on: on CPU the emulated release of
    :func:`emulated_flavor`, vLLM's flashinfer probes (cached per process) asked again; on a
    GPU the real one, past moe_ep's NVLink platform check on a one-GPU host."""
    if not device.startswith("cpu"):
        from tests.gpu.flashinfer_one_gpu import nvlink_check_on_one_gpu

        with nvlink_check_on_one_gpu():
            yield
        return
    import importlib.machinery
    import os
    import sys

    from tests.emulation import flashinfer_two_sided as emu

    with emu.installed(emulated_flavor()):
        # vLLM's probes ask importlib.util.find_spec, which answers from sys.modules only for a
        # module with a spec (the emulation has none: our registry never takes it for the
        # package) and looks for a submodule not there on its parent's __path__; here each
        # emulated module gets both, as a package (a submodule not emulated is then not found)
        for name, mod in list(sys.modules.items()):
            if name.split(".")[0] == "flashinfer" and mod is not None and mod.__spec__ is None:
                mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
                mod.__path__ = []
        # vLLM's has_flashinfer() also wants flashinfer's kernels: its JIT's nvcc and ninja, or
        # the cubin package (VLLM_HAS_FLASHINFER_CUBIN, vLLM's switch); the emulated kernels are
        # there, so it says so
        saved = os.environ.get("VLLM_HAS_FLASHINFER_CUBIN")
        os.environ["VLLM_HAS_FLASHINFER_CUBIN"] = "1"
        _clear_vllm_flashinfer_probes()
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("VLLM_HAS_FLASHINFER_CUBIN", None)
            else:
                os.environ["VLLM_HAS_FLASHINFER_CUBIN"] = saved
            _clear_vllm_flashinfer_probes()


def _clear_vllm_flashinfer_probes() -> None:
    """vLLM caches whether flashinfer is importable (functools.cache) at its first question; a
    test process installs the emulation after that."""
    from vllm.utils import flashinfer as fi

    for name in ("has_flashinfer_cubin", "has_flashinfer", "has_flashinfer_comm",
                 "has_flashinfer_nvlink_one_sided", "has_flashinfer_nvlink_two_sided"):
        probe = getattr(fi, name, None)
        if probe is not None and hasattr(probe, "cache_clear"):
            probe.cache_clear()


@contextlib.contextmanager
def _accelerator_on_cpu(device: torch.device) -> Iterator[None]:
    """On a CPU rank only: torch.accelerator's device index and cache calls answer as on a
    one-device machine (see the module doc)."""
    if device.type != "cpu":
        yield
        return
    acc = torch.accelerator
    saved = {n: getattr(acc, n) for n in ("current_device_index", "empty_cache", "synchronize")}
    acc.current_device_index = lambda: 0  # type: ignore[assignment]
    acc.empty_cache = lambda: None  # type: ignore[assignment]
    acc.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(acc, name, fn)


def in_tree_one_sided(moe: Any, quant_config: Any, device: torch.device) -> Any:
    """vLLM's in-tree prepare/finalize for ``moe`` (our name's FusedMoEConfig; the in-tree side
    gets vLLM's own name) and ``quant_config``, built as vLLM builds it (module doc)."""
    import dataclasses

    from vllm.distributed import get_ep_group
    from vllm.distributed.device_communicators.all2all import FlashInferNVLinkOneSidedManager
    from vllm.model_executor.layers.fused_moe import all2all_utils

    parallel = dataclasses.replace(moe.moe_parallel_config, all2all_backend=NAME)
    theirs = dataclasses.replace(moe, moe_parallel_config=parallel)
    if not hasattr(FlashInferNVLinkOneSidedManager, "get_communication"):
        raise ValueError(
            "this vLLM's in-tree FlashInferNVLinkOneSidedManager drives flashinfer.comm's "
            "MoeAlltoAll itself (vLLM 0.32); the comparison runs against vLLM 0.33 and later, "
            "whose class is flashinfer.moe_ep's NVLinkOneSidedAlltoAll")
    ep = get_ep_group()
    communicator = ep.device_communicator
    with _accelerator_on_cpu(device):
        manager = FlashInferNVLinkOneSidedManager(ep.cpu_group)
        _MANAGERS.append(manager)
        ours = communicator.all2all_manager
        communicator.all2all_manager = manager  # what vLLM's CUDA communicator holds for NAME
        try:
            pf = all2all_utils.maybe_make_prepare_finalize(theirs, quant_config,
                                                           all2all_manager=manager)
        finally:
            communicator.all2all_manager = ours
    assert type(pf).__name__ == IN_TREE_NAME, type(pf).__name__
    return pf


@contextlib.contextmanager
def dp_forward_context(tokens_per_dp_rank: Sequence[int]) -> Iterator[None]:
    """vLLM's forward context with DP metadata for these tokens per DP rank (every rank gives
    the same list), the chunk sizes set as vLLM's MoE runner sets them around a layer (sequence
    parallel off)."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none
    from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context

    config = get_current_vllm_config_or_none() or VllmConfig()
    dp = DPMetadata(torch.tensor(list(tokens_per_dp_rank), dtype=torch.int32))
    context = create_forward_context(None, config, dp_metadata=dp)
    with override_forward_context(context), dp.sp_local_sizes(1):
        yield


def call_context(backend: str, tokens_per_dp_rank: Sequence[int]) -> Any:
    """Where a call of ``backend``'s classes runs: the one-sided ones read their per-call bound
    from vLLM's forward context (the in-tree class has no other); the others need none."""
    if backend != NAME:
        return contextlib.nullcontext()
    return dp_forward_context(tokens_per_dp_rank)


def destroy_in_tree() -> None:
    """Clean up every in-tree manager this process built (flashinfer's destroy)."""
    while _MANAGERS:
        _MANAGERS.pop().cleanup()
