"""Transport of ``deepep_ht``: DeepEP's ``deep_ep.Buffer`` in normal (high-throughput) mode.

Runs on DeepEP's V1 line (commit 567632d, the last before the V2 rewrite) and on the current
line's legacy Buffer (d4f41e4 and later; :mod:`moe_plugins.stack.deepep` says which is
installed and how they differ): the buffer's NVLink
(and, across nodes, RDMA) bytes come from DeepEP's own hints, the larger of
``Buffer.get_dispatch_config(R)`` and ``get_combine_config(R)``'s
``get_nvl_buffer_size_hint / get_rdma_buffer_size_hint(hidden_bytes, R)`` with ``hidden_bytes =
hidden * max(element size, 2)`` (DeepEP's README ``get_buffer``). The manager owns the buffer;
the prepare/finalize (:mod:`moe_plugins.prepare_finalize.deepep_ht`) makes the calls on it.

Normal-mode kernels take 2, 4 or 8 ranks inside a node (DeepEP's ``SWITCH_RANKS``), or
multiples of 8 across nodes (RDMA + NVLink); 1 rank has no config. ``deep_ep`` is imported when a
manager is built, never at import time.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from moe_plugins.all2all.deepep_ll import DEEPEP_PACKAGE
from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.backend_manager import BackendManager
from moe_plugins.lowlat.limits import check_kernel_layer
from moe_plugins.lowlat.vendor import buffer_cache, import_vendor
from moe_plugins.quant import QuantScheme
from moe_plugins.stack.deepep import require_buffer_api

logger = logging.getLogger(__name__)

__all__ = ["DeepEPHTOptions", "DeepEPHTManager", "NormalModeBytes", "normal_mode_bytes",
           "check_normal_mode_layer", "HT_QUANTS", "MAX_TOPK", "MAX_LOCAL_EXPERTS", "EP_SIZES"]

#: Quant schemes the normal-mode dispatch moves (fp8 travels with its float block-128 scales).
HT_QUANTS = frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128})
#: The dispatch kernel copies top-k entries one per warp lane (EP_DEVICE_ASSERT(num_topk <= 32)).
MAX_TOPK = 32
#: notify_dispatch handles one local expert per thread of a 128-thread block.
MAX_LOCAL_EXPERTS = 128
#: EP sizes DeepEP has normal-mode configs for (``Buffer.get_dispatch_config``'s table):
#: 2, 4, 8 inside a node (the intranode kernels' SWITCH_RANKS), multiples of 8 across nodes.
EP_SIZES = frozenset({2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160})
_ROW_ALIGN_BYTES = 16  # rows move as int4 vectors


@dataclass(frozen=True)
class DeepEPHTOptions:
    """``DispatchConfig.backend_options`` of ``deepep_ht``.

    allow_mnnvl: allow multi-node NVLink (DeepEP ``allow_mnnvl``).
    use_fabric: allocate the NVLink buffer through the fabric API (DeepEP 567632d's
        ``use_fabric``; the current line has no such switch and uses the fabric API exactly
        with ``allow_mnnvl``, so there it needs ``allow_mnnvl=True``).
    """

    allow_mnnvl: bool = False
    use_fabric: bool = False


class NormalModeBytes(NamedTuple):
    """Buffer bytes normal mode needs for one layer shape and EP size (DeepEP's hints)."""

    nvl: int
    rdma: int


def normal_mode_bytes(lib: Any, num_ranks: int, hidden: int, dtype: torch.dtype) -> NormalModeBytes:
    """The larger of the dispatch and combine configs' NVLink and RDMA size hints for rows of
    ``hidden`` values of ``dtype`` (at least 2 bytes a value: the combine moves bf16)."""
    hidden_bytes = hidden * max(torch.empty((), dtype=dtype).element_size(), 2)
    nvl = rdma = 0
    for config in (lib.Buffer.get_dispatch_config(num_ranks),
                   lib.Buffer.get_combine_config(num_ranks)):
        nvl = max(nvl, int(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)))
        rdma = max(rdma, int(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)))
    return NormalModeBytes(nvl, rdma)


def check_normal_mode_layer(cfg: DispatchConfig, backend: str) -> None:
    """Layer checks of the normal-mode kernels that need no process group (raise ValueError)."""
    check_kernel_layer(cfg, backend, "DeepEP's normal-mode combine reduces bfloat16 only",
                       MAX_TOPK, HT_QUANTS)
    if cfg.hidden * 2 % _ROW_ALIGN_BYTES or (cfg.quant.quantized_on_wire
                                              and cfg.hidden % _ROW_ALIGN_BYTES):
        raise ValueError(f"{backend}: hidden={cfg.hidden} gives rows that are not a multiple of "
                         f"{_ROW_ALIGN_BYTES} bytes (DeepEP moves rows as int4 vectors); use a "
                         "hidden size that is a multiple of 16")


def _check_ranks(num_ranks: int, backend: str) -> None:
    if num_ranks not in EP_SIZES:
        raise ValueError(f"{backend}: DeepEP's normal mode has configs for EP sizes "
                         f"{sorted(EP_SIZES)}, the EP group has {num_ranks}; use 'deepep_ll' or "
                         "'torch' for this EP size")


