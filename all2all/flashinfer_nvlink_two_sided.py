"""Transport of the ``flashinfer_nvlink_two_sided`` backend: flashinfer's MNNVL all-to-all-v.

Two flashinfer Python APIs reach the same two-sided kernels (``moe_prepare`` exchanges routing and
per-rank counts, ``moe_comm`` moves rows through per-peer FIFOs in MNNVL symmetric memory):

- ``flashinfer.comm.trtllm_alltoall.MnnvlMoe`` (flashinfer-python 0.7.2.post1, the version vLLM
  0.33 pins; gone in 0.7.4): static methods over two MNNVL workspaces (FIFOs and prepare) that the
  caller creates for an EP ``Mapping``. MnnvlMoe caches them on the class: one mapping per process.
- ``flashinfer.moe_ep.NVLinkTwoSidedAlltoAll`` (0.7.2.post1 and later): one object per EP group
  and layer shape with ``dispatch``/``combine``/``destroy``. In 0.7.2.post1 it takes its
  workspaces from MnnvlMoe's class cache, so there too one EP mapping per process; 0.7.4 keeps
  its own per EP group. Whoever uses MnnvlMoe's cache holds it here (``_hold_mnnvl_cache``):
  another group is refused with a ValueError, and the cache is dropped after its last user.

:class:`FlashInferAll2AllManager` picks one (``auto`` prefers MnnvlMoe, the API vLLM 0.33 runs)
and hides it behind one small transport interface (:meth:`FlashInferAll2AllManager.transport`),
on which the prepare/finalize makes its calls, so the backend never branches on the API.
Workspaces are created on the first dispatch (a collective every rank reaches together) and freed
by :meth:`FlashInferAll2AllManager.destroy`. The workspaces do not depend on the token count; the
receive buffers do: each dispatch gets ``num_ranks * tokens_per_rank`` rows, where
``tokens_per_rank`` is the call's bound (the most tokens any rank sends in it, as both APIs take
per call: MnnvlMoe's ``max_token_count_per_rank``, moe_ep's ``dispatch`` bound keyword),
by default the layer's ``max_tokens_per_rank``. flashinfer is imported here, lazily.
"""
from __future__ import annotations

import enum
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.mnnvl.manager import (INSTALL_HINT, Dispatched, MnnvlManager, MnnvlTransport,
                                      TorchGroupComm, moe_ep_dispatch)
from moe_plugins.groups import DistContext

logger = logging.getLogger(__name__)

__all__ = ["TwoSidedApi", "FlashInferTwoSidedOptions", "FlashInferAll2AllManager", "detect_api"]

# Kernel limits (flashinfer csrc/trtllm_alltoall*.cu): moe_prepare checks expertCount % 4 == 0 and
# 1 <= topK <= 32; moe_comm moves rows as 16-byte vectors (ROW_ALIGN_BYTES).
EXPERT_COUNT_MULTIPLE = 4
MAX_TOPK = 32

_LOGGED: set[tuple] = set()


class TwoSidedApi(str, enum.Enum):
    """Which flashinfer API drives the kernels. AUTO: MnnvlMoe when present, else moe_ep."""

    AUTO = "auto"
    MNNVL_MOE = "mnnvl_moe"  # flashinfer.comm.trtllm_alltoall.MnnvlMoe (0.7.2.post1)
    MOE_EP = "moe_ep"  # flashinfer.moe_ep.NVLinkTwoSidedAlltoAll (0.7.2.post1+, alone from 0.7.4)


@dataclass(frozen=True)
class FlashInferTwoSidedOptions:
    """``DispatchConfig.backend_options`` of ``flashinfer_nvlink_two_sided``.

    api: which flashinfer API to use (see :class:`TwoSidedApi`).
    nvfp4_swizzled_sf: after the all-to-all, interleave nvfp4 scales into the 128x4 tiled layout
        flashinfer's CUTLASS/TRT-LLM NVFP4 MoE GEMMs read (vLLM's ``is_scale_swizzled``); the
        prepare result then says ``x_sf_swizzled``. Scales always cross the all-to-all unswizzled:
        the swizzle pads rows to 128, so they would no longer be row-aligned with the tokens.
    gpus_per_node: for the MNNVL ``Mapping`` (None: ``torch.cuda.device_count()``).
    """

    api: TwoSidedApi = TwoSidedApi.AUTO
    nvfp4_swizzled_sf: bool = True
    gpus_per_node: Optional[int] = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "api", TwoSidedApi(self.api))
        except ValueError:
            raise ValueError(f"api={self.api!r} is not a flashinfer two-sided API; expected one of "
                             f"{[a.value for a in TwoSidedApi]}") from None
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1 or None, got {self.gpus_per_node}")


