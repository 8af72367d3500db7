"""What flashinfer's two MNNVL all-to-all emulations share (tests/emulation/flashinfer_two_sided.py,
tests/emulation/flashinfer_one_sided.py): ``flashinfer.comm.mapping.Mapping``,
``flashinfer.comm.mnnvl.MnnvlConfig`` / ``MnnvlMemory`` (symmetric memory whose creation exchanges
"handles" through the ``CommBackend``, a collective) and ``flashinfer.moe_ep``'s
``BootstrapConfig``, ``MoEEpCommParams``, ``MoEEpDispatchResult``, the ``MoEEpCommunication`` base
class and ``mnnvl_mapping_and_config`` (the collective platform check and the pure-EP Mapping),
as the published wheels of flashinfer-python 0.7.2.post1 and 0.7.4 define them; checked against
their source by tests/emulation/test_flashinfer_upstream.py. Differences from upstream are
listed where they are (the default process group only, the placeholder allocation sizes).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist

#: every emulated kernel call of either all-to-all, in order (tests read and clear it)
TRAFFIC: list[dict] = []
_WORKSPACE_WORDS = 64  # placeholder size (uint64 words per rank) of an emulated MNNVL allocation


# --- flashinfer.fused_moe ---------------------------------------------------------------------
class QuantFormat(Enum):
    """flashinfer.fused_moe.api.QuantFormat: numeric format of one MMA operand."""

    BF16 = 0
    FP16 = 1
    FP8PerTensor = 2
    DeepSeekFp8 = 3  # e4m3 + fp32 block scales (128x128 weight, 1x128 activation)
    MXFP8 = 4
    NVFP4 = 5
    MXFP4 = 6
    MXINT4 = 7
    INT4 = 8

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# moe_ep's bytes of one token's activations on the wire per QuantFormat (values + block scales).
_DISPATCH_BYTES_PER_TOKEN: dict[str, Callable[[int], int]] = {
    "BF16": lambda hidden: 2 * hidden,
    "FP16": lambda hidden: 2 * hidden,
    "FP8PerTensor": lambda hidden: hidden,
    "DeepSeekFp8": lambda hidden: hidden + 4 * _ceil_div(hidden, 128),
    "MXFP8": lambda hidden: hidden + _ceil_div(hidden, 32),
    "NVFP4": lambda hidden: _ceil_div(hidden, 2) + _ceil_div(hidden, 16),
    "MXFP4": lambda hidden: _ceil_div(hidden, 2) + _ceil_div(hidden, 32),
}

def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"[flashinfer emulation] check failed: {msg}")


def _uninitialized(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty made visible: every byte 0xFF (NaN for float dtypes, fp8 included)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xFF)
    return t



# --- flashinfer.comm.mapping ------------------------------------------------------------------
class Mapping:
    """flashinfer.comm.mapping.Mapping: its constructor's sizes and checks, and the ranks and
    equality the MNNVL code reads (no groups)."""

    def __init__(self, world_size: int = 1, rank: int = 0, gpus_per_node: int = 8, *,
                 cp_size: int = 1, cp_config: Optional[dict] = None, tp_size: int = 1,
                 pp_size: int = 1, moe_cluster_size: int = -1, moe_tp_size: int = -1,
                 moe_ep_size: int = -1, attn_tp_size: int = -1, attn_cp_size: int = -1,
                 auto_parallel: bool = False, enable_attention_dp: bool = False):
        if moe_cluster_size == -1:
            moe_cluster_size = 1
        if moe_tp_size == -1 and moe_ep_size == -1:
            moe_tp_size, moe_ep_size = tp_size // moe_cluster_size, 1
        elif moe_tp_size == -1:
            moe_tp_size = tp_size // (moe_ep_size * moe_cluster_size)
        elif moe_ep_size == -1:
            moe_ep_size = tp_size // (moe_tp_size * moe_cluster_size)
        if attn_tp_size == -1 and attn_cp_size == -1:
            attn_tp_size, attn_cp_size = tp_size * cp_size, 1
        elif attn_tp_size == -1:
            attn_tp_size = cp_size * tp_size // attn_cp_size
        elif attn_cp_size == -1:
            attn_cp_size = cp_size * tp_size // attn_tp_size
        if attn_cp_size != 1:
            raise ValueError(f"attn_cp_size must be 1 for now, but got {attn_tp_size}, "
                             f"{attn_cp_size}.")
        if auto_parallel:
            if tp_size != 1 or pp_size != 1:
                raise ValueError("When auto parallel is enabled, tp_size, pp_size, cp_size must "
                                 f"be 1, but got {tp_size}, {pp_size}, {cp_size}.")
        elif tp_size * pp_size * cp_size != world_size:
            raise ValueError(f"world_size must equal to tp_size * pp_size * cp_size, but got "
                             f"{world_size} != {tp_size} * {pp_size} * {cp_size}.")
        if moe_tp_size * moe_ep_size * moe_cluster_size != tp_size:
            raise ValueError(f"tp_size must equal to moe_tp_size * moe_ep_size * "
                             f"moe_cluster_size, but got {tp_size} != {moe_tp_size} * "
                             f"{moe_ep_size} * {moe_cluster_size}")
        if attn_tp_size * attn_cp_size != tp_size * cp_size:
            raise ValueError(f"tp_size * cp_size must equal to attn_tp_size * attn_cp_size, but "
                             f"got {tp_size} * {cp_size} != {attn_tp_size} * {attn_cp_size}")
        if moe_ep_size != 1 and cp_size > 1:
            raise NotImplementedError("CP don't support MoE tp/ep yet")
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.tp_size, self.pp_size, self.cp_size = tp_size, pp_size, cp_size
        self.cp_config = cp_config if cp_config is not None else {}
        self.moe_tp_size, self.moe_ep_size = moe_tp_size, moe_ep_size
        self.moe_cluster_size = moe_cluster_size
        self.attn_tp_size, self.attn_cp_size = attn_tp_size, attn_cp_size
        self.auto_parallel, self.enable_attention_dp = auto_parallel, enable_attention_dp

    @property
    def tp_rank(self) -> int:
        return 0 if self.auto_parallel else self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return 0 if self.auto_parallel else self.rank // (self.tp_size * self.cp_size)

    @property
    def cp_rank(self) -> int:
        return 0 if self.auto_parallel else \
            self.rank % (self.tp_size * self.cp_size) // self.tp_size

    def _key(self) -> tuple:
        return (self.world_size, self.rank, self.gpus_per_node, self.cp_size, self.tp_size,
                self.moe_cluster_size, self.pp_size, self.moe_tp_size, self.moe_ep_size,
                self.attn_tp_size, self.attn_cp_size, self.auto_parallel)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# --- flashinfer.comm.mnnvl --------------------------------------------------------------------
@runtime_checkable
class CommBackend(Protocol):
    """flashinfer.comm.abstractions.CommBackend (imported into flashinfer.comm.mnnvl): the
    collective interface the MNNVL memory exchanges its handles through; vLLM's
    ``mnnvl_compat.CustomCommunicator`` subclasses it."""

    def Get_rank(self) -> int:  # noqa: N802 (flashinfer's MPI-style names)
        ...

    def Get_size(self) -> int:  # noqa: N802
        ...

    def allgather(self, data: Any) -> tuple[Any, ...]:
        ...

    def bcast(self, data: Any, root: int) -> Any:
        ...

    def barrier(self) -> None:
        ...

    def Split(self, color: int, key: int) -> "CommBackend":  # noqa: N802
        ...


@dataclass
class MnnvlConfig:
    comm_backend: Any = None
    allocation_granularity: int = 0
    fabric_page_size: int = 1 << 29


@dataclass
class _Allocation:
    buffer: torch.Tensor  # uint64 [comm_size, _WORKSPACE_WORDS]
    group: Any
    size: int


class MnnvlMemory:
    """Symmetric memory of ``size`` bytes per rank; creating it exchanges handles through the
    ``CommBackend`` set by ``set_comm_from_config`` (collective); freed when the object dies."""

    initialized = False
    comm: Any = None
    config: Optional[MnnvlConfig] = None
    allocated_map: dict[int, _Allocation] = {}

    def __init__(self, mapping: Mapping, size: int):
        self.mapping = mapping
        self.segment_size = size
        self.ptr, self.rank_stride = MnnvlMemory.open_mnnvl_memory(mapping, size)

    def __del__(self) -> None:
        if not sys.is_finalizing() and hasattr(self, "ptr"):
            MnnvlMemory.close_mnnvl_memory(self.ptr)

    def as_torch_strided_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        return MnnvlMemory.allocated_map[self.ptr].buffer.view(dtype)

    @staticmethod
    def initialize() -> None:
        MnnvlMemory.initialized = True

    @staticmethod
    def set_comm_from_config(mapping: Mapping, config: Optional[MnnvlConfig] = None) -> None:
        _check(config is not None and config.comm_backend is not None,
               "no comm_backend: real flashinfer would fall back to MPI, which the emulation lacks")
        assert config is not None
        MnnvlMemory.config = config
        MnnvlMemory.comm = config.comm_backend.Split(
            mapping.pp_rank * mapping.cp_size + mapping.cp_rank, mapping.tp_rank)

    @staticmethod
    def get_comm(mapping: Mapping) -> Any:
        _check(MnnvlMemory.comm is not None,
               "MnnvlMemory has no communicator (MPI fallback not emulated); set one with "
               "MnnvlMemory.set_comm_from_config or MnnvlConfig(comm_backend=...)")
        return MnnvlMemory.comm

    @staticmethod
    def open_mnnvl_memory(mapping: Mapping, size: int) -> tuple[int, int]:
        _check(MnnvlMemory.initialized, "MnnvlMemory.initialize() was not called")
        comm = MnnvlMemory.get_comm(mapping)
        handles = comm.allgather(dist.get_rank())  # every rank's handle, in communicator order
        if list(handles) != list(range(dist.get_world_size())):
            raise NotImplementedError("[flashinfer emulation] only the default process group, in "
                                      f"rank order, is emulated; got ranks {handles}")
        buf = torch.zeros(comm.Get_size(), _WORKSPACE_WORDS, dtype=torch.uint64)
        MnnvlMemory.allocated_map[buf.data_ptr()] = _Allocation(buf, dist.group.WORLD, size)
        return buf.data_ptr(), _WORKSPACE_WORDS * 8

    @staticmethod
    def close_mnnvl_memory(ptr: int) -> None:
        MnnvlMemory.allocated_map.pop(ptr, None)


# --- flashinfer.moe_ep ------------------------------------------------------------------------
@dataclass(frozen=True)
class BootstrapConfig:
    world_size: int
    rank: int
    stream: int = 0
    auto_bootstrap: bool = True
    device: Optional[int] = field(default=None, kw_only=True)
    nccl_comm: Optional[int] = None
    process_group: Any = field(default=None, compare=False, hash=False)
    tcp_store: Any = None

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise ValueError(f"world_size must be positive, got {self.world_size}")
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"rank {self.rank} not in [0, {self.world_size})")
        if self.device is not None and self.device < 0:
            raise ValueError(f"device must be non-negative, got {self.device}")


@dataclass(frozen=True)
class MoEEpCommParams:
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_size: int
    dtype: Optional[torch.dtype] = None
    dispatch_format: Any = None
    invalid_expert_id: int = -1

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "max_tokens_per_rank", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoEEpCommParams.{name} must be a positive int")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEEpCommParams.top_k ({self.top_k}) exceeds num_experts "
                             f"({self.num_experts})")
        if 0 <= self.invalid_expert_id < self.num_experts:
            raise ValueError("MoEEpCommParams.invalid_expert_id must lie outside "
                             f"[0, num_experts={self.num_experts}), got {self.invalid_expert_id}")
        if self.dispatch_format is not None and (
                not isinstance(self.dispatch_format, QuantFormat)
                or self.dispatch_format.name not in _DISPATCH_BYTES_PER_TOKEN):
            raise ValueError("MoEEpCommParams.dispatch_format must be one of QuantFormat."
                             f"{{{', '.join(_DISPATCH_BYTES_PER_TOKEN)}}} or None, got "
                             f"{self.dispatch_format!r}")

    @property
    def token_dtype(self) -> torch.dtype:
        """``dtype``, defaulting to BF16."""
        return torch.bfloat16 if self.dtype is None else self.dtype

    @property
    def dispatch_bytes_per_token(self) -> int:
        """Bytes of one token's dispatched activations, scale factors included."""
        if self.dispatch_format is None:
            return self.hidden_size * self.token_dtype.itemsize
        return _DISPATCH_BYTES_PER_TOKEN[self.dispatch_format.name](self.hidden_size)


