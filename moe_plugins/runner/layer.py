"""Engine-agnostic MoE layer runner: router, routed experts through a backend, shared expert,
and every reduction strategy of docs/design.md. Used by the tests, the demo and the benchmarks."""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.counters import CollectiveLog, DispatchStats
from moe_plugins.runner.experts import TorchExperts
from moe_plugins.faults import (PeerMaskedError, group_faults, in_step, is_in_step,
                                is_owed_call, call_fault_error)
from moe_plugins.groups import DistContext, all_gather_rows
from moe_plugins.interface import PrepareFinalize, PrepareResult, RowScatterTarget, capturing
from moe_plugins.backend_manager import BackendManager, RankMasking
from moe_plugins.layout import local_expert_ids, owned_rows, slice_owned
from moe_plugins.runner.model import MoEWeights, route
from moe_plugins.placement import ExpertPlacement
from moe_plugins.overlap import (OverlapConfig, SharedExpertHandle, join, launch_shared,
                                 overlap_off_reason)
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import BackendSelectionError, BackendSpec, refusal_reason
from moe_plugins.strategy import (ReductionStrategy, SharedPlacement, applicable_strategies,
                                  choose_strategy)
from moe_plugins.callbound import bound_host_waits
from moe_plugins.callbound import CallBound
from moe_plugins.survival.continuation import LayerContinuation, PeerLossOptions

logger = logging.getLogger(__name__)