def _available_apis() -> tuple[str, list[TwoSidedApi]]:
    """(flashinfer version, APIs it has). Raises ImportError when flashinfer is missing."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "backend 'flashinfer_nvlink_two_sided' needs flashinfer (flashinfer-python >= 0.7.2), "
            f"which is not installed ({e}); install it with: {INSTALL_HINT}"
        ) from e
    found = []
    try:
        from flashinfer.comm.trtllm_alltoall import MnnvlMoe  # noqa: F401
        found.append(TwoSidedApi.MNNVL_MOE)
    except ImportError:
        pass
    try:
        from flashinfer.moe_ep import NVLinkTwoSidedAlltoAll  # noqa: F401
        found.append(TwoSidedApi.MOE_EP)
    except ImportError:
        pass
    return str(getattr(flashinfer, "__version__", "unknown")), found


def detect_api(requested: TwoSidedApi = TwoSidedApi.AUTO) -> tuple[TwoSidedApi, str]:
    """The API to use and the flashinfer version; probed once per manager. ImportError (naming
    the extra) when flashinfer is missing or has no two-sided API, or not the one requested."""
    version, found = _available_apis()
    if not found:
        raise ImportError(
            f"flashinfer {version} has neither flashinfer.comm.trtllm_alltoall.MnnvlMoe "
            "(flashinfer-python 0.7.2.post1) nor flashinfer.moe_ep.NVLinkTwoSidedAlltoAll (0.7.4+); "
            f"install a supported version: {INSTALL_HINT}"
        )
    if requested is TwoSidedApi.AUTO:
        return found[0], version
    if requested not in found:
        raise ImportError(
            f"FlashInferTwoSidedOptions(api={requested.value!r}) but flashinfer {version} only has "
            f"{[a.value for a in found]}; pick one of those (or 'auto'), or install a flashinfer "
            f"that has it: {INSTALL_HINT}"
        )
    return requested, version


@dataclass
class _MnnvlMoeCache:
    """flashinfer's MnnvlMoe class cache (0.7.2.post1): the workspaces of one EP mapping per
    process. Its users are our MnnvlMoe transports and, on that release, moe_ep's
    NVLinkTwoSidedAlltoAll, which takes its workspaces from the same cache; it is dropped when
    the last user of either API goes, never under a live one. ``workspaces``: MnnvlMoe's
    (workspace, prepare workspace), uint64 [num_ranks, words], once a MnnvlMoe transport made
    them."""

    key: tuple
    users: int = 0
    workspaces: Optional[tuple[torch.Tensor, torch.Tensor]] = None


_MNNVL_CACHE: Optional[_MnnvlMoeCache] = None
_MNNVL_MOE_CACHE_ATTRS = ("moe_workspace", "moe_prepare_workspace", "moe_workspace_tensor",
                          "moe_prepare_workspace_tensor", "moe_mapping")


def _hold_mnnvl_cache(m: "FlashInferAll2AllManager", api: TwoSidedApi) -> _MnnvlMoeCache:
    """One more user of MnnvlMoe's cache for ``m``'s EP group through ``api``. Refused (before
    flashinfer sees the mapping, whose own check is a bare assert) while another EP group holds
    it, or the other API: each builds its own Mapping of the group (MnnvlMoe's as vLLM 0.33
    does, moe_ep a pure-EP one), and the cache takes one."""
    global _MNNVL_CACHE
    key = (id(m.group), m.rank, m.num_ranks, api)
    held = _MNNVL_CACHE
    if held is not None and held.key != key:
        holder = ("another EP group" if held.key[:3] != key[:3] else
                  f"a layer of this EP group on the {held.key[3].value} API, whose mapping differs,")
        shared = ", which its moe_ep shares" if TwoSidedApi.MOE_EP in (api, held.key[3]) else ""
        raise ValueError(
            f"flashinfer {m.flashinfer_version} holds the workspaces of one EP mapping per process "
            f"(MnnvlMoe's class cache{shared}) and {holder} already uses them; destroy those "
            "layers first, use one API for every layer of the process, or install "
            "flashinfer-python 0.7.4, whose moe_ep keeps workspaces per EP group "
            "(FlashInferTwoSidedOptions(api=TwoSidedApi.MOE_EP))")
    if held is None:
        _MNNVL_CACHE = held = _MnnvlMoeCache(key)
    held.users += 1
    return held


def _release_mnnvl_cache(cache: _MnnvlMoeCache) -> None:
    global _MNNVL_CACHE
    cache.users -= 1
    if cache.users:
        return
    assert _MNNVL_CACHE is cache
    _MNNVL_CACHE = None
    # MnnvlMoe caches the MnnvlMemory objects on the class; dropping them unmaps the memory
    # (MnnvlMemory.__del__) and lets a later mapping allocate again.
    from flashinfer.comm.trtllm_alltoall import MnnvlMoe

    for attr in _MNNVL_MOE_CACHE_ATTRS:
        setattr(MnnvlMoe, attr, None)


def _moe_ep_shares_mnnvl_cache() -> bool:
    """Whether this flashinfer's moe_ep takes its workspaces from MnnvlMoe's cache: the release
    that has both (0.7.2.post1); 0.7.4 removed MnnvlMoe and keeps moe_ep's own."""
    try:
        from flashinfer.comm.trtllm_alltoall import MnnvlMoe  # noqa: F401
    except ImportError:
        return False
    return True