@dataclass(frozen=True)
class MoEEpDispatchResult:
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    tokens_per_rank: int
    hidden_states_scale: Optional[torch.Tensor] = None
    eplb_gathered_stats: Optional[torch.Tensor] = None



def _mnnvl_mapping_and_config(bootstrap: BootstrapConfig,
                              comm_backend: Any) -> tuple[Mapping, MnnvlConfig]:
    """moe_ep's ``mnnvl_mapping_and_config``: the communicator must match the bootstrap's rank
    and size; every rank's platform verdict is all-gathered (a collective, so no rank fails
    alone); a pure-EP Mapping with ``gpus_per_node = world_size``."""
    _check(comm_backend is not None,
           "the default comm_backend (torch.distributed over bootstrap.process_group) is not "
           "emulated; pass NVLinkTwoSidedConfig(comm_backend=...)")
    if comm_backend.Get_size() != bootstrap.world_size:
        raise ValueError(f"MNNVL communicator has {comm_backend.Get_size()} ranks but the EP "
                         f"group has world_size={bootstrap.world_size}")
    if comm_backend.Get_rank() != bootstrap.rank:
        raise ValueError(f"MNNVL communicator rank {comm_backend.Get_rank()} does not match "
                         f"the EP rank {bootstrap.rank}")
    verdicts = comm_backend.allgather(True)  # the emulated platform always qualifies
    unsupported = [rank for rank, supported in enumerate(verdicts) if not supported]
    if unsupported:
        raise RuntimeError(f"NVLink backends are not supported on EP ranks {unsupported}; see "
                           "their logs for the reason")
    mapping = Mapping(world_size=bootstrap.world_size, rank=bootstrap.rank,
                      gpus_per_node=bootstrap.world_size, tp_size=bootstrap.world_size,
                      moe_ep_size=bootstrap.world_size)
    return mapping, MnnvlConfig(comm_backend=comm_backend)


