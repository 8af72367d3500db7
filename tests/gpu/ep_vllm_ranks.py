"""Rank functions of the one-GPU EP matrix, vLLM path: vLLM's own modular MoE kernel
(``FusedMoEKernel`` with vLLM's ``SharedExperts``) at EP 2 and 4 with vLLM's distributed state
for N ranks on one device, our prepare/finalize (``moe_plugins_deepep_ll``,
``moe_plugins_deepep_ht``, ``moe_plugins_nixl_ep``, built by vLLM's
``maybe_make_prepare_finalize``, i.e. our plugin's hook) beside vLLM's in-tree class
(``DeepEPLLPrepareAndFinalize``, ``DeepEPHTPrepareAndFinalize``, ``NixlEPPrepareAndFinalize``) on
the same library buffer, the same inputs and the same experts; ``moe_plugins_flashinfer_nvlink_
one_sided`` beside vLLM's own one-sided manager and class (each its workspace: ep_vllm_one_sided).

vLLM's state (``tests/vllm_glue/vllm_dist.vllm_parallel_state``: ``init_distributed_environment``
reusing the harness's gloo world, ``initialize_model_parallel``, our plugin loaded as vLLM loads
it) over ``dp = ep / tp`` DP ranks of ``tp`` TP ranks. What differs from a real deployment, and
why (NCCL refuses two ranks on one device):

- every vLLM group's device group is a gloo group (``backend="gloo"``), not NCCL; vLLM's CUDA
  communicator is built as usual, with ``VLLM_DISABLE_PYNCCL=1`` (vLLM's switch: its NCCL
  wrapper is then off and its all-reduce / all-gather fall back to torch.distributed on the
  device group, as vLLM does without PyNccl), its custom all-reduce off
  (``set_custom_all_reduce(False)``, what ``--disable-custom-all-reduce`` sets) and its
  symmetric-memory all-reduce off (``VLLM_ALLREDUCE_USE_SYMM_MEM=0``): those need one process
  per GPU. vLLM's ``reduce_scatter`` needs PyNccl, so the SP case reduces attention as
  Qwen3-MoE does (all_reduce, then vLLM's ``sequence_parallel_chunk_impl``), not as DeepSeek-V2
  (reduce_scatter); both orders are run on CPU by tests/vllm_glue/test_vllm_sequence_parallel.py.
- vLLM's config refuses a TP world larger than the node's GPUs: while it is built, the CUDA
  platform's device count answers the number of ranks (:func:`_ranks_as_gpus`).
- all ranks are ``local_rank`` 0 (one device); vLLM's CUDA platform, stand-ins for its compiled
  extension (benchmarks/vllm_stand_ins.py), routing and experts in torch (as
  benchmarks/vllm_cuda_layer.py: vLLM's ``topk_softmax`` / ``silu_and_mul`` live in the
  extension), the same experts for both sides.
- the in-tree class is given our manager's library buffer, as vLLM's all2all manager would give
  it its own (the same sizes); one buffer per process (NVSHMEM / NIXL agents once).

Rows (``case``): ``ours=in-tree`` (bf16; FP8 block-128 for the low-latency backends: the kernel
quantizes on both sides): ragged tokens per rank, ours EQUAL to in-tree bit for bit (same library
kernels on the same buffer, same inputs and experts, same call order), both within tolerance of
the reference; ``dbo`` (low-latency backends): two micro-batches on vLLM's own ubatch contexts
equal the same two run one after the other, ours and in-tree, and ours equals in-tree; ``graph``
(EP 2): a CUDA graph of the whole kernel captured on every rank and replayed on new inputs
equals eager, ours and in-tree (CPU: refused, no CUDA graphs); ``sp`` (dp 2 x tp 2): vLLM's SP
steps around the kernel, ours equal to in-tree and to the reference.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from tests.gpu import ep_vllm_one_sided as one_sided
from tests.gpu.cuda_graphs import capture
from tests.gpu.ep_harness import rank_device, result, step
from tests.gpu.ep_ranks import CFG, MAX_TOKENS, RAGGED, compare, vendor

__all__ = ["vllm_job", "matrix_jobs", "OURS", "IN_TREE"]

OURS = {"deepep_ll": "moe_plugins_deepep_ll", "deepep_ht": "moe_plugins_deepep_ht",
        "nixl_ep": "moe_plugins_nixl_ep", one_sided.NAME: one_sided.OURS_NAME}
IN_TREE = {"deepep_ll": "DeepEPLLPrepareAndFinalize", "deepep_ht": "DeepEPHTPrepareAndFinalize",
           "nixl_ep": "NixlEPPrepareAndFinalize", one_sided.NAME: one_sided.IN_TREE_NAME}
BATCHED = ("deepep_ll", "nixl_ep")
#: DBO splits each rank's tokens in two micro-batches: at least 2 tokens per rank
DBO_TOKENS = (9, 64, 2, 33, 17, 50, 4, 19)
GRAPH_TOKENS = 16
_ROOT = Path(__file__).resolve().parents[2]


def _cases(backend: str, ep: int) -> list[tuple[str, str]]:
    cases = [("ours=in-tree", "bf16")]
    if backend in BATCHED:
        cases += [("ours=in-tree", "fp8_block128"), ("dbo", "bf16")]
        if ep == 2:
            cases.append(("graph", "bf16"))
    return cases


def matrix_jobs(job_cls: Any, half: str, device: str, scale: str) -> list[Any]:
    """The vLLM-path jobs of tests/gpu/ep_matrix.py: one world per (EP size, TP) running the
    three backends in turn on one vLLM state (DeepEP's low-latency, then normal mode, then NIXL
    EP: rows already reported stay if a later library fails in the same process)."""
    def job(name: str, ep: int, tp: int, plan: list, bound: float) -> Any:
        rows = tuple((b, c, q, tp) for b, cases in plan for c, q in cases)
        return job_cls(name, half, "vllm", "+".join(b for b, _ in plan), ep, vllm_job,
                       (device, tp, plan), bound, rows)

    # flashinfer's one-sided class in a world of its own (its library beside vLLM's kit)
    fo = [(one_sided.NAME, [("ours=in-tree", "bf16")])]
    if scale == "reduced":  # the normal suite's CPU run: one small world (two from vLLM 0.33)
        return [job("vllm/ep2", 2, 1, [("deepep_ll", [("ours=in-tree", "bf16"), ("dbo", "bf16")])],
                    120.0)] + ([job("vllm/flashinfer_one_sided/ep2", 2, 1, fo, 120.0)]
                               if one_sided.in_tree_runs_here() else [])
    order = ("deepep_ll", "deepep_ht", "nixl_ep")
    return [job("vllm/ep2", 2, 1, [(b, _cases(b, 2)) for b in order], 360.0),
            job("vllm/ep4", 4, 1, [(b, _cases(b, 4)) for b in order], 420.0),
            job("vllm/ep4-sp", 4, 2, [(b, [("sp", "bf16")]) for b in order], 360.0),
            job("vllm/flashinfer_one_sided/ep2", 2, 1, fo, 240.0),
            job("vllm/flashinfer_one_sided/ep4", 4, 1, fo, 300.0)]


@contextlib.contextmanager
def _emulated_gpu_backends(device: str) -> Iterator[None]:
    """On CPU the emulated libraries stand in for the GPU ones: for the block, the registry's
    "needs a CUDA GPU" check of our GPU backends is lifted in this rank process, so vLLM's layer
    plan (which asks whether a backend is usable here) selects them as on a GPU machine."""
    if not device.startswith("cpu"):
        yield
        return
    import dataclasses

    from moe_plugins import registry

    specs = registry._registry()
    saved = {n: s for n, s in specs.items() if s.needs_cuda}
    for n, s in saved.items():
        specs[n] = dataclasses.replace(s, needs_cuda=False)
    try:
        yield
    finally:
        specs.update(saved)


# -- vLLM's state ---------------------------------------------------------------------------------
def _import_vllm(device: str) -> None:
    """On a GPU machine without vLLM's compiled extension, its stand-ins first."""
    if device.startswith("cuda"):
        if str(_ROOT / "benchmarks") not in sys.path:
            sys.path.insert(0, str(_ROOT / "benchmarks"))
        import vllm_stand_ins

        vllm_stand_ins.install()
    import vllm  # noqa: F401


