"""vLLM 0.33's modular MoE kernel on one GPU, over DeepEP V1 low-latency, with vLLM's IN-TREE
prepare/finalize class or OURS (the plugin, loaded as ``vllm serve`` loads it): the harness that
tests/gpu/test_vllm_cuda.py and benchmarks/vllm_layer.py share.

What is vLLM's here and what is not:
- vLLM's: its config and distributed state (``init_distributed_environment`` /
  ``initialize_model_parallel``, world size 1, EP on), its modular kernel ``FusedMoEKernel``
  (prepare -> experts -> finalize, async hooks), its ``SharedExperts`` (the shared expert runs
  inside the kernel between the combine send and its receive hook when the prepare/finalize
  ``supports_async()``), ``maybe_make_prepare_finalize`` (patched by our plugin for our names),
  and its in-tree ``DeepEPLLPrepareAndFinalize``.
- Not vLLM's: the routing (softmax top-k in torch) and the batched experts (SwiGLU in torch,
  :class:`MaskedBatchedExperts`). vLLM's own router and Triton experts call compiled ops
  (``topk_softmax``, ``silu_and_mul``) that live in its extension, absent where vLLM's Python
  runs without it (benchmarks/vllm_stand_ins.py). They are the same code on both sides, so the
  comparison is of the prepare/finalize classes over the same DeepEP kernels.
- One ``deep_ep.Buffer`` serves both sides (the one our manager builds): NVSHMEM is set up once
  per process, and the in-tree class is given that buffer exactly as vLLM's all2all manager
  would give it its own (same low-latency mode, one QP per local expert, NVLink allowed).

With one rank vLLM itself would not dispatch (``use_all2all_kernels`` needs dp > 1); the in-tree
class is built here as ``maybe_make_prepare_finalize`` builds it for dp > 1, and ours through
``maybe_make_prepare_finalize`` itself (our plugin's hook serves our names on any EP size).
"""
from __future__ import annotations

import contextlib
import datetime
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "benchmarks"))
import vllm_stand_ins  # noqa: E402

vllm_stand_ins.install()

import torch.distributed as dist  # noqa: E402

__all__ = ["LayerSpec", "VllmLayers", "vllm_layers", "MaskedBatchedExperts",
           "route_softmax_topk", "IN_TREE", "OURS"]

IN_TREE, OURS = "deepep_low_latency", "moe_plugins_deepep_ll"


@dataclass(frozen=True)
class LayerSpec:
    """One rank of an EP-8 DeepSeek-V3 layer by default: 32 local experts of intermediate
    2048, top-8, hidden 7168, a shared expert of intermediate 2048; bf16 activations."""

    hidden: int = 7168
    num_experts: int = 32
    topk: int = 8
    intermediate: int = 2048
    shared_intermediate: int = 2048
    max_tokens: int = 128
    fp8: bool = False
    seed: int = 0


