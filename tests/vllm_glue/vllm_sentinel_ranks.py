"""Rank functions of test_vllm_sentinel: vLLM 0.34's fault-tolerance flow after an EP rank's
death, step by step as vLLM calls it, on one side our manager and adapter
(``moe_plugins_deepep_ll`` / ``moe_plugins_nixl_ep``), on the other vLLM's in-tree manager and
prepare/finalize (``deepep_low_latency`` / ``nixl_ep``), over the emulated libraries with the
store fabric (tests/emulation: puts and spin-waits that read the library's mask as each
begins, as the kernels do, so a rank that stopped and was masked before a step holds nobody in
it). Imported only by tests that skip without vLLM 0.34's sentinel.

The ranks are vLLM DP ranks (``data_parallel_size`` = EP size, one TP rank each), so the EP
group's communicator holds the all2all manager the sentinel reaches through
``get_ep_all2all_manager``. The layer is EPLB-placed: 8 logical experts in 16 physical slots,
2 replicas of each on different ranks (rank r holds logical 2r..2r+3 mod 8), in vLLM's own
``EplbModelState`` maps; vLLM's router maps logical ids to physical ones through those maps
(on CPU vLLM has no Triton kernel for it, so :func:`eplb_physical_ids` applies its rule here).

What is vLLM's own code: the modular kernel, the in-tree managers and prepare/finalize classes
(built with the arguments vLLM's ``maybe_make_prepare_finalize`` passes; ours as our factory
builds it), vLLM's ``EplbState``, ``WorkerSentinel.scale_down``
(``retry``: ``clean_buffers``, the survivors' DP group rebuilt over a recovery store,
``update_mask`` for each dead EP rank; then ``_redistribute_experts``: the dead slots marked,
EPLB's redundant experts kept, the maps committed). What stands in, and why:

- the experts: a torch batched-experts class that sizes its output as vLLM's batched experts
  do (max tokens x the prepare/finalize's dispatchers rows per local expert);
- the worker and its model runner (:class:`_Worker`): attribute holders for what the
  sentinel reads of them (the parallel config, the EPLB state, the request table); a MoE layer
  uses none of them;
- ``torch.accelerator.synchronize``: a no-op (a CPU rank has no accelerator, and torch raises
  there); the sentinel calls it to wait for the GPU, which the CPU kernels need not;
- the in-tree managers' mask tensors, which they allocate on ``"cuda"``: placed on the CPU by a
  torch function mode (:class:`_CudaOnCpu`) around the in-tree managers' calls;
- the in-tree manager is put in the EP communicator's slot here, as vLLM's CUDA communicator
  does (its CPU communicator serves only allgather_reducescatter);
- the engine side (the engine sentinel's request and its recovery store, which rank 0 hosts);
- the death: the dead rank stops after step 1 and the survivors' library masks it with its own
  mask call, as its timeout does; or (deepep_ll) it SIGKILLs itself inside step 2 and the
  survivors' library masks it at its kernel timeout (the emulated build's, 3 s).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from moe_plugins.config import MoEConfig
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.model import MoEWeights, route
from tests.backends.low_latency_ranks import vendor_module
from tests.emulation import installed
from tests.emulation._ll_fabric import FABRIC_ENV
from tests.runner.peer_loss_ranks import redundant_placement

CFG = MoEConfig(hidden=2048, num_experts=8, num_topk=2, intermediate=32, shared_intermediate=0,
                dtype=torch.bfloat16)
WORLD = 4
DEAD = 3
TOKENS = 6
MAX_TOKENS = 8  # the layer's max tokens per DP rank: NIXL EP's kernels take (ranks x it) % 4 == 0
KILL_TIMEOUT_S = 3.0  # the emulated DeepEP build's kernel timeout in the kill variant
REDUNDANT = 8  # physical slots beyond the logical experts: 16 slots, 4 per rank
IN_TREE = {"deepep_ll": "deepep_low_latency", "nixl_ep": "nixl_ep"}
#: vLLM's EPLB router hash (vllm/model_executor/layers/fused_moe/eplb_triton.py)
_KNUTH = 2654435769


def physical_to_logical() -> list[int]:
    """The EPLB placement of the test: rank r's 4 slots hold logical 2r, 2r+1, 2r+2, 2r+3
    (mod 8), so every logical expert has 2 replicas, on different ranks."""
    return list(redundant_placement(WORLD).physical_to_logical)


def eplb_physical_ids(logical: torch.Tensor, l2p: torch.Tensor, count: torch.Tensor
                      ) -> torch.Tensor:
    """vLLM's router on EPLB maps (``eplb_map_and_record``): logical id e of token t goes to
    replica ``((t * 2654435769) & 0xFFFFFFFF) % count[e]`` of ``l2p[e]``. logical int
    [num_tokens, num_topk]; l2p int [num_logical, max_replicas]; count int [num_logical]."""
    token = torch.arange(logical.shape[0], dtype=torch.int64)[:, None].expand_as(logical)
    replica = ((token * _KNUTH) & 0xFFFFFFFF) % count.long()[logical.long()]
    return l2p.long()[logical.long(), replica]


class _CudaOnCpu(TorchFunctionMode):
    """Tensors a caller asks for on ``"cuda"`` are made on the CPU (the in-tree managers' mask
    tensors; see the module doc)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _Worker:
    """What ``WorkerSentinel`` reads of its worker and model runner (see the module doc)."""

    def __init__(self, vllm_config: Any, eplb_state: Any, model_config: Any) -> None:
        from types import SimpleNamespace

        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.rank = 0  # within the DP rank's world of one worker: vLLM's dp_index is 0
        self.model_runner = SimpleNamespace(
            eplb_state=eplb_state, model_config=model_config, eep_eplb_suppressed=False,
            execute_model_state=None, req_states=SimpleNamespace(req_id_to_index={}),
            _remove_request=lambda req_id: None, model=None)