@contextlib.contextmanager
def vllm_state(rank: int, world: int, tp: int, backend: str, device: str,
               dbo: bool) -> Iterator[Any]:
    """vLLM's config and groups for this rank (see the module doc); yields the VllmConfig.
    ``backend``: the ``--all2all-backend`` the config names (layers of our other names are built
    on the same state, see :class:`Sides`)."""
    from vllm.distributed import parallel_state as ps

    from tests.vllm_glue.vllm_dist import vllm_parallel_state

    dev = rank_device(device)
    if dev.type == "cuda":
        ps.set_custom_all_reduce(False)  # one device: no CUDA-IPC all-reduce between ranks
    dp = world // tp
    with contextlib.ExitStack() as stack:
        with _ranks_as_gpus(world):  # only while vLLM builds and checks its config
            config = stack.enter_context(vllm_parallel_state(
                rank % tp, tp, tp, OURS[backend], backend="gloo", data_parallel_size=dp,
                data_parallel_rank=rank // tp, enable_dbo=dbo,
                local_rank=0 if dev.type == "cuda" else None))
        from vllm.v1.worker import workspace

        if dbo and not config.parallel_config.enable_dbo and dev.type == "cpu":
            # vLLM's CPU platform turns DBO off while building the config (it has no CUDA
            # streams); set after construction, as a GPU config keeps it
            config.parallel_config.enable_dbo = True

        workspace.init_workspace_manager(dev, num_ubatches=2 if dbo else None)
        yield config