class MoEEpCommunication:
    """moe_ep's base class: the local platform check, EP rank and size, experts per rank."""

    backend_name = "nvlink_two_sided"
    supports_cuda_graph = True

    def __init__(self, bootstrap: BootstrapConfig, params: MoEEpCommParams):
        if not self.is_platform_supported():
            raise RuntimeError(f"{type(self).__name__} is not supported on this platform.")
        self.bootstrap, self.params = bootstrap, params
        self.ep_rank, self.ep_size = bootstrap.rank, bootstrap.world_size
        if params.num_experts % self.ep_size != 0:
            raise ValueError(f"{type(self).__name__} requires num_experts ({params.num_experts}) "
                             f"divisible by the EP size ({self.ep_size})")
        self.num_local_experts = params.num_experts // self.ep_size

    @classmethod
    def is_platform_supported(cls) -> bool:
        return True

    def _resolve_runtime_max_tokens_per_rank(self, runtime_max_tokens_per_rank: Optional[int]
                                             ) -> int:
        capacity = self.params.max_tokens_per_rank
        if runtime_max_tokens_per_rank is None:
            return capacity
        if not 0 < runtime_max_tokens_per_rank <= capacity:
            raise ValueError(f"runtime_max_tokens_per_rank={runtime_max_tokens_per_rank} "
                             f"must be in (0, {capacity}]")
        return runtime_max_tokens_per_rank

    def get_combine_input_buffer(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        return None

    def destroy(self) -> None:
        """Release backend resources (the base class holds none)."""


#: moe_ep's registry of communication backends: the emulated release's classes, set by the
#: installer of the emulation (``register_communication`` at import time upstream).
_COMMUNICATION_REGISTRY: dict[str, type] = {}


def create_communication(bootstrap: BootstrapConfig, params: MoEEpCommParams, backend: Any,
                         **options: Any) -> MoEEpCommunication:
    """moe_ep's factory: the registered backend named by ``backend`` (a name, or a config object
    with ``backend_name``, then passed as ``config``)."""
    name = getattr(backend, "backend_name", backend)
    if not isinstance(name, str):
        raise TypeError("backend must be a string or have a .backend_name str attr; "
                        f"got {backend!r}")
    cls = _COMMUNICATION_REGISTRY.get(name)
    if cls is None:
        raise KeyError(f"unknown communication backend {name!r}; available: "
                       f"{sorted(_COMMUNICATION_REGISTRY)}")
    if not isinstance(backend, str):
        options["config"] = backend
    return cls(bootstrap, params, **options)
