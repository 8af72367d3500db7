"""Transport of ``deepep_auto``: ONE DeepEP ``deep_ep.Buffer`` (either line,
:mod:`moe_plugins.stack.deepep`) with both modes.

The buffer is built in low-latency mode with the NVLink bytes of normal mode as well (DeepEP's
normal-mode hints, :func:`moe_plugins.all2all.deepep_ht.normal_mode_bytes`) and RDMA bytes for the larger
of the two modes (as DeepEP's ``tests/test_intranode.py`` builds its low-latency-compatible
buffer, and SGLang its ``--deepep-mode auto`` one). Both managers run over it: the
low-latency one (:class:`DeepEPAutoLLManager`, its capacity ``ll_max_tokens_per_rank``) owns
it, the normal-mode one borrows it. After a normal-mode call the low-latency buffer is cleaned
(``clean_low_latency_buffer``) before the next low-latency call: normal mode may have written the
shared RDMA buffer (internode), and DeepEP's low-latency kernels expect it clean.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from moe_plugins.all2all.deepep_ll import DeepEPLLManager, DeepEPLLOptions
from moe_plugins.all2all.deepep_ht import DeepEPHTManager, DeepEPHTOptions, normal_mode_bytes
from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.backend_manager import BackendManager

__all__ = ["DeepEPAutoOptions", "DeepEPAutoLLManager", "DeepEPAutoManager"]
# Buffers that ran normal mode since their last low-latency call. Per buffer, not per manager:
# the layers of a model share one buffer, and any of them may be the next to run low-latency.
_NEEDS_CLEAN: "weakref.WeakSet[Any]" = weakref.WeakSet()


@dataclass(frozen=True)
class DeepEPAutoOptions(DeepEPLLOptions):
    """``DispatchConfig.backend_options`` of ``deepep_auto``: the low-latency settings
    (:class:`moe_plugins.all2all.deepep_ll.DeepEPLLOptions`) plus

    ll_max_tokens_per_rank: the low-latency buffers' token capacity (rounded up as the kernels
        need), at most ``DispatchConfig.max_tokens_per_rank``; None: that value (as deepep_ll
        sizes its buffers; under vLLM the MoE chunk size ``moe.max_num_tokens``). Every
        CUDA-graph capture takes the low-latency kernels, so it must fit. Bigger means more
        low-latency buffer memory and NVSHMEM QP depth (``2 * (tokens + 1)``).
    link: the system's links (a :class:`moe_plugins.planner.link_model.LinkModel`, e.g. a
        preset of :data:`moe_plugins.planner.presets.LINK_PRESETS`). Given, calls whose
        largest rank has at most the time model's crossover less one tokens (at most the
        capacity) take the low-latency kernels, larger ones normal mode
        (:func:`moe_plugins.planner.crossover.low_latency_threshold`, the crossover
        ``moe-plugins plan --sweep-tokens`` prints); its ``ll_nvlink`` must equal
        ``allow_nvlink``, the kernels' own setting (the time model would otherwise time
        transfers the kernels do not make). None: up to the capacity. Either way, under
        vLLM prefill passes take normal mode. Every rank must be given the same link.
    """

    ll_max_tokens_per_rank: Optional[int] = None
    link: Optional[LinkModel] = None

    def __post_init__(self) -> None:
        if self.ll_max_tokens_per_rank is not None and self.ll_max_tokens_per_rank < 1:
            raise ValueError(f"ll_max_tokens_per_rank must be >= 1, got "
                             f"{self.ll_max_tokens_per_rank}")
        if self.link is not None and not isinstance(self.link, LinkModel):
            raise TypeError(f"DeepEPAutoOptions.link must be a LinkModel or None, got "
                            f"{type(self.link).__name__}; pass e.g. "
                            "moe_plugins.planner.presets.link_preset('h200-cx7')")
        if self.link is not None and self.link.ll_nvlink != self.allow_nvlink:
            raise ValueError(
                f"DeepEPAutoOptions: link.ll_nvlink={self.link.ll_nvlink} but "
                f"allow_nvlink={self.allow_nvlink}: the mode threshold would be timed for "
                "transfers the low-latency kernels do not make. Give both the same value: "
                f"DeepEPAutoOptions(link=..., allow_nvlink={self.link.ll_nvlink}) keeps the "
                "kernels as the link says")


class DeepEPAutoLLManager(DeepEPLLManager):
    """The low-latency side of ``deepep_auto``: its buffer also carries normal mode's bytes."""

    backend_name = "deepep_auto"
    options_type = DeepEPAutoOptions
    options: DeepEPAutoOptions

    def _normal_bytes(self) -> tuple[int, int]:
        return normal_mode_bytes(self.lib, self.num_ranks, self.hidden, self.cfg.dtype)

    def _size_hint(self, max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return max(super()._size_hint(max_tokens, hidden, num_ranks, num_experts),
                   self._normal_bytes()[1])

    def _num_nvl_bytes(self) -> int:
        return self._normal_bytes()[0]

    def _num_qps_per_rank(self) -> int:
        # internode normal mode wants a QP per channel (DeepEP's test_internode)
        return max(self.num_local_experts, int(self.lib.Buffer.num_sms))


class DeepEPAutoManager(BackendManager):
    """Both modes of one layer config over one EP group and one buffer.

    ``ll``: :class:`DeepEPAutoLLManager` (``max_tokens_per_rank`` is the low-latency capacity);
    ``ht``: :class:`moe_plugins.all2all.deepep_ht.DeepEPHTManager` on the same
    buffer. ``low_latency_capacity``: the capacity, in tokens per rank (the switching threshold
    is the prepare/finalize's: :class:`moe_plugins.prepare_finalize.deepep_auto.DeepEPAutoPrepareFinalize`)."""

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        options = cfg.backend_options if cfg.backend_options is not None else DeepEPAutoOptions()
        if not isinstance(options, DeepEPAutoOptions):
            raise TypeError(f"deepep_auto: backend_options must be a DeepEPAutoOptions, got "
                            f"{type(options).__name__}; pass DispatchConfig(backend_options="
                            "DeepEPAutoOptions(...))")
        if options.link is not None:  # before any buffer: the threshold is priced on it
            options.link.check_fits(dist.get_world_size(ctx.ep_group))
        cap = min(options.ll_max_tokens_per_rank or cfg.max_tokens_per_rank,
                  cfg.max_tokens_per_rank)
        self.ll_cfg = dataclasses.replace(cfg, max_tokens_per_rank=cap, backend_options=options)
        self.ht_cfg = dataclasses.replace(cfg, backend_options=DeepEPHTOptions(
            allow_mnnvl=options.allow_mnnvl))
        self.ctx, self.cfg, self.options = ctx, cfg, options
        self.ll = DeepEPAutoLLManager(ctx, self.ll_cfg)
        try:
            self.ht = DeepEPHTManager(ctx, self.ht_cfg, buffer=self.ll.buffer)
        except BaseException:
            self.ll.destroy()
            raise
        self.group, self.num_ranks, self.rank = self.ll.group, self.ll.num_ranks, self.ll.rank
        self.num_local_experts = self.ll.num_local_experts

    @classmethod
    def engine_options(cls, tcp_store: Any, fault_tolerance: bool = False,
                       link: Optional[LinkModel] = None) -> Optional[DeepEPAutoOptions]:
        """The options an engine (the vLLM glue) builds the layer with when the user gave none:
        the link the engine's settings name (``--additional-config``), with the kernels'
        NVLink use as its ``ll_nvlink`` says, else the defaults."""
        if link is None:
            return None
        return DeepEPAutoOptions(link=link, allow_nvlink=link.ll_nvlink)

    @property
    def buffer(self) -> Any:
        return self.ll.buffer

    @property
    def low_latency_capacity(self) -> int:
        return self.ll.max_tokens_per_rank

    def before_low_latency(self) -> None:
        """Clean the low-latency buffer when normal mode ran since the last low-latency call."""
        buffer = self.buffer
        if buffer in _NEEDS_CLEAN:
            ll = self.ll
            buffer.clean_low_latency_buffer(ll.max_tokens_per_rank, ll.kernel_hidden,
                                            ll.num_experts)
            _NEEDS_CLEAN.discard(buffer)

    def after_normal(self) -> None:
        """Record that normal mode used the buffer (the next low-latency call cleans it)."""
        _NEEDS_CLEAN.add(self.buffer)

    def destroy(self) -> None:
        """Release the buffer (the normal-mode manager borrows it; idempotent)."""
        self.ht.destroy()
        self.ll.destroy()