class DeepEPHTManager(BackendManager):
    """One layer config's view of a normal-mode ``deep_ep.Buffer`` over the EP group.

    Construction order: options and layer checks (no collective), the vendor import (ImportError
    naming how to get DeepEP), the EP size check, then the buffer: shared by every layer of the
    same EP group and sizes (collective on creation), or ``buffer`` when the caller owns one that
    also has normal-mode bytes (``deepep_auto``'s combined buffer; then :meth:`destroy` leaves it).

    Attributes: ``num_ranks``/``rank`` (EP group), ``placement`` (the config's, linear by
    default), ``num_experts`` (physical experts), ``num_local_experts``, ``experts_per_rank``
    (same), ``hidden``, ``bytes`` (:class:`NormalModeBytes`), ``buffer``, ``deepep`` (the
    installed DeepEP, :class:`moe_plugins.stack.deepep.DeepEPFound`).
    """

    backend_name = "deepep_ht"

    def __init__(self, ctx: DistContext, cfg: DispatchConfig, buffer: Any = None):
        self.options = self._options(cfg.backend_options)
        check_normal_mode_layer(cfg, self.backend_name)
        self.lib = import_vendor(DEEPEP_PACKAGE, self.backend_name)
        self.deepep = require_buffer_api(self.lib, self.backend_name)
        self._buffer_switches = self.deepep.buffer_kwargs(
            {"allow_mnnvl": self.options.allow_mnnvl, "use_fabric": self.options.use_fabric},
            self.backend_name)
        self.topk_idx_dtype: torch.dtype = getattr(self.lib, "topk_idx_t", torch.int64)
        self.ctx, self.cfg = ctx, cfg
        self.group = ctx.ep_group
        self.num_ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        _check_ranks(self.num_ranks, self.backend_name)
        if cfg.placement is None and cfg.num_experts % self.num_ranks:
            raise ValueError(f"{self.backend_name}: num_experts={cfg.num_experts} is not divisible "
                             f"by the EP size {self.num_ranks}; pick an EP size that divides it")
        # The kernels send expert id p to rank p // num_local_experts: the placement's physical
        # ids (EPLB's redundant copies included) are what they dispatch, as in low-latency mode.
        self.placement = cfg.placement_for(self.num_ranks)
        self.num_experts = self.placement.num_physical
        self.num_local_experts = self.experts_per_rank = self.placement.num_local
        if self.num_local_experts > MAX_LOCAL_EXPERTS:
            raise ValueError(f"{self.backend_name}: {self.num_local_experts} experts per rank "
                             f"exceed the normal-mode kernels' {MAX_LOCAL_EXPERTS}; use more EP "
                             "ranks")
        self.hidden = cfg.hidden
        self.bytes = normal_mode_bytes(self.lib, self.num_ranks, cfg.hidden, cfg.dtype)
        self._key: Optional[tuple] = None
        if buffer is not None:
            if buffer.num_nvl_bytes < self.bytes.nvl or buffer.num_rdma_bytes < self.bytes.rdma:
                raise ValueError(f"{self.backend_name}: the given buffer has {buffer.num_nvl_bytes}"
                                 f" NVLink / {buffer.num_rdma_bytes} RDMA bytes, normal mode needs "
                                 f"{self.bytes.nvl} / {self.bytes.rdma}")
            self.buffer = buffer
            return
        key = (self.backend_name, id(self.group), self.rank, self.num_ranks, self.bytes,
               self.options)
        self.buffer = buffer_cache().acquire(key, self._create_buffer, lambda b: b.destroy())
        self._key = key

    def _options(self, given: object) -> DeepEPHTOptions:
        if given is None:
            return DeepEPHTOptions()
        if not isinstance(given, DeepEPHTOptions):
            raise TypeError(f"{self.backend_name}: backend_options must be a DeepEPHTOptions, got "
                            f"{type(given).__name__}; pass DispatchConfig(backend_options="
                            "DeepEPHTOptions(...))")
        return given

    def _create_buffer(self) -> Any:
        buffer = self.lib.Buffer(self.group, num_nvl_bytes=self.bytes.nvl,
                                 num_rdma_bytes=self.bytes.rdma, low_latency_mode=False,
                                 # internode normal mode: one QP per channel (DeepEP's tests)
                                 num_qps_per_rank=max(1, int(self.lib.Buffer.num_sms)),
                                 explicitly_destroy=True, **self._buffer_switches)
        logger.info("%s: buffer for EP rank %d/%d, %d local experts, hidden %d, %d NVLink bytes, "
                    "%d RDMA bytes (DeepEP's size hints); %s", self.backend_name, self.rank,
                    self.num_ranks, self.num_local_experts, self.hidden, self.bytes.nvl,
                    self.bytes.rdma, self.deepep.describe())
        return buffer

    def destroy(self) -> None:
        """Release this manager's share of the buffer (the last one destroys it); idempotent.
        A buffer given at construction belongs to the caller and is left alone."""
        if self._key is not None:
            key, self._key = self._key, None
            buffer_cache().release(key)