class _ModelConfig:
    """The key of the model's EPLB state (``hash_config_cached`` of the model config)."""

    def compile_factors(self) -> dict:
        return {"model": "moe-plugins sentinel test"}


def _eplb_state(parallel: Any, model_config: Any) -> tuple[Any, Any]:
    """vLLM's EplbState with one model of one MoE layer on the test's placement; the fields
    the fault-tolerance flow does not read (the model, its weight-transfer communicator) are
    None."""
    from vllm.config.utils import hash_config_cached
    from vllm.distributed.eplb.eplb_state import EplbModelState, EplbState, compute_logical_maps

    p2l = torch.tensor([physical_to_logical()], dtype=torch.int64)
    l2p, count = compute_logical_maps(p2l, CFG.num_experts)
    l2p_full = torch.full((1, CFG.num_experts, REDUNDANT + 1), -1, dtype=torch.int64)
    l2p_full[..., :l2p.shape[-1]] = l2p
    num_physical = p2l.shape[1]
    model = EplbModelState(
        physical_to_logical_map=p2l.clone(), physical_to_logical_map_buffer=p2l.clone(),
        logical_to_physical_map=l2p_full, logical_replica_count=count,
        expert_load_pass=torch.zeros(1, num_physical, dtype=torch.int32),
        expert_load_pass_buffer=torch.zeros(1, num_physical, dtype=torch.int32),
        expert_load_window=torch.zeros(1, 1, num_physical, dtype=torch.int32),
        last_expert_load=torch.zeros(1, CFG.num_experts), model_name="sentinel-test",
        model=None, expert_buffer=[], rebalanced=False, eplb_stats=None, device_index=None,
        communicator=None)
    state = EplbState(parallel, torch.device("cpu"))
    state.model_states[hash_config_cached(model_config)] = model
    return state, model


@contextlib.contextmanager
def _no_accelerator_sync() -> Iterator[None]:
    saved = torch.accelerator.synchronize
    torch.accelerator.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.synchronize = saved  # type: ignore[assignment]


@contextlib.contextmanager
def _store_fabric() -> Iterator[None]:
    saved = os.environ.get(FABRIC_ENV)
    os.environ[FABRIC_ENV] = "store"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(FABRIC_ENV, None)
        else:
            os.environ[FABRIC_ENV] = saved


def _reset_in_tree_state() -> None:
    """vLLM's in-tree LL managers keep their buffer and masks on the class (one per process):
    a pool process starts each run without an earlier run's."""
    from vllm.distributed.device_communicators.all2all import (DeepEPLLAll2AllManager,
                                                               NixlEPAll2AllManager)

    for cls in (DeepEPLLAll2AllManager, NixlEPAll2AllManager):
        cls._buffer = cls._mask = cls._last_mask = None