class _MnnvlMoeTransport(MnnvlTransport):
    """flashinfer.comm.trtllm_alltoall.MnnvlMoe (0.7.2.post1), as vLLM 0.33 calls it."""

    api = TwoSidedApi.MNNVL_MOE

    def __init__(self, manager: "FlashInferAll2AllManager"):
        super().__init__(manager)
        self._cache: Optional[_MnnvlMoeCache] = None
        self._info: Any = None

    def _workspaces(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is not None and self._cache.workspaces is not None:
            return self._cache.workspaces
        m = self.m
        cache = self._cache or _hold_mnnvl_cache(m, self.api)
        self._cache = cache
        if cache.workspaces is None:
            from flashinfer.comm.mapping import Mapping
            from flashinfer.comm.mnnvl import MnnvlConfig, MnnvlMemory
            from flashinfer.comm.trtllm_alltoall import MnnvlMoe

            mapping = Mapping(m.num_ranks, m.rank, m.gpus_per_node, tp_size=m.num_ranks)
            config = MnnvlConfig(comm_backend=TorchGroupComm(m.group))
            try:
                MnnvlMemory.initialize()
                cache.workspaces = (MnnvlMoe.get_moe_workspaces(mapping, config),
                                    MnnvlMoe.get_moe_prepare_workspace(mapping, config))
            except Exception as e:  # the CUDA VMM calls say only which driver call failed
                self._cache = None
                _release_mnnvl_cache(cache)
                fabric = getattr(MnnvlMemory, "_fabric_supported", None)
                device = torch.cuda.current_device() if torch.cuda.is_available() else "none"
                raise RuntimeError(
                    f"flashinfer_nvlink_two_sided: flashinfer's MnnvlMoe could not create its "
                    f"MNNVL workspaces on EP rank {m.rank} of {m.num_ranks} (cuda device {device}, "
                    f"Mapping gpus_per_node={m.gpus_per_node}, "
                    f"FABRIC handles agreed by all ranks: {fabric}): {type(e).__name__}: {e}. "
                    "The workspaces are cuMemCreate allocations every rank maps: shared as "
                    "CU_MEM_HANDLE_TYPE_FABRIC handles (needs an NVLink fabric, IMEX) or, on one "
                    "host without FABRIC support, as POSIX file descriptors passed between the "
                    "ranks' processes. Use a GPU system with multi-node NVLink, or another "
                    "backend (e.g. 'torch')") from e
        return cache.workspaces

    def dispatch(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, tokens_per_rank: int) -> Dispatched:
        from flashinfer.comm.trtllm_alltoall import MnnvlMoe

        if self._info is not None:
            raise RuntimeError("dispatch called twice without combine (or reset_call_state)")
        m, (workspace, prepare_workspace) = self.m, self._workspaces()
        info, recv_ids, recv_weights, _ = MnnvlMoe.mnnvl_moe_alltoallv_prepare_without_allgather(
            topk_ids, topk_weights, None, prepare_workspace, tokens_per_rank, m.rank,
            m.num_ranks, m.num_experts, m.num_experts, m.num_topk)
        # Releases before flashinfer PR #2048 returned the float32 weights typed as int32.
        if recv_weights.dtype != torch.float32:
            recv_weights = recv_weights.view(torch.float32)
        recv_x = MnnvlMoe.mnnvl_moe_alltoallv(x, info, workspace, m.rank, m.num_ranks)
        recv_sf = None
        if x_sf is not None:
            recv_sf = MnnvlMoe.mnnvl_moe_alltoallv(x_sf, info, workspace, m.rank, m.num_ranks)
        self._info = info
        return Dispatched(recv_x, recv_sf, recv_ids, recv_weights)

    def combine(self, expert_output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        from flashinfer.comm.trtllm_alltoall import MnnvlMoe

        if self._info is None or self._cache is None or self._cache.workspaces is None:
            raise RuntimeError("combine called without a matching dispatch")
        m, info = self.m, self._info
        self._info = None
        return MnnvlMoe.mnnvl_moe_alltoallv_combine(
            expert_output, info, self._cache.workspaces[0], ep_rank=m.rank, ep_size=m.num_ranks,
            top_k=m.num_topk, token_count=num_tokens)

    def reset(self) -> None:
        self._info = None

    def destroy(self) -> None:
        self._info = None
        cache, self._cache = self._cache, None
        if cache is not None:
            _release_mnnvl_cache(cache)


class _MoeEpTransport(MnnvlTransport):
    """flashinfer.moe_ep.NVLinkTwoSidedAlltoAll: one object per EP group and shape (holding
    MnnvlMoe's cache where this release's moe_ep shares it)."""

    api = TwoSidedApi.MOE_EP

    def __init__(self, manager: "FlashInferAll2AllManager"):
        super().__init__(manager)
        self._comm: Any = None
        self._pending = False
        self._cache: Optional[_MnnvlMoeCache] = None

    def _communication(self) -> Any:
        if self._comm is None:
            from flashinfer.moe_ep import (BootstrapConfig, MoEEpCommParams,
                                           NVLinkTwoSidedAlltoAll, NVLinkTwoSidedConfig)

            m = self.m
            if self._cache is None and _moe_ep_shares_mnnvl_cache():
                self._cache = _hold_mnnvl_cache(m, self.api)
            bootstrap = BootstrapConfig(world_size=m.num_ranks, rank=m.rank, process_group=m.group)
            params = MoEEpCommParams(num_experts=m.num_experts, top_k=m.num_topk,
                                     max_tokens_per_rank=m.max_tokens_per_rank,
                                     hidden_size=m.cfg.hidden, dtype=m.cfg.dtype)
            self._comm = NVLinkTwoSidedAlltoAll(
                bootstrap, params, NVLinkTwoSidedConfig(comm_backend=TorchGroupComm(m.group)))
            self._bound_keyword = _per_call_bound_keyword(NVLinkTwoSidedAlltoAll.dispatch)
        return self._comm

    def dispatch(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, tokens_per_rank: int) -> Dispatched:
        # params.max_tokens_per_rank sized the object; the call's bound sizes its receive rows.
        comm = self._communication()
        out = moe_ep_dispatch(comm, self._bound_keyword, x, x_sf, topk_ids, topk_weights,
                              tokens_per_rank)
        self._pending = True
        return out

    def combine(self, expert_output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if self._comm is None:
            raise RuntimeError("combine called without a matching dispatch")
        out = self._comm.combine(expert_output)
        self._pending = False
        assert out.shape[0] == num_tokens, (tuple(out.shape), num_tokens)
        return out

    def reset(self) -> None:
        if self._pending and self._comm is not None:
            # NVLinkTwoSidedAlltoAll refuses a dispatch while its previous one awaits combine and
            # has no public way to drop it. When every rank failed between dispatch and combine
            # the FIFOs are consistent (dispatch completed), so forgetting the routing is safe.
            if hasattr(self._comm, "_state"):
                self._comm._state = None
        self._pending = False

    def destroy(self) -> None:
        comm, self._comm = self._comm, None
        cache, self._cache = self._cache, None
        self._pending = False
        if comm is not None:
            comm.destroy()
        if cache is not None:
            _release_mnnvl_cache(cache)


def _per_call_bound_keyword(dispatch: Any) -> str:
    """The keyword of ``NVLinkTwoSidedAlltoAll.dispatch`` that bounds one call's tokens per rank:
    ``max_tokens_per_rank`` in 0.7.2.post1, ``runtime_max_tokens_per_rank`` from 0.7.4 (read
    from the signature, not the version)."""
    params = inspect.signature(dispatch).parameters
    for name in ("runtime_max_tokens_per_rank", "max_tokens_per_rank"):
        if name in params:
            return name
    raise ImportError(
        "flashinfer.moe_ep.NVLinkTwoSidedAlltoAll.dispatch takes neither "
        "runtime_max_tokens_per_rank (0.7.4) nor max_tokens_per_rank (0.7.2.post1), which "
        f"moe-plugins knows (its parameters: {list(params)}); install flashinfer-python 0.7.4 "
        "or 0.7.2.post1")


_TRANSPORTS: dict[TwoSidedApi, type[MnnvlTransport]] = {
    TwoSidedApi.MNNVL_MOE: _MnnvlMoeTransport,
    TwoSidedApi.MOE_EP: _MoeEpTransport,
}


class FlashInferAll2AllManager(MnnvlManager):
    """One per layer config and EP group. The kernels dispatch PHYSICAL ids: physical expert
    ``p`` lives on EP rank ``p // num_local`` (``placement``, from the config; linear by default).

    Raises at construction: ImportError (flashinfer missing, naming the extra), TypeError
    (backend_options of another type), ValueError (one EP rank, or a number of experts / topk the
    kernels do not support). Nothing is allocated until the first dispatch.
    """

    backend_name = "flashinfer_nvlink_two_sided"

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        options = cfg.backend_options if cfg.backend_options is not None \
            else FlashInferTwoSidedOptions()
        if not isinstance(options, FlashInferTwoSidedOptions):
            raise TypeError(
                f"backend 'flashinfer_nvlink_two_sided' takes backend_options of type "
                f"FlashInferTwoSidedOptions (moe_plugins.all2all.flashinfer_nvlink_two_sided), "
                f"got {type(options).__name__}"
            )
        self.options = options
        self.api, self.flashinfer_version = detect_api(options.api)
        self._init_ep_layout(ctx, cfg)
        if self.num_experts % EXPERT_COUNT_MULTIPLE:
            raise ValueError(
                f"flashinfer's two-sided all-to-all kernels need the number of physical experts "
                f"divisible by {EXPERT_COUNT_MULTIPLE}, got {self.num_experts}; use another "
                "backend (e.g. 'torch') for this model, or another number of redundant experts"
            )
        if cfg.num_topk > MAX_TOPK:
            raise ValueError(f"flashinfer's two-sided all-to-all supports num_topk <= {MAX_TOPK}, "
                             f"got {cfg.num_topk}; use another backend for this model")
        self._init_ep_process_group(ctx)
        self.gpus_per_node = options.gpus_per_node or torch.cuda.device_count() or self.num_ranks
        self._transport = _TRANSPORTS[self.api](self)

        key = (self.api, self.num_ranks, self.num_experts, cfg.num_topk, cfg.hidden,
               cfg.max_tokens_per_rank, options)
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.info("flashinfer_nvlink_two_sided: flashinfer %s, %s API, EP size %d, "
                        "%d experts, topk %d, max %d tokens per rank, nvfp4 scales %s",
                        self.flashinfer_version, self.api.value, self.num_ranks, self.num_experts,
                        cfg.num_topk, cfg.max_tokens_per_rank,
                        "swizzled" if options.nvfp4_swizzled_sf else "row-aligned")