def route_softmax_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits float [num_tokens, num_experts] -> (weights float32, ids int64) [num_tokens, topk],
    softmax then top-k, renormalized (DeepSeek/Qwen3 style)."""
    w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), topk, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), ids


def _experts_base() -> type:
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate)

    from moe_plugins.lowlat.limits import dequantize_batched

    class MaskedBatchedExperts(mk.FusedMoEExpertsModular):
        """Batched-format SwiGLU experts in torch (bf16 bmm), capture-safe: every slot of every
        local expert is computed and slots past ``expert_num_tokens[e]`` are zeroed by a mask,
        so no count is read on the host. Unweighted outputs; the combine applies the router
        weights (TopKWeightAndReduceDelegate), as vLLM's BatchedTritonExperts. ``ue8m0``: ask
        for packed UE8M0 scales (as DeepGEMM does on Blackwell). ``record``: keep what the
        prepare handed over (x, x_sf, counts) of the last call."""

        ue8m0 = False
        record = False
        last: Optional[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]] = None

        @staticmethod
        def activation_format() -> mk.FusedMoEActivationFormat:
            return mk.FusedMoEActivationFormat.BatchedExperts

        @staticmethod
        def _supports_current_device() -> bool:
            return True

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
            return True

        @staticmethod
        def _supports_activation(activation: MoEActivation) -> bool:
            return activation == MoEActivation.SILU

        @staticmethod
        def _supports_parallel_config(moe_parallel_config: Any) -> bool:
            return True

        def supports_packed_ue8m0_act_scales(self) -> bool:
            return self.ue8m0

        def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                             local_num_experts: int, expert_tokens_meta: Any,
                             activation: MoEActivation) -> tuple[tuple[int, ...], ...]:
            assert self.max_num_tokens is not None and self.num_dispatchers is not None
            return (0,), (0,), (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)

        def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
            return TopKWeightAndReduceDelegate()

        def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: MoEActivation, global_num_experts: int,
                  expert_map: Optional[torch.Tensor], a1q_scale: Optional[torch.Tensor],
                  a2_scale: Optional[torch.Tensor], workspace13: torch.Tensor,
                  workspace2: torch.Tensor, expert_tokens_meta: Any,
                  apply_router_weight_on_input: bool) -> None:
            counts = expert_tokens_meta.expert_num_tokens
            if self.record:
                self.last = (hidden_states.clone(),
                             None if a1q_scale is None else a1q_scale.clone(), counts.clone())
            # bf16 rows as they came; quantized rows dequantized by the one helper, in bf16
            x = hidden_states if a1q_scale is None else \
                dequantize_batched(hidden_states, a1q_scale).bfloat16()
            gate_up = torch.bmm(x, w1.transpose(1, 2))
            g, u = gate_up.chunk(2, dim=-1)
            y = torch.bmm(F.silu(g) * u, w2.transpose(1, 2))
            slots = torch.arange(y.shape[1], device=y.device)
            mask = slots[None, :] < counts[:, None]
            output.copy_(y * mask[..., None].to(y.dtype))

    return MaskedBatchedExperts


def __getattr__(name: str) -> Any:
    if name == "MaskedBatchedExperts":  # built on first use: needs vLLM imported
        return _experts_base()
    raise AttributeError(name)


class SharedMLP(torch.nn.Module):
    """DeepSeek/Qwen-style shared expert: SwiGLU MLP [hidden -> 2 x inter -> hidden], bf16."""

    def __init__(self, hidden: int, inter: int, gen: torch.Generator, device: torch.device):
        super().__init__()
        self.w13 = (torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5).to(
            device, torch.bfloat16)
        self.w2 = (torch.randn(hidden, inter, generator=gen) / inter ** 0.5).to(
            device, torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = (x @ self.w13.t()).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.w2.t()


@dataclass
class Built:
    """One side (in-tree or ours): vLLM's kernel over the prepare/finalize, and its shared
    experts wrapper."""

    name: str
    kernel: Any
    experts: Any
    shared: Any

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, num_experts: int) -> torch.Tensor:
        """One MoE layer: vLLM's kernel (shared expert inside it when it overlaps) + shared."""
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

        routed = self.kernel.apply(hidden_states=x, w1=w13, w2=w2, topk_weights=topk_weights,
                                   topk_ids=topk_ids, activation=MoEActivation.SILU,
                                   global_num_experts=num_experts, expert_map=None,
                                   apply_router_weight_on_input=False, shared_experts=self.shared,
                                   shared_experts_input=x)
        # Not overlapped inside the kernel: vLLM's runner calls it before the kernel.
        self.shared(x, SharedExpertsOrder.NO_OVERLAP)
        return routed + self.shared.output