@contextlib.contextmanager
def _ranks_as_gpus(world: int) -> Iterator[None]:
    """vLLM's ParallelConfig refuses a TP x PP world larger than the node's GPUs ("World size
    ... is larger than the number of available GPUs"); here ``world`` ranks share one GPU on
    purpose, so while the config is built the CUDA platform's device count answers at least
    ``world``. Platforms without that check (CPU) are left alone."""
    from vllm.platforms import current_platform

    cls = type(current_platform)  # e.g. NvmlCudaPlatform; device_count is CudaPlatformBase's
    if not any("device_count" in k.__dict__ for k in cls.__mro__):
        yield
        return
    real = int(current_platform.device_count())
    own = cls.__dict__.get("device_count")
    cls.device_count = classmethod(lambda c: max(world, real))  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is not None:
            cls.device_count = own  # type: ignore[method-assign]
        else:
            del cls.device_count


# -- experts ---------------------------------------------------------------------------------------
def _torch_experts() -> type:
    """The standard-format torch experts of the CPU vLLM tests (on the tokens' device, no host
    sync, so a CUDA graph can capture them), imported here: vLLM is imported on the ranks."""
    from tests.vllm_glue.vllm_modular_kernel_ranks import TorchExpertsModular

    return TorchExpertsModular


class _SharedMLP(torch.nn.Module):
    def __init__(self, shared: Any):
        super().__init__()
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)


class Side:
    """One side (ours or in-tree): vLLM's kernel over the prepare/finalize, its experts, its
    SharedExperts wrapper."""

    def __init__(self, name: str, kernel: Any, shared: Any):
        self.name, self.kernel, self.shared = name, kernel, shared

    @property
    def pf(self) -> Any:
        return self.kernel.prepare_finalize