def _recovery_store(rank: int) -> tuple[Any, int]:
    """The recovery store the engine sentinel hosts (rank 0 here), its port sent to every
    rank while all are alive."""
    from torch.distributed import TCPStore

    store = None
    box: list[Any] = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        box = [port]
    dist.broadcast_object_list(box, src=0)
    return store, int(box[0])


def sentinel_flow(rank: int, world: int, backend: str, side: str, dead: int = DEAD,
                  kill: bool = False) -> dict:
    """See the module doc. ``side``: "ours" or "in_tree". Steps: 1 every rank; rank ``dead``
    stops and the survivors' library masks it, or (``kill``, deepep_ll) rank ``dead``
    SIGKILLs itself inside its experts of step 2 and the survivors' library masks it at its
    timeout (KILL_TIMEOUT_S, the build's); 2 the survivors (the faulted step); vLLM's polls;
    ``WorkerSentinel.scale_down`` removing DP rank ``dead``; 3 and 4 the survivors. Returns
    each step's output (or error), physical ids and seed, the polls and the EPLB maps after
    the scale-down."""
    assert world == WORLD
    name = "moe_plugins_" + backend if side == "ours" else IN_TREE[backend]
    from tests.runner.watchdog_ranks import deepep_build
    from tests.vllm_glue.vllm_dist import vllm_parallel_state

    build = deepep_build(KILL_TIMEOUT_S) if kill else None
    with _store_fabric(), installed(vendor_module(backend), deep_ep_build=build), \
            vllm_parallel_state(
            0, 1, 1, name, data_parallel_size=world, data_parallel_rank=rank,
            enable_fault_tolerance=True) as config:
        from vllm.distributed import get_dp_group

        _reset_in_tree_state()
        dp_group = get_dp_group().cpu_group
        try:
            return _flow(rank, backend, side, config, dead, kill)
        finally:
            _reset_in_tree_state()
            _restore_dp_group(dp_group)


def _restore_dp_group(original: Any) -> None:
    """The sentinel's retry shut the DP group's gloo group down and put a group of the survivors
    in its place, which vLLM's own teardown (torch's destroy) does not know: it is shut down
    here, and the original destroyed, so that vLLM's teardown finds nothing of either."""
    from vllm.distributed import get_dp_group
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    group = get_dp_group()
    if group.cpu_group is original:
        return
    stateless_destroy_torch_distributed_process_group(group.cpu_group)
    del group.cpu_group
    with contextlib.suppress(Exception):  # (already shut down by the retry)
        dist.destroy_process_group(original)