def layer_input_error(name: str, x: object, hidden: int, device: torch.device, tp: int,
                      capacity: Optional[int]) -> Optional[Exception]:
    """Why a layer refuses its input ``x`` (None: it does not): x must be a float tensor
    ``[num_tokens, hidden]`` on the layer's ``device`` whose TP chunk (``ceil(num_tokens / tp)``)
    fits the backend's ``capacity`` per rank (None: no fixed capacity)."""
    if not isinstance(x, torch.Tensor):
        return TypeError(f"{name}: x must be a torch.Tensor [num_tokens, {hidden}], got "
                         f"{type(x).__module__}.{type(x).__qualname__}; convert it with "
                         f"torch.as_tensor(x, device={str(device)!r})")
    if x.device != device:
        return ValueError(f"{name}: x is on {x.device}, the layer on {device}; move it with "
                          ".to(device)")
    if x.dim() != 2 or x.shape[1] != hidden or not x.is_floating_point():
        return (ValueError if x.is_floating_point() else TypeError)(
            f"{name}: x must be float [num_tokens, {hidden}], got {x.dtype} {tuple(x.shape)}")
    if capacity is not None and -(-x.shape[0] // tp) > capacity:
        # checked on the TP chunk, the same on every TP rank of the DP group (the owned rows
        # differ by one where tp does not divide the tokens)
        return ValueError(
            f"{name}: x has {x.shape[0]} tokens; with tp={tp} each TP rank dispatches up to "
            f"{-(-x.shape[0] // tp)}, the backend's buffers hold {capacity} per rank; split the "
            "batch or build the layer with a larger max_tokens_per_rank")
    return None

__all__ = ["MoELayer"]

_LOGGED: set[tuple] = set()


class MoELayer:
    """One MoE layer on one rank: router, shared expert, and the routed experts behind a
    registered backend's dispatch and combine.

    Arguments:
        weights: the full layer weights (:class:`moe_plugins.runner.model.MoEWeights`); each
            rank takes its shard.
        ctx: this rank's groups (:func:`moe_plugins.groups.make_dist_context`).
        backend: a registered backend (:func:`moe_plugins.registry.get_backend`), checked
            against the layout, quant, dtype and placement
            (:class:`moe_plugins.registry.BackendSelectionError` naming what is missing).
        strategy: None picks the layout's default (ValueError for one that does not apply).
        quant: the dispatch quantization; overlap: the shared-expert overlap switches (None:
            from the environment); shared_placement: the shared expert on the TP ranks when
            the strategy is chosen here.
        max_tokens_per_rank: the most tokens a TP rank's chunk may hold per call (the
            backend's buffers are sized for it).
        backend_options: the backend's typed options (``DispatchConfig.backend_options``;
            None: its defaults).
        placement: (EP on) where the physical experts are (None: linear); the router's logical
            ids map to physical ones (a replica per token, as vLLM's EPLB router does) before
            dispatch, and :meth:`rebalance` moves experts between forward passes.
        call_timeout_s: (None: ``$MOE_PLUGINS_CALL_TIMEOUT_S``, else off; 0: off) a call not
            complete within it ends this process with a clear error
            (:mod:`moe_plugins.callbound.watchdog`); the first calls run under the longer
            start-up bound (``$MOE_PLUGINS_FIRST_CALL_TIMEOUT_S``).
        on_peer_loss: (None: off) continue after an EP peer's loss
            (:class:`moe_plugins.survival.continuation.PeerLossOptions`; backends that mask
            ranks, tp=1; docs/faults.md).

    ``forward(x)``: x of the model dtype ``[num_tokens, hidden]``, the same on every TP rank of
    a DP group; returns the layer output ``[num_tokens, hidden]`` in ``x.dtype``.
    """

    def __init__(self, weights: MoEWeights, ctx: DistContext, backend: BackendSpec,
                 strategy: Optional[ReductionStrategy] = None, quant: QuantSpec = QuantSpec(),
                 overlap: Optional[OverlapConfig] = None, max_tokens_per_rank: int = 256,
                 shared_placement: SharedPlacement = SharedPlacement.TP_SHARDED,
                 backend_options: Any = None, placement: Optional[ExpertPlacement] = None,
                 call_timeout_s: Optional[float] = None,
                 on_peer_loss: Optional[PeerLossOptions] = None):
        cfg = weights.config
        self._bound = CallBound("MoE layer", call_timeout_s, device=ctx.device)  # named below
        self.cfg, self.ctx, self.quant = cfg, ctx, quant
        self.overlap = overlap or OverlapConfig.from_env()
        layout = ctx.layout
        strategy, reason = self._pick_strategy(backend, strategy, shared_placement, placement)
        self.strategy = strategy
        self.backend_spec = backend
        self.weights = weights
        self._place_experts(placement)
        self.router = weights.router
        self.collectives = CollectiveLog()
        self.name = f"MoE layer ({backend.name}, {layout.describe()}, {strategy.value})"
        self._bound.name = self.name
        self.faults = group_faults(ctx.ep_group)
        self._destroyed = False
        self._num_calls = 0
        #: the backend's manager and the prepare/finalize built on it (None: no dispatch)
        self.manager: Optional[BackendManager] = None
        self.pf: Optional[PrepareFinalize] = None
        if strategy.dispatches and layout.ep:  # EP on: tokens go through the backend, 1 rank too
            self._build_backend(backend, max_tokens_per_rank, backend_options)

        # the watchdog hears the group's notice for a backend whose waits do not (hears_peer_
        # failures: the backend raises; the process lives)
        if self.pf is None or not self.pf.hears_peer_failures:
            self._bound.notice = self.faults.notice
        if self.pf is not None:  # no bound set: where the library's timeout does not end a rank
            # nothing in this layer's call compiles on first use (torch experts): no start-up
            # bound, so a peer that dies after call 1 is bounded too
            self._bound.backstop(backend.name, self.pf.library_timeout_s, self.pf.library_traps,
                                 start_up=False)
        self._capacity = None if self.pf is None else self.pf.max_num_tokens_per_rank()
        self._survival: Optional[LayerContinuation] = None
        if on_peer_loss is not None:
            try:
                self._survival = LayerContinuation(self, on_peer_loss)
            except BaseException:
                self.destroy()
                raise
        # the library's own masks, watched where the buffer has a mask (see _check_library_masks)
        manager = self.manager
        self._masks_by_library = (manager.masked_by_library
                                  if isinstance(manager, RankMasking) and manager.can_mask()
                                  else None)
        self._log_config(reason)

    def _pick_strategy(self, backend: BackendSpec, strategy: Optional[ReductionStrategy],
                       shared_placement: SharedPlacement, placement: Optional[ExpertPlacement]
                       ) -> tuple[ReductionStrategy, str]:
        """The backend checked against the layer (layout, quant, dtype, placement), and the
        strategy with why: the one asked for (ValueError where it does not apply) or the
        layout's default."""
        cfg, layout, quant = self.cfg, self.ctx.layout, self.quant
        caps = backend.capabilities
        # Availability (packages, GPU) is checked by the engine's selection; here the layout
        # and quant, so a layer never runs on a backend that cannot serve it.
        refused = refusal_reason(backend, layout, quant.scheme, require_available=False,
                                 dtype=cfg.dtype, placement=placement)
        if refused:
            raise BackendSelectionError(f"backend {backend.name!r} cannot serve layout "
                                        f"{layout.describe()} with quant {quant.scheme.value}: "
                                        f"{refused}; `moe-plugins list` shows what each backend supports")
        options = applicable_strategies(layout, supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
                                        has_shared_expert=cfg.has_shared_expert)
        if strategy is None:
            choice = choose_strategy(layout, supports_sp=caps.sp, supports_row_scatter=caps.row_scatter,
                                     has_shared_expert=cfg.has_shared_expert,
                                     single_collective=self.overlap.single_collective,
                                     shared_placement=shared_placement)
            return choice.strategy, choice.reason
        if strategy not in options:
            raise ValueError(f"strategy {strategy.value} does not apply to layout {layout.describe()} "
                             f"with backend {backend.name}; applicable: {[s.value for s in options]}")
        return strategy, "requested explicitly"

    def _place_experts(self, placement: Optional[ExpertPlacement]) -> None:
        """This rank's routed experts (EP: its slots of ``placement``, linear when None; no EP:
        its TP shard of every expert) and its shared expert (TP-sharded or replicated, as the
        strategy places it)."""
        cfg, layout, weights = self.cfg, self.ctx.layout, self.weights
        tp, tp_rank = layout.tp, self.ctx.tp_rank
        if layout.ep:
            self.placement = placement or ExpertPlacement.linear(cfg.num_experts, layout.ep_size)
            self.expert_weights = weights.local_experts(layout.ep_size, self.ctx.rank,
                                                        self.placement)
        else:
            if placement is not None:
                raise ValueError(f"an expert placement needs expert parallelism; layout "
                                 f"{layout.describe()} shards every expert over TP instead. "
                                 "Enable EP or pass placement=None")
            # every rank holds (a TP shard of) every expert: one 'rank' of all of them
            self.placement = ExpertPlacement.linear(cfg.num_experts, 1)
            self.expert_weights = weights.tp_sharded_experts(tp, tp_rank)
        self.experts = TorchExperts(self.expert_weights, self.quant, cfg.dtype)
        self.shared = (weights.shared(tp, tp_rank)
                       if self.strategy.shared_placement is SharedPlacement.TP_SHARDED
                       else weights.shared())

    def _build_backend(self, backend: BackendSpec, max_tokens_per_rank: int,
                       backend_options: Any) -> None:
        """The backend's manager (its buffers, sized for ``max_tokens_per_rank``) and the
        prepare/finalize on it; the manager is destroyed again where the latter fails."""
        cfg = self.cfg
        dispatch = DispatchConfig(
            num_experts=cfg.num_experts, hidden=cfg.hidden, num_topk=cfg.num_topk,
            max_tokens_per_rank=max_tokens_per_rank, dtype=cfg.dtype, quant=self.quant,
            backend_options=backend_options, placement=self.placement)
        self.manager = backend.manager(self.ctx, dispatch)
        try:
            self.pf = backend.prepare_finalize_on(self.manager, dispatch)
        except BaseException:
            self.manager.destroy()
            raise

    def _log_config(self, reason: str) -> None:
        """The one INFO line per layer config."""
        cfg, ctx, backend, quant = self.cfg, self.ctx, self.backend_spec, self.quant
        layout = ctx.layout
        key = (backend.name, layout, self.strategy, self.overlap, quant, cfg, ctx.device.type,
               self.placement.kind)
        if key in _LOGGED:
            return
        _LOGGED.add(key)
        off = overlap_off_reason(self.overlap, ctx.device, 0) if cfg.has_shared_expert \
            else "no shared expert"
        logger.info("moe-plugins layer: backend=%s layout=%s placement=%s strategy=%s (%s) "
                    "overlap=%s quant=%s%s call bound=%s", backend.name, layout.describe(),
                    self.placement.describe(), self.strategy.value, reason,
                    f"off ({off})" if off else
                    f"on (up to {self.overlap.overlap_max_tokens} tokens per call)",
                    quant.scheme.value, " (deferred)" if quant.defer_input_quant else "",
                    self._bound.describe())

    # -- counted TP collectives (the dispatch all-to-alls are counted by the backend) -----------
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.collectives.add("all_reduce", t)
        dist.all_reduce(t, group=self.ctx.tp_group)
        return t

    def _all_gather_rows(self, owned: torch.Tensor, num_tokens: int, chunk: int) -> torch.Tensor:
        """owned [num_owned, hidden] on each TP rank -> [num_tokens, hidden] in token order."""
        gathered = all_gather_rows(owned, chunk, self.ctx.tp_group, self.ctx.layout.tp)
        self.collectives.add("all_gather", gathered[:chunk])  # what this rank sent: chunk rows
        return gathered[:num_tokens]

    @property
    def dispatch_stats(self) -> DispatchStats:
        """What this rank's backend sent, summed over calls (all zeros when the strategy does
        not dispatch)."""
        return self.pf.stats if self.pf is not None else DispatchStats()

    def rebalance(self, placement: ExpertPlacement) -> None:
        """Move the experts to ``placement`` between forward passes (EPLB): this rank loads the
        logical experts of its slots and the router maps to the new physical ids. The slot
        geometry (EP ranks, slots per rank) stays, so the backend's buffers do too."""
        old = self.placement
        if not self.ctx.layout.ep:
            raise ValueError("rebalance needs expert parallelism; this layer shards experts over TP")
        if (placement.num_ranks, placement.num_physical, placement.num_logical) != \
                (old.num_ranks, old.num_physical, old.num_logical):
            raise ValueError(f"rebalance keeps the slot geometry: the layer has {old.describe()} "
                             f"over {old.num_ranks} ranks, got {placement.describe()} over "
                             f"{placement.num_ranks}; build a new layer to change it")
        refused = refusal_reason(self.backend_spec, self.ctx.layout, self.quant.scheme,
                                 require_available=False, placement=placement)
        if refused:
            raise BackendSelectionError(f"backend {self.backend_spec.name!r} cannot rebalance to "
                                        f"{placement.describe()}: {refused}")
        self.expert_weights = self.weights.local_experts(placement.num_ranks, self.ctx.rank,
                                                         placement)
        self.experts = TorchExperts(self.expert_weights, self.quant, self.cfg.dtype)
        self.placement = placement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One call; collective over the EP group. x: [num_tokens, hidden], float, on the
        layer's device (0 tokens allowed; at most ``max_tokens_per_rank`` per TP rank's chunk),
        the same on every TP rank of a DP group. Returns [num_tokens, hidden] in ``x.dtype``:
        the routed experts' weighted sum plus the shared expert, reduced over TP. An input this rank refuses leaves the layer
        usable and never lets a peer pair this call with another (:mod:`moe_plugins.faults`,
        rule "refused inputs"): through the backend's host exchange every rank raises at the same point; on a
        backend without one this rank takes part in the call with no tokens of its own (its
        experts still serve the peers' tokens), then raises. A call that fails on this rank
        after its first collective breaks the group: later calls raise naming that first failure
        until the layer is rebuilt on new groups."""
        if self._destroyed:
            raise RuntimeError(f"{self.name} was destroyed; build a new MoELayer to run it again")
        if self._survival is not None:
            return self._survival.call(self, self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self.faults.check(self.name)
        self._num_calls += 1
        watched = self._bound.watch(self._num_calls)
        if watched is None:
            return self._call(x)
        host_wait = self.pf is not None and self.pf.waits_on_host
        if host_wait:  # the backend's host waits run under this call's deadline
            bound_host_waits(watched)
        try:
            return self._call(x)
        finally:  # an error ends the watch too: it reached the caller
            if host_wait:
                bound_host_waits(None)
            watched.end(self.ctx.device)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        refusal = layer_input_error(self.name, x, self.cfg.hidden, self.ctx.device,
                                    self.ctx.layout.tp, self._capacity)
        if refusal is not None:
            self._refuse(refusal)
        try:
            topk_weights, topk_ids = route(x, self.router, self.cfg.num_topk, self.cfg.renormalize)
            if not self.placement.is_linear:
                topk_ids = self.placement.to_physical(topk_ids)
            if self.pf is None:
                return self._forward_no_dispatch(x, topk_weights, topk_ids)
            out = self._forward_dispatch(x, topk_weights, topk_ids)
            if self._masks_by_library is not None and not capturing():
                self._check_library_masks()
            return out
        except BaseException as e:
            if is_owed_call(e) and self.ctx.layout.tp == 1:
                # the backend refused this rank's tokens and its peers are in the call; with one
                # TP rank nothing follows the combine, so the call is completed without them
                self._serve_without_tokens(e)
            if not is_in_step(e):
                self.faults.mark_broken(f"{self.name} raised on this rank", e)
            if self.pf is not None:  # a peer's loss or hang under the library: say what it means
                wrapped = call_fault_error(self.faults, self.name, self.backend_spec.name,
                                           self.pf.library_timeout_s, self.ctx.timeout_s,
                                           self._num_calls, e)
                if wrapped is not None:
                    raise wrapped from e
            raise

    def _check_library_masks(self) -> None:
        """A backend whose library masks a peer on its own (a kernel timeout: NIXL EP, DeepEP
        with ``enable_shrink``) returns results without that peer's experts and no error: after
        each call (one host sync; not during a CUDA-graph capture) such a mask is an error.
        Under ``on_peer_loss`` it is a detection: the masked ranks are proposed as lost to the
        group, and the continuation ends the call with ``PeerLostError``."""
        assert self._masks_by_library is not None
        lost = self._masks_by_library()
        if lost and self._survival is not None and self._survival.library_masked(lost):
            return  # the group decided: the continuation ends this call with PeerLostError
        if lost:
            raise PeerMaskedError(
                f"{self.name}: the library masked EP rank(s) {lost} during this call (their "
                "kernels did not answer within the library's timeout), so its result lacks "
                "their experts and is not returned; this layer's EP group is broken (later "
                "calls raise LayerBrokenError). If a masked rank's process died, restart every "
                "rank of the EP group (under vLLM, the engine); if every rank lives (a slow "
                "peer), clean the buffers (layer.manager.clean_buffers()) on every rank and "
                "rebuild the layer on new process groups on every rank", tuple(lost))

    def _refuse(self, error: Exception) -> None:
        """This rank refuses the layer input: raise ``error`` in step with the peers. Every TP
        rank of a DP group holds the same input and refuses it alike, so without a dispatch
        (TP_UNIFIED, or one rank) no collective is skipped; with one, the backend's host exchange
        tells the peers, or this rank completes the call without tokens."""
        if self.pf is None:
            raise in_step(error)
        if self.pf.host_exchange:
            self.pf.refuse(error)
        self._serve_without_tokens(error)

    def _serve_without_tokens(self, error: BaseException) -> None:
        """Take part in the refused call with no tokens of this rank's own (the peers are in its
        dispatch and this rank's experts hold some of their tokens), then raise ``error``."""
        cfg, device = self.cfg, self.ctx.device
        try:
            self._forward_dispatch(torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=device),
                                   torch.empty(0, cfg.num_topk, dtype=torch.float32,
                                               device=device),
                                   torch.empty(0, cfg.num_topk, dtype=torch.int64, device=device))
        except BaseException as e:
            self.faults.mark_broken(f"{self.name}: the call refused on this rank could not be "
                                    "completed without its tokens", e)
            raise
        raise in_step(error)

    def _forward_no_dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor) -> torch.Tensor:
        """TP_UNIFIED (or a single rank): every rank runs its experts on all tokens."""
        handle = launch_shared(self.shared, x, self.overlap)
        local = local_expert_ids(topk_ids, self.placement,
                                 self.ctx.rank if self.ctx.layout.ep else 0)
        out = self.experts.apply(PrepareResult(x, None, None, local, topk_weights))
        shared = join(handle)
        if shared is not None:
            out += shared
        if self.strategy is ReductionStrategy.TP_UNIFIED:
            self._all_reduce(out)
        return out

    def _forward_dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
        assert self.pf is not None
        layout, n_tokens = self.ctx.layout, x.shape[0]
        rows = owned_rows(n_tokens, layout.tp, self.ctx.tp_rank)
        owned = slice_owned(rows, x, topk_ids, topk_weights)
        sp = self.strategy is ReductionStrategy.SP_ALLGATHER
        handle: Optional[SharedExpertHandle] = None
        try:
            if self.shared is None:
                # nothing to run between the send and the receive: the blocking prepare (on
                # the low-latency kernels one launch instead of two)
                prep = self.pf.prepare(owned.hidden_states, owned.topk_weights,
                                       owned.topk_ids, self.quant)
                handle = launch_shared(None, x, self.overlap)
            else:
                sent = self.pf.prepare_async(owned.hidden_states, owned.topk_weights,
                                             owned.topk_ids, self.quant)
                # Send issued, shared expert launched, then the receive hook (docs/design.md,
                # "Shared-expert overlap": hook order).
                handle = launch_shared(self.shared, owned.hidden_states if sp else x,
                                       self.overlap)
                if sent.hook is not None:
                    sent.hook()
                prep = sent.receiver()
                assert isinstance(prep, PrepareResult)
            expert_out = self.experts.apply(prep)
            if self.strategy is ReductionStrategy.ROW_SCATTER_ALLREDUCE:
                out = self.pf.finalize(expert_out, owned.topk_weights, owned.topk_ids,
                                       RowScatterTarget(handle, rows))
                return self._all_reduce(out)
            routed = self.pf.finalize(expert_out, owned.topk_weights, owned.topk_ids,
                                      x.new_empty(rows.num_owned, x.shape[1]))
            shared = join(handle)
            if self.strategy is ReductionStrategy.LOCAL:
                return routed if shared is None else routed + shared
            if sp:
                return self._all_gather_rows(routed if shared is None else routed + shared,
                                             n_tokens, rows.chunk)
            full = self._all_gather_rows(routed, n_tokens, rows.chunk)
            if shared is not None:
                full = full + self._all_reduce(shared)
            return full
        except BaseException as e:  # named before reset_call_state records the abandoned call
            if not (is_in_step(e) or is_owed_call(e)):
                self.faults.mark_broken(f"{self.name} raised on this rank", e)
            raise
        finally:
            if handle is not None:
                join(handle)
            self.pf.reset_call_state()

    __call__ = forward

    def destroy(self) -> None:
        """Release the backend's buffers; calling the layer afterwards raises."""
        self._destroyed = True
        if self.manager is not None:
            if getattr(self, "_survival", None) is not None:
                self._survival.close(self.manager)
            self.manager.destroy()