class Sides:
    """Ours and in-tree for one backend and quant on this rank, their inputs and reference."""

    def __init__(self, rank: int, world: int, tp: int, backend: str, quant: str, device: str,
                 dbo: bool, config: Any):
        from vllm.model_executor.layers.fused_moe import all2all_utils
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                                 FusedMoEParallelConfig,
                                                                 FusedMoEQuantConfig,
                                                                 RoutingMethodType)

        from moe_plugins.runner.model import MoEWeights
        from tests.vllm_glue.vllm_modular_kernel_ranks import contiguous_expert_map

        self.rank, self.world, self.tp, self.backend = rank, world, tp, backend
        self.dev = rank_device(device)
        self.fp8 = quant == "fp8_block128"
        dp = world // tp
        sp = bool(getattr(config.parallel_config, "use_sequence_parallel_moe", False))
        self.sp = sp
        parallel = FusedMoEParallelConfig.make(tp_size_=tp, pcp_size_=1, dp_size_=dp,
                                               sp_size_=tp if sp else 1,
                                               vllm_parallel_config=config.parallel_config)
        # one vLLM state serves our three names: each layer's own --all2all-backend (vLLM's
        # factory and our hook read the layer's parallel config; our all2all manager of the EP
        # group builds any of our backends)
        parallel = dataclasses.replace(parallel, all2all_backend=OURS[backend])
        self.cfg = CFG
        num_local = CFG.num_experts // world
        self.moe = FusedMoEConfig(
            num_experts=CFG.num_experts, experts_per_token=CFG.num_topk, hidden_dim=CFG.hidden,
            intermediate_size=CFG.intermediate, num_local_experts=num_local,
            num_logical_experts=CFG.num_experts, activation=MoEActivation.SILU, device=self.dev,
            routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
            in_dtype=CFG.dtype, max_num_tokens=MAX_TOKENS)
        self.qc = (FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn,
                                            block_shape=[128, 128])
                   if self.fp8 else FusedMoEQuantConfig.make())
        self.weights = MoEWeights.random(CFG, 0)
        local = self.weights.local_experts(world, rank)
        self.w13, self.w2 = local.w13.to(self.dev), local.w2.to(self.dev)
        self.expert_map = contiguous_expert_map(CFG.num_experts, world, rank).to(self.dev)
        shared_w = self.weights.shared(1, 0) if sp else self.weights.shared(tp, rank % tp)
        gate = None if shared_w.gate is None else shared_w.gate.to(self.dev)
        self.shared_w = type(shared_w)(shared_w.w13.to(self.dev), shared_w.w2.to(self.dev), gate,
                                       partial=shared_w.partial)
        # DBO only for the micro-batch-safe (low-latency) names; deepep_ht's layer is built
        # as under a config without it (vLLM's DBO check refuses it), on the same state
        self.dbo = dbo and backend in BATCHED
        parallel_config = config.parallel_config
        saved, parallel_config.enable_dbo = parallel_config.enable_dbo, self.dbo
        try:
            ours_pf = all2all_utils.maybe_make_prepare_finalize(self.moe, self.qc)
        finally:
            parallel_config.enable_dbo = saved
        assert ours_pf is not None, "our plugin's hook built no prepare/finalize"
        self.ours = self._side(OURS[backend], ours_pf)
        self.in_tree = self._side(IN_TREE[backend], self._in_tree_pf(ours_pf))

    def _in_tree_pf(self, ours_pf: Any) -> Any:
        """vLLM's in-tree class as maybe_make_prepare_finalize builds it for its own name, on
        our manager's buffer (all2all_utils: the same arguments)."""
        if self.backend == one_sided.NAME:  # vLLM's own manager and factory (that module)
            return one_sided.in_tree_one_sided(self.moe, self.qc, self.dev)
        backend = ours_pf.backend
        buffer = backend.manager.buffer
        n_local = self.moe.num_local_experts
        if self.backend == "deepep_ll":
            from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
                DeepEPLLPrepareAndFinalize)

            return DeepEPLLPrepareAndFinalize(
                buffer, max_tokens_per_rank=backend.manager.max_tokens_per_rank,
                num_dispatchers=self.world, use_fp8_dispatch=self.fp8)
        if self.backend == "nixl_ep":
            from vllm.model_executor.layers.fused_moe.prepare_finalize.nixl_ep import (
                NixlEPPrepareAndFinalize)

            return NixlEPPrepareAndFinalize(
                buffer, max_tokens_per_rank=backend.manager.max_tokens_per_rank,
                num_dispatchers=self.world, expert_capacity=n_local * self.world,
                use_fp8_dispatch=self.fp8)
        from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import (
            DeepEPHTPrepareAndFinalize)

        return DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=self.world,
                                          dp_size=self.world // self.tp,
                                          rank_expert_offset=self.rank * n_local)

    def _side(self, name: str, pf: Any) -> Side:
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

        if self.backend in BATCHED:
            if str(_ROOT / "benchmarks") not in sys.path:
                sys.path.insert(0, str(_ROOT / "benchmarks"))
            import vllm_cuda_layer

            experts = vllm_cuda_layer._experts_base()(
                self.moe, self.qc, max_num_tokens=pf.max_num_tokens_per_rank(),
                num_dispatchers=pf.num_dispatchers())
        else:
            experts = _torch_experts()(self.moe, self.qc)
        kernel = mk.FusedMoEKernel(pf, experts)
        shared = SharedExperts(
            _SharedMLP(self.shared_w), self.moe, enable_dbo=self.dbo,
            mk_can_overlap_shared_experts=lambda: kernel.can_overlap_shared_experts)
        return Side(name, kernel, shared)

    # -- calls ----------------------------------------------------------------------------------
    def inputs(self, n: int, seed: int, dp_rank: Optional[int] = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This DP rank's n tokens (CPU, bf16) and their routing (the reference's router, on
        the CPU: both sides and the reference route identically)."""
        from moe_plugins.runner.demo import demo_inputs
        from moe_plugins.runner.model import route

        x = demo_inputs(CFG, n, self.rank // self.tp if dp_rank is None else dp_rank, seed)
        w, ids = route(x, self.weights.router, CFG.num_topk, CFG.renormalize)
        return x, w, ids

    def forward(self, side: Side, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """One MoE layer on device tensors: vLLM's kernel (shared expert inside it when it
        overlaps) + the shared expert, as vLLM's runner (moe_runner.py) orders them: on a GPU,
        a kernel that cannot overlap the shared expert (``supports_async()`` False, as the
        one-sided classes) has it run on vLLM's side stream, launched before the dispatch and
        waited for after the kernel; no TP reduction (tp 1, or SP)."""
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

        dtype = side.pf.topk_indices_dtype() or torch.int32
        overlapping = side.shared.maybe_forward_async(x)
        routed = side.kernel.apply(hidden_states=x, w1=self.w13, w2=self.w2, topk_weights=w,
                                   topk_ids=ids.to(dtype), activation=MoEActivation.SILU,
                                   global_num_experts=CFG.num_experts, expert_map=self.expert_map,
                                   apply_router_weight_on_input=False, shared_experts=side.shared,
                                   shared_experts_input=x)
        if overlapping:
            side.shared.wait()
        side.shared(x, SharedExpertsOrder.NO_OVERLAP)  # runs only where nothing else ran it
        return routed + side.shared.output

    def to_dev(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(self.dev) for t in ts)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()


def _equal_detail(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    if a.shape != b.shape:
        return False, f"shapes differ {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(a, b):
        return True, "bit-equal"
    return False, f"NOT bit-equal: max |diff| {float((a.float() - b.float()).abs().max()):.4g}"


def _row(case: str, quant: str, tp: int, status: str, rel: Optional[float], detail: str,
         backend: Optional[str] = None, **extra: Any) -> dict:
    return dict(backend=backend, case=case, quant=quant, tp=tp, status=status,
                max_rel_err=None if rel is None else round(rel, 6), detail=detail, **extra)


def _ref(s: Sides, x: torch.Tensor) -> torch.Tensor:
    from moe_plugins.quant import QuantScheme, QuantSpec
    from moe_plugins.runner.reference import reference_moe

    return reference_moe(x, s.weights, QuantSpec(QuantScheme.FP8_BLOCK128) if s.fp8
                         else QuantSpec())


def _case_equal(s: Sides, quant: str) -> dict:
    counts = [RAGGED[(r + (3 if s.fp8 else 0)) % len(RAGGED)] for r in range(s.world)]
    n = counts[s.rank]  # tp 1: one DP rank per EP rank
    x, w, ids = s.inputs(n, seed=11)
    xd, wd, idd = s.to_dev(x, w, ids)
    with one_sided.call_context(s.backend, counts):
        ours = s.forward(s.ours, xd, wd, idd)
        theirs = s.forward(s.in_tree, xd, wd, idd)
    s.sync()
    same, how = _equal_detail(ours.cpu(), theirs.cpu())
    ref = _ref(s, x)
    ok_o, _, rel_o = compare(ours.cpu(), ref, CFG.dtype)
    ok_t, _, rel_t = compare(theirs.cpu(), ref, CFG.dtype)
    status = "passed" if same and ok_o and ok_t else "failed"
    return _row("ours=in-tree", quant, 1, status, max(rel_o, rel_t),
                f"{n} tokens; ours vs in-tree {how}; vs reference: ours "
                f"{'within' if ok_o else 'OUTSIDE'} tolerance (rel {rel_o:.3g}), in-tree "
                f"{'within' if ok_t else 'OUTSIDE'} (rel {rel_t:.3g}); async "
                f"{s.ours.pf.supports_async()}/{s.in_tree.pf.supports_async()}")


def _halves(n: int) -> list[slice]:
    half = (n + 1) // 2
    return [slice(0, half), slice(half, n)]


def _case_dbo(s: Sides) -> dict:
    from tests.vllm_glue.micro_batches import run_micro_batches

    n = DBO_TOKENS[s.rank % len(DBO_TOKENS)]
    x, w, ids = s.inputs(n, seed=12)
    xd, wd, idd = s.to_dev(x, w, ids)
    outs = {}
    for side in (s.ours, s.in_tree):
        fns = [lambda p=p, side=side: s.forward(side, xd[p], wd[p], idd[p]) for p in _halves(n)]
        if s.dev.type == "cuda":
            from vllm.utils.torch_utils import current_stream

            on = run_micro_batches(fns, compute_stream=current_stream(),
                                   comm_stream=torch.cuda.Stream(), device_index=0)
        else:
            on = run_micro_batches(fns)
        s.sync()
        off = [fn() for fn in fns]
        s.sync()
        outs[side.name] = (torch.cat(on).cpu(), torch.cat(off).cpu())
    (o_on, o_off), (t_on, t_off) = outs[s.ours.name], outs[s.in_tree.name]
    checks = [("ours on == off", *_equal_detail(o_on, o_off)),
              ("in-tree on == off", *_equal_detail(t_on, t_off)),
              ("ours == in-tree (on)", *_equal_detail(o_on, t_on))]
    ok_ref, _, rel = compare(o_on, _ref(s, x), CFG.dtype)
    slots = len(getattr(s.ours.pf, "_backends", []) or [])
    status = "passed" if all(c[1] for c in checks) and ok_ref else "failed"
    return _row("dbo", "bf16", 1, status, rel,
                f"{n} tokens in two micro-batches on vLLM's ubatch contexts; "
                + "; ".join(f"{name}: {how}" for name, _, how in checks)
                + f"; ours vs reference {'within' if ok_ref else 'OUTSIDE'} tolerance; "
                  f"our call slots {slots}")


def _case_graph(s: Sides) -> dict:
    if s.dev.type != "cuda":
        return _row("graph", "bf16", 1, "refused", None,
                    "CUDA graphs need a GPU (CPU dry run: not captured)")
    details, ok = [], True
    for side in (s.ours, s.in_tree):
        x, w, ids = (t.clone() for t in s.to_dev(*s.inputs(GRAPH_TOKENS, seed=21)))
        graph, out = capture(lambda side=side: s.forward(side, x, w, ids))
        worst = 0.0
        for seed in (22, 23):  # new inputs into the captured buffers
            nx, nw, nids = s.to_dev(*s.inputs(GRAPH_TOKENS, seed=seed))
            x.copy_(nx), w.copy_(nw), ids.copy_(nids)
            graph.replay()
            torch.cuda.synchronize()
            eager = s.forward(side, nx, nw, nids)
            torch.cuda.synchronize()
            same, how = _equal_detail(out.cpu(), eager.cpu())
            ok &= same
            if not same:
                details.append(f"{side.name} seed {seed}: replay vs eager {how}")
            worst = max(worst, compare(eager.cpu(), _ref(s, s.inputs(GRAPH_TOKENS, seed)[0]),
                                       CFG.dtype)[2])
        details.append(f"{side.name}: replay == eager on 2 new inputs" if ok else "")
    return _row("graph", "bf16", 1, "passed" if ok else "failed", worst,
                f"{GRAPH_TOKENS} tokens per rank; " + "; ".join(d for d in details if d))


def _case_sp(s: Sides) -> dict:
    """dp 2 x tp 2 with vLLM's SP: the attention's TP all_reduce of a partial, vLLM's
    sequence_parallel_chunk_impl, the kernel on the chunk (shared expert replicated), vLLM's
    tensor_model_parallel_all_gather; ours and in-tree the same way."""
    from vllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
    from vllm.model_executor.models.utils import sequence_parallel_chunk_impl

    if not s.sp:
        return _row("sp", "bf16", s.tp, "refused", None,
                    "vLLM did not turn sequence-parallel MoE on for this config")
    dp_rank = s.rank // s.tp
    n = RAGGED[(dp_rank + 3) % len(RAGGED)] or 5
    x, w_all, ids_all = s.inputs(n, seed=13, dp_rank=dp_rank)
    outs = {}
    for side in (s.ours, s.in_tree):
        partial = (x / s.tp).to(s.dev)  # the attention's TP-partial output (exact: tp = 2)
        h = tensor_model_parallel_all_reduce(partial.clone())
        h = sequence_parallel_chunk_impl(h)
        chunk = h.shape[0]
        tp_rank = s.rank % s.tp
        rows = slice(tp_rank * chunk, min((tp_rank + 1) * chunk, n))
        w = torch.zeros(chunk, CFG.num_topk)
        ids = torch.zeros(chunk, CFG.num_topk, dtype=torch.int64)
        real = max(0, rows.stop - rows.start)
        w[:real], ids[:real] = w_all[rows], ids_all[rows]
        if real < chunk:  # padding rows of the last chunk: routed as vLLM routes zeros
            from moe_plugins.runner.model import route

            pw, pids = route(torch.zeros(chunk - real, CFG.hidden, dtype=CFG.dtype),
                             s.weights.router, CFG.num_topk, CFG.renormalize)
            w[real:], ids[real:] = pw, pids
        out = s.forward(side, h, w.to(s.dev), ids.to(s.dev))
        out = tensor_model_parallel_all_gather(out, 0)[:n]
        s.sync()
        outs[side.name] = out.cpu()
    same, how = _equal_detail(outs[s.ours.name], outs[s.in_tree.name])
    ok, _, rel = compare(outs[s.ours.name], _ref(s, x), CFG.dtype)
    return _row("sp", "bf16", s.tp, "passed" if same and ok else "failed", rel,
                f"{n} tokens per DP rank, chunk per TP rank; ours vs in-tree {how}; ours vs "
                f"reference {'within' if ok else 'OUTSIDE'} tolerance; output_is_reduced "
                f"{s.ours.kernel.output_is_reduced()}")


@contextlib.contextmanager
def vllm_world(rank: int, world: int, tp: int, backend: str, device: str,
               dbo: bool, flashinfer: bool = False) -> Iterator[Any]:
    """The libraries (emulated on CPU; ``flashinfer``: flashinfer's too), vLLM imported and its
    state for this rank (:func:`vllm_state`, yields the VllmConfig); after the block, our EP
    manager, vLLM's in-tree managers and every library buffer of the process are destroyed."""
    with contextlib.ExitStack() as libraries:
        libraries.enter_context(vendor("vllm", device))
        libraries.enter_context(_emulated_gpu_backends(device))
        _import_vllm(device)
        if flashinfer:
            libraries.enter_context(one_sided.flashinfer_for_vllm(device))
        step(f"vLLM state: dp {world // tp} x tp {tp}, {OURS[backend]}" + (", DBO" if dbo else ""))
        with vllm_state(rank, world, tp, backend, device, dbo) as config:
            try:
                yield config
            finally:
                from moe_plugins.lowlat.vendor import destroy_all_buffers
                from moe_plugins.vllm.manager import ep_manager

                try:
                    ep_manager().destroy()
                    one_sided.destroy_in_tree()
                finally:
                    destroy_all_buffers()


def vllm_job(rank: int, world: int, device: str, tp: int,
             plan: list[tuple[str, list[tuple[str, str]]]]) -> list[dict]:
    """Every (case, quant) of every backend of ``plan`` ([(backend, cases)], in order) with
    vLLM's state for ``world`` ranks (``tp`` TP ranks per DP rank): one row per case, reported
    as it comes. A refused build (config, library) is recorded as such; a case that raises
    ends the job."""
    rows: list[dict] = []
    step("import vLLM")
    dbo = any(c == "dbo" for _, cases in plan for c, _ in cases)
    flashinfer = any(b == one_sided.NAME for b, _ in plan)
    with vllm_world(rank, world, tp, plan[0][0], device, dbo, flashinfer) as config:
        for backend, cases in plan:
            sides: dict[str, Sides] = {}
            for case, quant in cases:
                step(f"vllm {backend} {case} {quant}")
                try:
                    if quant not in sides:
                        sides[quant] = Sides(rank, world, tp, backend, quant, device,
                                             dbo, config)
                except ValueError as e:  # a configuration refused before any call
                    msg = " ".join(str(e).split())[:600]
                    row = _row(case, quant, tp, "refused", None,
                               f"building the kernels: {type(e).__name__}: {msg}",
                               backend=backend)
                    result(row)
                    rows.append(row)
                    continue
                except BaseException as e:  # ranks may be out of step: end the job
                    msg = " ".join(str(e).split())[:600]
                    result(_row(case, quant, tp, "failed", None,
                                f"building the kernels raised {type(e).__name__}: {msg}",
                                backend=backend))
                    raise
                s = sides[quant]
                try:
                    row = {"ours=in-tree": lambda: _case_equal(s, quant),
                           "dbo": lambda: _case_dbo(s),
                           "graph": lambda: _case_graph(s),
                           "sp": lambda: _case_sp(s)}[case]()
                except BaseException as e:
                    msg = " ".join(str(e).split())[:600]
                    row = _row(case, quant, tp, "failed", None,
                               f"raised {type(e).__name__}: {msg}", backend=backend)
                    result(row)
                    raise
                row["backend"] = backend
                result(row)
                rows.append(row)
        step("teardown")
    return rows