class _Layer:
    """One EPLB-placed MoE layer of this rank through vLLM's modular kernel: ours (our adapter
    on our manager) or vLLM's in-tree manager and prepare/finalize, and vLLM's EPLB state."""

    def __init__(self, rank: int, backend: str, side: str, config: Any) -> None:
        from vllm.distributed import get_ep_group
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager
        from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                                 FusedMoEParallelConfig,
                                                                 FusedMoEQuantConfig,
                                                                 RoutingMethodType)
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk

        from tests.vllm_glue.vllm_modular_kernel_ranks import (TorchBatchedExpertsModular,
                                                               contiguous_expert_map)

        parallel = config.parallel_config
        # EPLB with redundant experts, as `--enable-eplb --eplb-config
        # '{"num_redundant_experts": 8}'` sets it (vLLM's config refuses EPLB on a CPU
        # platform, so it is set after validation)
        parallel.eplb_config.num_redundant_experts = REDUNDANT
        self.rank, self.side = rank, side
        self.mode = _CudaOnCpu() if side == "in_tree" else contextlib.nullcontext()
        if side == "in_tree":  # what vLLM's CUDA communicator builds for the in-tree name
            from vllm.distributed.device_communicators import all2all

            ep = get_ep_group()
            cls = (all2all.DeepEPLLAll2AllManager if backend == "deepep_ll"
                   else all2all.NixlEPAll2AllManager)
            ep.device_communicator.all2all_manager = cls(ep.cpu_group)
        self.manager = get_ep_all2all_manager()
        self.num_physical = CFG.num_experts + REDUNDANT
        moe = FusedMoEConfig(
            num_experts=self.num_physical, experts_per_token=CFG.num_topk, hidden_dim=CFG.hidden,
            intermediate_size=CFG.intermediate, num_local_experts=self.num_physical // WORLD,
            num_logical_experts=CFG.num_experts, activation=MoEActivation.SILU, device="cpu",
            routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=FusedMoEParallelConfig.make(
                tp_size_=1, pcp_size_=1, dp_size_=WORLD, sp_size_=1,
                vllm_parallel_config=parallel),
            in_dtype=CFG.dtype, max_num_tokens=MAX_TOKENS)
        qc = FusedMoEQuantConfig.make()
        with self.mode:
            self.pf = (_ours(self.manager, backend, moe) if side == "ours"
                       else _in_tree(self.manager, backend, moe))
        self.experts = TorchBatchedExpertsModular(
            moe, qc, max_num_tokens=self.pf.max_num_tokens_per_rank(),
            num_dispatchers=self.pf.num_dispatchers())
        self.kernel = mk.FusedMoEKernel(self.pf, self.experts)
        self.activation = MoEActivation.SILU
        self.weights = MoEWeights.random(CFG, 0)
        per = self.num_physical // WORLD
        mine = torch.tensor(physical_to_logical()[rank * per:(rank + 1) * per])
        self.w13 = self.weights.w13[mine].contiguous()
        self.w2 = self.weights.w2[mine].contiguous()
        self.expert_map = contiguous_expert_map(self.num_physical, WORLD, rank)
        self.model_config = _ModelConfig()
        self.eplb_state, self.eplb_model = _eplb_state(parallel, self.model_config)

    def step(self, seed: int) -> dict:
        """One forward of this rank's tokens of ``seed``, routed through vLLM's EPLB maps:
        its output, or the error it raised (vLLM's busy loop hands that to the sentinel)."""
        x = demo_inputs(CFG, TOKENS, self.rank, seed)
        topk_w, logical = route(x, self.weights.router, CFG.num_topk, CFG.renormalize)
        ids = eplb_physical_ids(logical, self.eplb_model.logical_to_physical_map[0],
                                self.eplb_model.logical_replica_count[0])
        try:
            with self.mode:
                out = self.kernel.apply(
                    hidden_states=x, w1=self.w13, w2=self.w2, topk_weights=topk_w,
                    topk_ids=ids.to(self.pf.topk_indices_dtype() or torch.int32),
                    activation=self.activation, global_num_experts=self.num_physical,
                    expert_map=self.expert_map, apply_router_weight_on_input=False)
        except Exception as e:
            return dict(seed=seed, ids=ids, error=(type(e).__name__, str(e).splitlines()[0]))
        return dict(seed=seed, out=out, ids=ids)

    def polls(self) -> dict:
        """vLLM's model runner polls query_fault after each step; on a fault get_output raises
        with query_active_mask, and the engine sentinel asks every worker for the mask
        (WorkerSentinel.query_mask, on a CUDA side stream: here what it wraps)."""
        with self.mode:
            return dict(fault=bool(self.manager.query_fault()),
                        mask=self.manager.query_active_mask().tolist())

    def die_in_step(self, seed: int) -> None:
        """SIGKILL this process inside its experts of the step: its dispatch received, its
        combine never sent."""
        apply = self.experts.apply

        def dying(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)
            return apply(*args, **kwargs)

        self.experts.apply = dying  # type: ignore[method-assign]
        self.step(seed)

    def mask_in_library(self, backend: str, dead: int) -> None:
        """What the library's timeout does to a peer that stopped: its own mask call, on the
        buffer the layer runs on."""
        lib = self.pf.backend.manager.buffer if self.side == "ours" else self.pf.buffer
        if backend == "deepep_ll":
            lib.low_latency_update_mask_buffer(dead, True)
        else:
            lib.update_mask_buffer(dead, mask=True)


