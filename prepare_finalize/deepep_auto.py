"""Backend ``deepep_auto``: DeepEP V1 low-latency or normal mode, chosen per call.

One layer object holds both modes over one EP group and one buffer (:mod:`moe_plugins.all2all.deepep_auto`).
Per call it takes the **low-latency** kernels when the largest rank's batch is at most the
layer's threshold, and for every CUDA-graph capture (normal mode waits on the host and cannot be
captured), **normal mode** otherwise, and under vLLM for prefill passes
(:class:`moe_plugins.interface.BatchHint`, read from vLLM's forward context by
:mod:`moe_plugins.vllm.batch_hint`). The threshold is set once, when the layer is built: with a
link (``DeepEPAutoOptions.link``) the batch below the one where the time model puts normal mode
under the low-latency one for this layer's shape, quant and EP size, at most the low-latency
buffers' capacity; without one, the capacity. All EP ranks must take the same mode (the two are
different collectives), so the choice uses only what is the same on every rank: the threshold
(from the layer config and the link; the ranks check at construction that they computed the
same one) and the engine's hint, or without one the largest token count over the EP group (one
small all_reduce MAX per call).

One format for the experts: STANDARD. Normal mode is STANDARD already; the low-latency receive
layout is presented as STANDARD rows without a copy of the activations
(:func:`moe_plugins.formats.batched_as_standard`: one row per (expert, slot), one routing column,
weight 1.0, since the low-latency combine applies the router weights). So vLLM builds one kind
of experts (standard, with ``expert_map``) for both modes.

The threshold is logged once per layer config; ``stats.modes`` counts the calls of each mode.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.distributed as dist

from moe_plugins.all2all.deepep_auto import DeepEPAutoManager
from moe_plugins.config import DispatchConfig, MoEConfig
from moe_plugins.counters import DispatchStats
from moe_plugins.faults import collective_error, group_faults, layer_name
from moe_plugins.formats import batched_as_standard, standard_as_batched
from moe_plugins.interface import (ActivationFormat, AsyncResult, BatchHint, PrepareFinalize,
                                   PrepareResult, RowScatterTarget, capturing,
                                   check_prepare_inputs)
from moe_plugins.planner.crossover import low_latency_threshold
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import CallModes
from moe_plugins.prepare_finalize.deepep_ht import SPEC as DEEPEP_HT_SPEC
from moe_plugins.prepare_finalize.deepep_ht import DeepEPHTPrepareFinalize, deepep_spec
from moe_plugins.prepare_finalize.deepep_ll import SPEC as DEEPEP_LL_SPEC
from moe_plugins.prepare_finalize.deepep_ll import DeepEPLLPrepareFinalize

logger = logging.getLogger(__name__)

__all__ = ["DeepEPAutoPrepareFinalize", "SPEC", "LOW_LATENCY", "NORMAL", "PLANNED_CAPACITY"]

LOW_LATENCY = "low_latency"
NORMAL = "normal"
#: The capacity `moe-plugins plan` assumes: the default max_tokens_per_rank of a MoELayer and
#: vLLM's default MoE chunk (VLLM_MOE_DP_CHUNK_SIZE), which the capacity defaults to.
PLANNED_CAPACITY = 256
_LOGGED: set[tuple] = set()
#: The backends whose wire and transport each mode has (the time model prices them).
_MODES = CallModes(DEEPEP_LL_SPEC, DEEPEP_HT_SPEC, PLANNED_CAPACITY)


def _layer_shape(cfg: DispatchConfig, num_experts: int) -> MoEConfig:
    """The MoE shape the all-to-alls depend on (hidden, experts as the kernels number them,
    top-k, dtype); the expert sizes do not enter them."""
    return MoEConfig(hidden=cfg.hidden, num_experts=num_experts, num_topk=cfg.num_topk,
                     intermediate=1, shared_intermediate=0, dtype=cfg.dtype)


class DeepEPAutoPrepareFinalize(PrepareFinalize):
    """STANDARD layout in both modes (see the module doc). Normal mode: as
    :class:`moe_plugins.prepare_finalize.deepep_ht.DeepEPHTPrepareFinalize`. Low-latency mode: x
    [num_local_experts * num_recv_slots, hidden], topk_ids int64 [.., 1] (local expert or -1),
    topk_weights float32 [.., 1] (1.0 / 0.0); the experts' router-weighted output per row (so
    the row's own expert output, unweighted) goes back through the low-latency combine."""

    activation_format = ActivationFormat.STANDARD
    waits_on_host = True  # in normal mode, as deepep_ht (whose dispatch arms the timer)

    def __init__(self, manager: DeepEPAutoManager, cfg: DispatchConfig):
        if not isinstance(manager, DeepEPAutoManager):
            raise TypeError(f"DeepEPAutoPrepareFinalize needs a DeepEPAutoManager, got "
                            f"{type(manager).__name__}")
        self.manager, self.cfg = manager, cfg
        self.ll = DeepEPLLPrepareFinalize(manager.ll, manager.ll_cfg)
        self.ht = DeepEPHTPrepareFinalize(manager.ht, manager.ht_cfg)
        # as deepep_ht: in normal mode the host wait raises at DeepEP's timeout (as built) first
        self.library_timeout_s = self.ht.library_timeout_s
        self._modes: dict[str, int] = {}  # calls per mode
        self._hint: Optional[BatchHint] = None
        self._mode: Optional[str] = None
        # The two modes' objects share this group's fault state (moe_plugins.faults).
        self.faults = group_faults(manager.group)
        self.name = layer_name("deepep_auto", cfg, manager.rank)
        cap = manager.low_latency_capacity
        link = manager.options.link
        if link is None:
            self.threshold = cap
            why = ("the low-latency buffer capacity; no link given, so the time model is not "
                   "used: name one with DeepEPAutoOptions(link=...) or, under vLLM, "
                   "--additional-config moe_plugins.link")
        else:
            found = low_latency_threshold(_layer_shape(cfg, manager.ll.num_experts),
                                          manager.num_ranks, cfg.quant, link, _MODES, cap)
            self.threshold, why = found.rows, found.reason
        # every rank, link or not: a rank that skipped this collective would pair it with a
        # later one
        self._check_agreed({
            "DeepEPAutoOptions.link (1: given, 0: none)": int(link is not None),
            "low-latency capacity in tokens per rank (DeepEPAutoOptions.ll_max_tokens_per_rank,"
            " else max_tokens_per_rank)": cap,
            "DeepEPAutoOptions.allow_nvlink (1: on, 0: off)": int(manager.options.allow_nvlink),
            "low-latency threshold in tokens per rank (from the layer config and the link)":
                self.threshold})
        key = (manager.num_ranks, cfg, cap, link)
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.info("deepep_auto: low-latency up to %d tokens per rank (%s), normal mode "
                        "above; a CUDA-graph capture takes low-latency up to the capacity of %d "
                        "tokens per rank; under vLLM prefill passes take normal mode",
                        self.threshold, why, cap)

    @property
    def stats(self) -> DispatchStats:  # type: ignore[override]
        """One count for the layer: both modes' stats summed (the low-latency side computes its
        own when read), with ``modes`` the calls of each mode."""
        ll, ht = self.ll.stats, self.ht.stats
        total = DispatchStats(**{f: getattr(ll, f) + getattr(ht, f)
                                 for f in DispatchStats.__dataclass_fields__})
        total.modes = dict(self._modes)
        return total

    @property
    def low_latency_capacity(self) -> int:
        return self.manager.low_latency_capacity

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def supports_async(self) -> bool:
        return True

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        """Both modes take DeepEP's ``topk_idx_t``."""
        return self.ll.topk_indices_dtype()

    def post_init_setup(self, experts: object) -> None:
        """Not forwarded to the low-latency half: both modes hand the experts FP8 scales as
        float32 [.., hidden // 128], the only format normal mode's dispatch has, so experts that
        could read the low-latency kernel's packed UE8M0 scales still get float32 ones (one
        layer never shows its experts two scale formats). Said once at INFO."""
        asks = getattr(experts, "supports_packed_ue8m0_act_scales", None)
        if asks is None or not asks() or not self.cfg.quant.quantized_on_wire:
            return
        key = ("packed_ue8m0", type(experts).__name__)
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.info("deepep_auto: %s can read packed UE8M0 scales, but normal mode "
                        "dispatches float32 ones: both modes hand it float32 scales",
                        type(experts).__name__)

    uses_batch_hint = True

    def set_batch_hint(self, hint: Optional[BatchHint]) -> None:
        self._hint = hint

    def reset_call_state(self) -> None:
        self.ll.reset_call_state()
        self.ht.reset_call_state()
        self._mode = None

    def _check_agreed(self, values: dict[str, int]) -> None:
        """ValueError on every rank, naming the first of ``values`` (what -> this rank's value)
        the EP ranks do not all hold, with each rank's value: their calls would pair different
        collectives (other modes, other buffer sizes) and wait out the process-group timeout.
        One all_gather at construction, on every rank."""
        m = self.manager
        mine = torch.tensor(list(values.values()), dtype=torch.int64, device=m.ctx.device)
        every = [torch.empty_like(mine) for _ in range(m.num_ranks)]
        dist.all_gather(every, mine, group=m.group)
        table = torch.stack(every).cpu().tolist()  # [rank][value]
        for i, what in enumerate(values):
            column = [row[i] for row in table]
            if len(set(column)) > 1:
                each = ", ".join(f"EP rank {r}: {v}" for r, v in enumerate(column))
                raise ValueError(
                    f"deepep_auto: the EP ranks were built with different {what} ({each}; this "
                    f"is EP rank {m.rank}); every rank's two modes must be the same collectives: "
                    "give every rank of the EP group the same layer config and "
                    "DeepEPAutoOptions (link, ll_max_tokens_per_rank, allow_nvlink)")

    # -- the choice ----------------------------------------------------------------------------
    def choose_mode(self, num_tokens: int) -> str:
        """The mode of a call with ``num_tokens`` rows on this rank: the same on every rank
        (capture: low-latency; else by :attr:`threshold` and the engine's prefill hint, or the
        largest count over the EP group)."""
        cap = self.low_latency_capacity
        hint, self._hint = self._hint, None  # a hint covers one call
        if capturing():
            if num_tokens > cap:
                raise ValueError(
                    f"deepep_auto: a CUDA-graph capture of {num_tokens} tokens per rank, but the "
                    f"low-latency buffers hold {cap} and normal mode cannot be captured; raise "
                    "DeepEPAutoOptions.ll_max_tokens_per_rank or capture smaller batches")
            return LOW_LATENCY
        if hint is not None:
            if hint.max_tokens_per_rank < num_tokens:
                raise ValueError(f"deepep_auto: the engine's hint says at most "
                                 f"{hint.max_tokens_per_rank} tokens per rank, this rank has "
                                 f"{num_tokens}")
            largest, prefill = hint.max_tokens_per_rank, bool(hint.prefill)
        else:
            largest, prefill = self._largest_over_ranks(num_tokens), False
        return LOW_LATENCY if largest <= self.threshold and not prefill else NORMAL

    def _largest_over_ranks(self, num_tokens: int) -> int:
        m = self.manager
        t = torch.tensor([num_tokens], dtype=torch.int64, device=m.ctx.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=m.group)
            return int(t.item())
        except RuntimeError as e:  # a peer gone or silent: the group's error, on every rank
            raise collective_error(self.faults, self.name, "mode choice all-reduce",
                                   getattr(m.ctx, "timeout_s", None), e) from e

    # -- prepare / finalize ----------------------------------------------------------------------
    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        """hidden_states bf16 [num_tokens, hidden], topk_* [num_tokens, num_topk] GLOBAL ids.
        Checks run before the choice's collective, identically on every rank."""
        return self._prepare(hidden_states, topk_weights, topk_ids, quant, False)

    def prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, quant: QuantSpec) -> PrepareResult:
        """:meth:`prepare_async` through the chosen mode's synchronous prepare (low-latency
        mode: the blocking library call, one launch instead of two)."""
        out = self._prepare(hidden_states, topk_weights, topk_ids, quant, True).receiver()
        assert isinstance(out, PrepareResult)
        return out

    def _prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, quant: QuantSpec, blocking: bool) -> AsyncResult:
        f = self.faults
        if self._mode is not None:
            raise f.call_in_flight(self.name)
        owed = f.owed_by
        if owed is not None and (owed is self.ll or owed is self.ht):
            # a mode's object refused this rank's tokens after the choice: the call without
            # them takes that mode again, without the choice's collective (the peers are past it)
            mode = LOW_LATENCY if owed is self.ll else NORMAL
            self._hint = None
        else:
            if f.broken is not None or owed is not None:
                f.begin(self, self.name, hidden_states)
            try:  # before the choice's collective: nothing sent (faults, rule "refused inputs")
                check_prepare_inputs(hidden_states, topk_weights, topk_ids, self.cfg)
                mode = self.choose_mode(hidden_states.shape[0])
            except (ValueError, TypeError) as e:
                raise f.refuse(self, self.name, e)
        self._modes[mode] = self._modes.get(mode, 0) + 1
        if mode == NORMAL:
            if blocking:
                done = self.ht.prepare(hidden_states, topk_weights, topk_ids, quant)
                sent = AsyncResult(None, lambda: done)
            else:
                sent = self.ht.prepare_async(hidden_states, topk_weights, topk_ids, quant)
            self.manager.after_normal()
            self._mode = mode
            return sent
        self.manager.before_low_latency()
        if blocking:
            prep = self.ll.prepare(hidden_states, topk_weights, topk_ids, quant)
            self._mode = mode
            return AsyncResult(None, lambda: batched_as_standard(prep))
        sent = self.ll.prepare_async(hidden_states, topk_weights, topk_ids, quant)
        self._mode = mode

        def receiver() -> PrepareResult:
            prep = sent.receiver()
            assert isinstance(prep, PrepareResult)
            return batched_as_standard(prep)

        return AsyncResult(sent.hook, receiver)

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> AsyncResult:
        """fused_expert_output bf16 [num_recv_rows, hidden]: the rows prepare presented, each
        the router-weighted sum of this rank's experts (low-latency rows: weight 1.0)."""
        pf, expert_output = self._finalize_target(fused_expert_output)
        return pf.finalize_async(expert_output, topk_weights, topk_ids, output)

    def finalize(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> torch.Tensor:
        """:meth:`finalize_async` through the chosen mode's synchronous finalize."""
        pf, expert_output = self._finalize_target(fused_expert_output)
        return pf.finalize(expert_output, topk_weights, topk_ids, output)

    def _finalize_target(self, fused_expert_output: torch.Tensor
                         ) -> tuple[PrepareFinalize, torch.Tensor]:
        """The backend of the call in flight's mode and the expert outputs in its layout."""
        mode, self._mode = self._mode, None
        if mode is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        if mode == NORMAL:
            return self.ht, fused_expert_output
        try:
            batched = standard_as_batched(fused_expert_output, self.manager.num_local_experts)
        except ValueError:
            self.ll.reset_call_state()
            raise
        return self.ll, batched.contiguous()


SPEC = deepep_spec(
    "deepep_auto", DeepEPAutoPrepareFinalize, DeepEPAutoManager,
    "DeepEP V1 low-latency for batches that fit its buffers and CUDA graphs, normal mode above "
    "and for prefill (one buffer); STANDARD format for both",
    # after deepep_ll (auto-selection keeps its choice), before flashinfer and the reference
    priority=28, call_modes=_MODES,
    use_for="decode and prefill on one DeepEP buffer: low-latency mode while a batch fits, "
            "normal mode above it")