class VllmLayers:
    """Both sides over one EP group of one rank, one DeepEP buffer, same weights. ``dbo``: built
    under a config with vLLM's dual-batch overlap on (our side then has one call slot per
    micro-batch; the shared experts keep one output per micro-batch, as vLLM builds them)."""

    def __init__(self, spec: LayerSpec, device: torch.device, dbo: bool = False):
        self.spec, self.device, self.dbo = spec, device, dbo
        gen = torch.Generator().manual_seed(spec.seed)
        h, e, i = spec.hidden, spec.num_experts, spec.intermediate
        self.w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(device, torch.bfloat16)
        self.w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(device, torch.bfloat16)
        self.router = torch.randn(e, h, generator=gen).to(device, torch.float32) / h ** 0.5
        self.shared_mlp = SharedMLP(h, spec.shared_intermediate, gen, device)
        self.ours = self._build(OURS)
        self.in_tree = self._build(IN_TREE)

    def moe_config(self, all2all_backend: str) -> Any:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                                 FusedMoEParallelConfig,
                                                                 RoutingMethodType)

        parallel = FusedMoEParallelConfig(
            tp_size=1, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=1, dp_rank=0, ep_size=1,
            ep_rank=0, sp_size=1, use_ep=True, all2all_backend=all2all_backend, enable_eplb=False)
        s = self.spec
        return FusedMoEConfig(
            num_experts=s.num_experts, experts_per_token=s.topk, hidden_dim=s.hidden,
            intermediate_size=s.intermediate, num_local_experts=s.num_experts,
            num_logical_experts=s.num_experts, activation=MoEActivation.SILU, device=self.device,
            routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
            in_dtype=torch.bfloat16, max_num_tokens=s.max_tokens)

    def quant_config(self) -> Any:
        from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

        if not self.spec.fp8:
            return FusedMoEQuantConfig.make()
        return FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])

    def _build(self, name: str, ue8m0: bool = False) -> Built:
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe import all2all_utils
        from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

        moe = self.moe_config(name)
        qc = self.quant_config()
        if name == OURS:
            # exactly the call vLLM's layer makes (our plugin's hook answers for our names)
            pf = all2all_utils.maybe_make_prepare_finalize(moe, qc)
            assert pf is not None, "our plugin's hook did not build a prepare/finalize"
        else:
            from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
                DEEPEP_QUANT_BLOCK_SHAPE, DeepEPLLPrepareAndFinalize)

            ours = self.ours.kernel.prepare_finalize.backend  # our DeepEP LL backend
            # As all2all_utils.maybe_make_prepare_finalize builds it for deepep_low_latency
            # (dp > 1), on the same buffer and token capacity as ours.
            pf = DeepEPLLPrepareAndFinalize(
                ours.manager.buffer, max_tokens_per_rank=ours.manager.max_tokens_per_rank,
                num_dispatchers=1,
                use_fp8_dispatch=(qc.quant_dtype == torch.float8_e4m3fn
                                  and qc.block_shape == DEEPEP_QUANT_BLOCK_SHAPE))
        experts_cls = _experts_base()
        experts = experts_cls(moe, qc, max_num_tokens=pf.max_num_tokens_per_rank(),
                              num_dispatchers=pf.num_dispatchers())
        experts.ue8m0 = ue8m0
        kernel = mk.FusedMoEKernel(pf, experts)
        shared = SharedExperts(self.shared_mlp, moe, enable_dbo=self.dbo,
                               mk_can_overlap_shared_experts=lambda: kernel.can_overlap_shared_experts)
        return Built(name, kernel, experts, shared)

    def build_ue8m0_pair(self) -> tuple[Built, Built]:
        """(ours, in-tree) with experts that ask for packed UE8M0 scales (FP8 layers only)."""
        return self._build(OURS, ue8m0=True), self._build(IN_TREE, ue8m0=True)

    def inputs(self, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x bf16 [num_tokens, hidden], topk_weights float32, topk_ids int64 [num_tokens, topk])."""
        gen = torch.Generator().manual_seed(1000 + seed)
        x = torch.randn(num_tokens, self.spec.hidden, generator=gen).to(self.device,
                                                                          torch.bfloat16)
        w, ids = route_softmax_topk(x.float() @ self.router.t(), self.spec.topk)
        return x, w, ids

    def forward(self, side: Built, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        return side.forward(x, w, ids, self.w13, self.w2, self.spec.num_experts)

    def reference(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float32 per-token loop: shared + sum_k w_k expert_k(x) (bf16 weights upcast)."""
        out = self.shared_mlp(x).float()
        xf = x.float()
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                g, u = (xf[t] @ self.w13[e].float().t()).chunk(2)
                out[t] += float(w[t, k]) * ((F.silu(g) * u) @ self.w2[e].float().t())
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_layers(spec: LayerSpec, dbo: bool = False) -> Iterator[VllmLayers]:
    """vLLM's distributed state for one CUDA rank (EP on, our plugin loaded as vLLM loads it,
    ``--enable-dbo`` when ``dbo``), then both sides built; everything torn down on exit."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.plugins import load_general_plugins

    from moe_plugins.lowlat.vendor import destroy_all_buffers
    from moe_plugins.vllm.worker_env import set_worker_dist_env

    load_general_plugins()
    torch.cuda.set_device(0)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=init_method, rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120))
    config = VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True,
                                                       all2all_backend=OURS, enable_dbo=dbo))
    set_worker_dist_env(init_method)  # what vLLM's worker sets before its groups (CUDA: none)
    with set_current_vllm_config(config):
        ps.init_distributed_environment(1, 0, distributed_init_method=init_method,
                                        local_rank=0, backend="nccl")
        ps.initialize_model_parallel(1)
        from vllm.v1.worker import workspace

        # One workspace slot per micro-batch, as vLLM's GPU model runner sets it up (with
        # --enable-dbo two micro-batches run the experts with their own workspaces).
        workspace.init_workspace_manager(torch.device("cuda", 0),
                                         num_ubatches=config.parallel_config.num_ubatches
                                         if dbo else None)
        try:
            yield VllmLayers(spec, torch.device("cuda", 0), dbo)
        finally:
            destroy_all_buffers()
            ps.destroy_model_parallel()