def _flow(rank: int, backend: str, side: str, config: Any, dead: int, kill: bool) -> dict:
    from vllm.distributed import get_dp_group
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest
    from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel

    layer = _Layer(rank, backend, side, config)
    store, port = _recovery_store(rank)
    steps = [layer.step(1)]
    first_polls = layer.polls()
    if rank == dead:
        if kill:
            layer.die_in_step(2)
        return dict(steps=steps, polls=[first_polls])
    if not kill:
        layer.mask_in_library(backend, dead)
    started = time.monotonic()
    steps.append(layer.step(2))
    steps[-1]["seconds"] = time.monotonic() - started
    fault_polls = layer.polls()
    alive = [r for r in range(WORLD) if r != dead]  # the engine sentinel's dense DP ranks
    request = FaultToleranceRequest(instruction="scale_down", params=dict(
        removed_dp_ranks=[dead], dead_dp_ranks=[dead], dp_master_ip="127.0.0.1",
        dp_group_rank=alive.index(rank), dp_group_size=len(alive),
        recovery_round="sentinel-test", recovery_store_port=port))
    worker = _Worker(config, layer.eplb_state, layer.model_config)
    with _no_accelerator_sync(), layer.mode:
        WorkerSentinel(worker).handle_command(request)
    after_polls = layer.polls()
    steps += [layer.step(3), layer.step(4)]
    eplb = layer.eplb_model
    return dict(steps=steps, polls=[first_polls, fault_polls, after_polls],
                p2l=eplb.physical_to_logical_map[0].tolist(),
                l2p=eplb.logical_to_physical_map[0].tolist(),
                count=eplb.logical_replica_count[0].tolist(),
                suppressed=worker.model_runner.eep_eplb_suppressed,
                dead_dp_ranks=sorted(get_dp_group().dead_dp_ranks), hosted=store is not None)


def _ours(manager: Any, backend: str, moe: Any) -> Any:
    """Our adapter on our manager in vLLM's slot, built as our factory builds it once the layer
    is planned (the plan refuses a GPU backend on a CPU rank; the emulated library runs here):
    the manager's engine options (``enable_shrink`` under fault tolerance), one TP rank per DP
    rank (LOCAL)."""
    from moe_plugins.config import DispatchConfig
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.overlap import OverlapConfig
    from moe_plugins.quant import QuantScheme
    from moe_plugins.registry import get_backend
    from moe_plugins.strategy import ReductionStrategy, StrategyChoice
    from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize

    ctx = manager.dist_context(ParallelLayout(WORLD, 1, True), "cpu")
    backend_pf = manager.build(get_backend(backend), ctx, DispatchConfig(
        moe.num_experts, moe.hidden_dim, moe.experts_per_token, moe.max_num_tokens, moe.in_dtype))
    return MoEPluginsPrepareAndFinalize(backend_pf, backend, ctx,
                                        StrategyChoice(ReductionStrategy.LOCAL, "test"),
                                        OverlapConfig(overlap=False), moe.num_experts,
                                        QuantScheme.NONE)


def _in_tree(manager: Any, backend: str, moe: Any) -> Any:
    """vLLM's in-tree prepare/finalize on its manager's handle, with the arguments its
    ``maybe_make_prepare_finalize`` passes (which names the class only where the library was
    importable when vLLM loaded; the emulated one is installed later)."""
    if backend == "deepep_ll":
        from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
            DeepEPLLPrepareAndFinalize)

        handle = manager.get_handle(dict(
            max_num_tokens_per_dp_rank=moe.max_num_tokens, token_hidden_size=moe.hidden_dim,
            num_ep_ranks=manager.world_size, num_global_experts=moe.num_experts,
            num_local_experts=moe.num_experts // manager.world_size))
        return DeepEPLLPrepareAndFinalize(handle, max_tokens_per_rank=moe.max_num_tokens,
                                          num_dispatchers=manager.world_size,
                                          use_fp8_dispatch=False)
    from vllm.model_executor.layers.fused_moe.prepare_finalize.nixl_ep import (
        NixlEPPrepareAndFinalize)

    handle = manager.get_handle(dict(max_num_tokens_per_dp_rank=moe.max_num_tokens,
                                     token_hidden_size=moe.hidden_dim,
                                     num_local_experts=moe.num_local_experts))
    return NixlEPPrepareAndFinalize(
        handle, max_tokens_per_rank=moe.max_num_tokens, num_dispatchers=manager.max_num_ep_ranks,
        expert_capacity=moe.num_local_experts * manager.max_num_ep_ranks, use_fp8_dispatch=False)
