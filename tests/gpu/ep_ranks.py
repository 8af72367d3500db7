"""Rank functions of the one-device EP matrix (tests/gpu/ep_matrix.py), layer path: our
``MoELayer`` (and, for packed UE8M0 scales, its prepare/finalize with experts that ask for
them) at EP > 1 on every backend's real library, each rank element-wise against the
single-process reference of its own tokens (``reference_moe`` + ``tolerance_for``, as
tests/checks.py).

Device-agnostic: ``device="cuda"`` runs on the real libraries (all ranks on cuda:0, see
tests/gpu/ep_harness.py), ``device="cpu"`` on the emulations of tests/emulation, installed in
each rank for the rank function's duration (:func:`vendor`). Every case reports a step before
it starts and one result per rank when it ends (``ep_harness.result``), a dict with the row's
``case``, ``quant``, ``tp``, ``status`` (``passed``, ``failed`` or ``refused``: the backend or
library refused the configuration before running it), ``max_rel_err`` (max |out - ref| /
max |ref| over the rank's tokens) and ``detail``. A case that fails mid-call ends the job (the
ranks are out of step after it); a refused one does not.

Shapes: hidden 2048 (a low-latency kernel size), 16 routed experts (2 to 8 per rank), top-4,
a shared expert (overlap on: a CUDA side stream on the GPU, inline on CPU), at most 64 tokens
per rank, ragged with zero-token ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from moe_plugins.interface import BatchHint
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.experts import TorchExperts
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights
from moe_plugins.runner.reference import reference_moe, tolerance_for
from moe_plugins.quant import QuantScheme, QuantSpec, dequantize
from tests.gpu.ep_harness import rank_device, result, step

__all__ = ["CFG", "MAX_TOKENS", "RAGGED", "Case", "layer_job", "mask_job", "fault_job", "vendor",
           "backend_options", "QUANTS", "LL", "ue8m0_round_trip"]

CFG = MoEConfig(hidden=2048, num_experts=16, num_topk=4, intermediate=128,
                shared_intermediate=256, dtype=torch.bfloat16)
MAX_TOKENS = 64
#: tokens per DP rank: case offset o gives DP rank d RAGGED[(d + o) % 8] tokens (0 included)
RAGGED = (0, 64, 7, 33, 1, 50, 0, 19)
#: deepep_auto's low-latency capacity in these runs, and token counts that fit it everywhere
AUTO_LL_CAPACITY = 16
AUTO_LL_TOKENS = (0, 16, 7, 3, 1, 15, 0, 9)
#: the ``auto-link`` case: deepep_auto built with a link (NVLink at 2 GB/s, DeepEP's test SMs:
#: slow enough that the time model's crossover of AUTO_LINK_CFG's layer falls inside
#: AUTO_LINK_CAPACITY at EP 2, 4 and 8, or just above it), on top-8 of the 16 experts (more
#: experts per token than ranks hit: normal mode's one row per rank pays off)
AUTO_LINK = {"nvlink_gbps": 2.0, "sms": 24}
AUTO_LINK_CAPACITY = 32
AUTO_LINK_CFG = dataclasses.replace(CFG, num_topk=8)
LL = ("deepep_ll", "nixl_ep")
FLASHINFER = "flashinfer_nvlink_two_sided"
FLASHINFER_ONE_SIDED = "flashinfer_nvlink_one_sided"
FLASHINFERS = (FLASHINFER, FLASHINFER_ONE_SIDED)  # both on flashinfer's MNNVL memory
QUANTS = {"bf16": QuantSpec(), "fp8_block128": QuantSpec(QuantScheme.FP8_BLOCK128),
          "ue8m0": QuantSpec(QuantScheme.FP8_BLOCK128), "nvfp4": QuantSpec(QuantScheme.NVFP4)}


@dataclass(frozen=True)
class Case:
    """One row of the layer path: ``name`` (``ragged``, ``auto-ll``, ``auto-normal``,
    ``auto-link`` (:func:`_auto_link_rows`), ``eplb``
    (also yields the ``rebalance`` row), ``row_scatter``, ``sp``, ``mask`` (yields
    ``mask-before``, ``mask``, ``unmask``: :func:`mask_job`'s calls), ``graph`` (CUDA only: the
    layer captured in a CUDA graph and replayed on new inputs, :func:`_graph_rows`)); ``quant`` (``bf16``,
    ``fp8_block128``, ``ue8m0``: FP8 with packed UE8M0 scales for experts that ask for them,
    ``nvfp4``: packed e2m1 with e4m3 scales per 16 elements, quantized by our prepare in torch
    and moved as bytes by the library, so it runs on a GPU without NVFP4 tensor cores);
    ``tp`` (2: dp = ep / 2 x tp 2); ``offset`` into the ragged token counts."""

    name: str
    quant: str = "bf16"
    tp: int = 1
    offset: int = 0

    @property
    def rows(self) -> tuple[str, ...]:
        return {"eplb": ("eplb", "rebalance"),
                "mask": ("mask-before", "mask", "unmask")}.get(self.name, (self.name,))

    def tokens(self, dp_rank: int) -> int:
        counts = AUTO_LL_TOKENS if self.name in ("auto-ll", "graph") else RAGGED
        return counts[(dp_rank + self.offset) % len(counts)]


# -- the libraries: real on the GPU, emulated on the CPU -----------------------------------------
@contextlib.contextmanager
def vendor(backend: str, device: str) -> Iterator[None]:
    """On CPU, the emulation of ``backend``'s library in sys.modules for the block (tests/
    emulation); on a GPU the real library is imported (flashinfer's moe_ep past its NVLink
    platform check on a one-GPU host: tests/gpu/flashinfer_one_gpu.py)."""
    if not device.startswith("cpu") and backend in FLASHINFERS:
        from tests.gpu.flashinfer_one_gpu import nvlink_check_on_one_gpu

        with nvlink_check_on_one_gpu():
            yield
        return
    if not device.startswith("cpu") or backend == "torch":
        yield
        return
    if backend in FLASHINFERS:
        from tests.emulation import flashinfer_two_sided as emu

        with emu.installed("0.7.2.post1"):
            yield
        return
    from tests.emulation import installed

    names = {"deepep_ll": ("deep_ep",), "deepep_ht": ("deep_ep",), "deepep_auto": ("deep_ep",),
             "nixl_ep": ("nixl_ep",), "vllm": ("deep_ep", "nixl_ep")}[backend]
    with installed(*names):
        yield


def backend_options(backend: str, world: int, device: str, **kw: Any) -> Any:
    """The options each backend runs with here (None: its defaults)."""
    if backend == "deepep_ll":
        from moe_plugins.all2all.deepep_ll import DeepEPLLOptions

        return DeepEPLLOptions(**kw)
    if backend == "deepep_auto":
        from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions

        return DeepEPAutoOptions(ll_max_tokens_per_rank=AUTO_LL_CAPACITY, **kw)
    if backend == "nixl_ep":
        from moe_plugins.all2all.nixl_ep import NixlEPOptions

        store = dist.PrefixStore("nixl_ep", dist.distributed_c10d._get_default_store())
        return NixlEPOptions(tcp_store_group=store, **kw)
    if backend == FLASHINFER:
        from moe_plugins.all2all.flashinfer_nvlink_two_sided import FlashInferTwoSidedOptions

        # every rank on one host (and one GPU): the MNNVL mapping must see them as one node
        return FlashInferTwoSidedOptions(gpus_per_node=world, **kw)
    if backend == FLASHINFER_ONE_SIDED:
        from moe_plugins.all2all.flashinfer_nvlink_one_sided import FlashInferOneSidedOptions

        return FlashInferOneSidedOptions(**kw)  # moe_ep maps the group as one node itself
    return None


# -- numerics ------------------------------------------------------------------------------------
def ue8m0_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [n, hidden] -> float32 after the low-latency kernels' FP8 cast with power-of-two
    (UE8M0) scales: per 128 columns scale_inv = 2 ** ceil(log2(max(amax, 1e-4) / 448))."""
    n, h = x.shape
    blocks = x.float().view(n, h // 128, 128)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    mant, exp = torch.frexp(amax / 448.0)
    exp = exp - (mant == 0.5).to(exp.dtype)  # exact powers of two stay (ceil of log2)
    scale_inv = torch.exp2(exp.float())
    q = (blocks / scale_inv.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale_inv.unsqueeze(-1)).view(n, h)


class UE8M0Experts(TorchExperts):
    """The reference experts, asking the prepare/finalize for packed UE8M0 activation scales
    (as DeepGEMM does) and unpacking them before computing."""

    def supports_packed_ue8m0_act_scales(self) -> bool:
        return True

    def _input(self, x: torch.Tensor, x_sf: Optional[torch.Tensor],
               x_sf_swizzled: bool = False) -> torch.Tensor:
        if x_sf is not None and x_sf.dtype == torch.int32:
            from moe_plugins.lowlat.limits import unpack_ue8m0_scales

            return dequantize(x, unpack_ue8m0_scales(x_sf.contiguous()), self.quant)
        return super()._input(x, x_sf, x_sf_swizzled)


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float, float]:
    """(within tolerance_for element-wise, max |out - ref|, that / max |ref|)."""
    if out.shape != ref.shape:
        return False, float("inf"), float("inf")
    if ref.numel() == 0:
        return True, 0.0, 0.0
    atol, rtol = tolerance_for(ref, dtype)
    err = (out.float().cpu() - ref).abs()
    ok = bool((err <= atol + rtol * ref.abs()).all()) and bool(torch.isfinite(out.float()).all())
    scale = float(ref.abs().max())
    max_err = float(err.max())
    return ok, max_err, max_err / scale if scale > 0 else max_err


def _row(case: str, quant: str, tp: int, status: str, rel: Optional[float] = None,
         detail: str = "", backend: Optional[str] = None, **extra: Any) -> dict:
    return dict(backend=backend, case=case, quant=quant, tp=tp, status=status,
                max_rel_err=None if rel is None else round(rel, 6), detail=detail, **extra)


def _refusal(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"


# -- the layer path ------------------------------------------------------------------------------
class _Layers:
    """The layers one job builds, all kept alive until the end of the job: they share one
    library buffer per key (NVSHMEM and NIXL agents are set up once per process)."""

    def __init__(self, backend: str, world: int, device: str):
        from moe_plugins.registry import get_backend

        self.backend, self.world, self.device = backend, world, device
        self.spec = get_backend(backend)
        self.dev = rank_device(device)
        self.built: list[Any] = []

    def build(self, cfg: MoEConfig, weights: MoEWeights, tp: int, strategy: Optional[str],
              quant: QuantSpec, placement: Any = None, options: Any = None,
              call_timeout_s: Optional[float] = None, on_peer_loss: Any = None) -> Any:
        from moe_plugins.groups import cached_dist_context
        from moe_plugins.layout import ParallelLayout
        from moe_plugins.overlap import OverlapConfig
        from moe_plugins.runner.layer import MoELayer
        from moe_plugins.strategy import ReductionStrategy

        layout = ParallelLayout(self.world // tp, tp, True)
        ctx = cached_dist_context(layout, self.dev)
        layer = MoELayer(weights.to(self.dev), ctx, self.spec,
                         None if strategy is None else ReductionStrategy(strategy), quant,
                         OverlapConfig(overlap=True), max_tokens_per_rank=MAX_TOKENS,
                         backend_options=options if options is not None else
                         backend_options(self.backend, self.world, self.device),
                         placement=placement, call_timeout_s=call_timeout_s,
                         on_peer_loss=on_peer_loss)
        self.built.append(layer)
        return layer

    def destroy(self) -> None:
        for layer in reversed(self.built):
            try:
                layer.destroy()
            except Exception:  # noqa: BLE001 - teardown after a failure: report the failure
                pass
        self.built.clear()


def _forward(layer: Any, x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    out = layer(x.to(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return out.cpu()


def _check(case: str, quant: str, tp: int, out: torch.Tensor, ref: torch.Tensor, n: int,
           extra: str = "", **fields: Any) -> dict:
    ok, err, rel = compare(out, ref, CFG.dtype)
    detail = f"{n} tokens; max abs err {err:.4g}" + (f"; {extra}" if extra else "")
    return _row(case, quant, tp, "passed" if ok else "failed", rel, detail, tokens=n, **fields)


def _modes(layer: Any) -> dict:
    """The layer's dispatch count per mode so far (deepep_auto's ``low_latency`` / ``normal``)."""
    return dict(getattr(layer.dispatch_stats, "modes", {}) or {})


def _modes_since(layer: Any, before: dict) -> dict:
    """The dispatches per mode since ``before`` (:func:`_modes`), modes with none left out."""
    return {k: v - before.get(k, 0) for k, v in _modes(layer).items() if v - before.get(k, 0)}


def _placements(num_logical: int, world: int) -> tuple[Any, Any]:
    from tests.contracts.placement_ranks import random_placement

    # as many redundant slots as ranks: 16 physical experts, the linear layers' buffer size
    return (random_placement(num_logical, world, 16 - num_logical, seed=1),
            random_placement(num_logical, world, 16 - num_logical, seed=2))


def _run_case(layers: _Layers, rank: int, world: int, case: Case, seed: int) -> list[dict]:
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.registry import BackendSelectionError

    dev, backend = layers.dev, layers.backend
    if case.name == "mask":
        return _mask_rows(layers, rank, world, world - 1, seed)
    if case.name == "graph":
        return _graph_rows(layers, rank, case, seed)
    if case.name == "auto-link":
        return _auto_link_rows(layers, rank, world, case, seed)
    quant = QUANTS[case.quant]
    layout = ParallelLayout(world // case.tp, case.tp, True)
    dp = layout.dp_rank(rank)
    n = case.tokens(dp)
    cfg = CFG
    if case.name == "eplb":
        cfg = dataclasses.replace(CFG, num_experts=16 - world)  # + world redundant = 16 slots
    weights = MoEWeights.random(cfg, seed)
    strategy = {"row_scatter": "ROW_SCATTER_ALLREDUCE", "sp": "SP_ALLGATHER"}.get(case.name)
    placements = _placements(cfg.num_experts, world) if case.name == "eplb" else (None, None)
    try:
        layer = layers.build(cfg, weights, case.tp, strategy, quant, placement=placements[0])
    except (BackendSelectionError, ValueError) as e:
        # configuration refused before anything ran (our checks raise ValueError naming the
        # value and the fix), the same on every rank; any other error is a failure
        return [_row(r, case.quant, case.tp, "refused", None, _refusal(e)) for r in case.rows]
    round_trip = None
    if case.quant == "ue8m0":
        assert layer.pf is not None
        experts = UE8M0Experts(layer.expert_weights, quant, cfg.dtype)
        layer.pf.post_init_setup(experts)
        layer.experts = experts
        round_trip = ue8m0_round_trip
    x = demo_inputs(cfg, n, dp, seed)
    ref = reference_moe(x, weights, quant, round_trip=round_trip)
    modes_before = _modes(layer)
    out = _forward(layer, x, dev)
    modes = _modes_since(layer, modes_before)
    extra = f"strategy {layer.strategy.value}" + (f"; mode {modes}" if modes else "")
    if case.name != "eplb":
        return [_check(case.name, case.quant, case.tp, out, ref, n, extra, modes=modes)]
    rows = [_check("eplb", case.quant, case.tp, out, ref, n,
                   f"{placements[0].describe()}; {extra}")]
    step(f"{backend} rebalance to a second EPLB placement")
    layer.rebalance(placements[1])
    out = _forward(layer, x, dev)
    rows.append(_check("rebalance", case.quant, case.tp, out, ref, n,
                       f"after MoELayer.rebalance to {placements[1].describe()}"))
    return rows


def _link_calls(crossover: int, capacity: int, world: int) -> list[list[int]]:
    """Tokens per rank of each call of the ``auto-link`` case: every rank at 1, below the
    crossover, at it; ragged calls whose largest rank is just below or at it (the others
    small or empty); the capacity and one beyond it on one rank."""
    c = crossover

    def one(n: int, rest: int, at: int = 0) -> list[int]:
        return [n if r == at else rest for r in range(world)]

    return [[1] * world, [c - 1] * world, [c] * world, one(c - 1, 0), one(c, 1, world - 1),
            one(c - 1, c - 2, world - 1), one(capacity, 0), one(capacity + 1, 2)]


def _auto_link_rows(layers: _Layers, rank: int, world: int, case: Case, seed: int) -> list[dict]:
    """deepep_auto built with the link :data:`AUTO_LINK`: one layer, a call per batch of
    :func:`_link_calls` around the time model's crossover; each call must take the mode the
    model prices faster for its largest rank's rows (``tests.checks.faster_mode``: each mode's
    own plan, no crossover search) and match the reference of this rank's tokens. Every rank
    reports the threshold, the crossover and the mode of each call in its detail."""
    from moe_plugins.all2all.deepep_auto import DeepEPAutoOptions
    from moe_plugins.planner.crossover import mode_crossover
    from moe_plugins.planner.link_model import LinkModel
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.registry import get_backend
    from tests.checks import faster_mode

    cfg, quant, link = AUTO_LINK_CFG, QUANTS[case.quant], LinkModel(**AUTO_LINK)
    cross = mode_crossover(cfg, ParallelLayout(world, 1, True), quant, get_backend("deepep_ll"),
                           get_backend("deepep_ht"), link).tokens
    if cross is None or not 1 < cross <= MAX_TOKENS:
        return [_row(case.name, case.quant, 1, "failed", None,
                     f"the link gives no crossover in 2..{MAX_TOKENS} tokens: {cross}")]
    weights = MoEWeights.random(cfg, seed)
    layer = layers.build(cfg, weights, 1, None, quant, options=DeepEPAutoOptions(
        ll_max_tokens_per_rank=AUTO_LINK_CAPACITY, link=link))
    calls = _link_calls(cross, AUTO_LINK_CAPACITY, world)
    worst, taken, wrong = 0.0, [], []
    for i, counts in enumerate(calls):
        step(f"deepep_auto auto-link call {i}: {counts[rank]} of max {max(counts)} tokens")
        want = faster_mode(cfg, world, max(counts), quant, link, AUTO_LINK_CAPACITY)
        x = demo_inputs(cfg, counts[rank], rank, seed + i)
        before = _modes(layer)
        out = _forward(layer, x, layers.dev)
        mode = "+".join(_modes_since(layer, before)) or "none"
        ok, _, rel = compare(out, reference_moe(x, weights, quant), cfg.dtype)
        worst = max(worst, rel)
        taken.append(f"{max(counts)}:{mode}")
        if mode != want or not ok:
            wrong.append(f"call {i} (max {max(counts)} tokens): {mode}, model {want}"
                         + ("" if ok else f", rel err {rel:.3g}"))
    threshold = layer.pf.threshold  # type: ignore[union-attr]
    detail = (f"threshold {threshold} (crossover {cross}, capacity {AUTO_LINK_CAPACITY}, "
              f"link {AUTO_LINK}); max tokens:mode {' '.join(taken)}"
              + (f"; WRONG {'; '.join(wrong)}" if wrong else ""))
    return [_row(case.name, case.quant, 1, "failed" if wrong else "passed", worst, detail,
                 threshold=threshold, crossover=cross)]


def _graph_rows(layers: _Layers, rank: int, case: Case, seed: int) -> list[dict]:
    """The layer captured in a CUDA graph (every rank at once), then two replays on new inputs,
    each against the reference of those inputs. A backend that cannot be captured (deepep_ht:
    normal mode waits on the host) must refuse the capture on every rank before sending
    anything, and its layer must stay usable: the eager call after the refusal must be right
    (the row is then ``refused``, with the refusal in its detail)."""
    from tests.gpu.cuda_graphs import capture

    dev, quant = layers.dev, QUANTS[case.quant]
    n = case.tokens(rank)
    weights = MoEWeights.random(CFG, seed)
    layer = layers.build(CFG, weights, 1, None, quant)
    static_x = demo_inputs(CFG, n, rank, seed).to(dev)
    modes_before = _modes(layer)
    try:
        graph, static_out = capture(lambda: layer(static_x))
    except RuntimeError as e:
        refusal = _refusal(e)
        torch.cuda.synchronize()
        x = demo_inputs(CFG, n, rank, seed + 1)
        row = _check("graph", case.quant, 1, _forward(layer, x, dev),
                     reference_moe(x, weights, quant), n,
                     f"capture refused: {refusal}; the eager call after it")
        if row["status"] == "passed":  # a capture that failed for another reason: failed
            row["status"] = "refused" if "cannot be captured" in refusal else "failed"
        return [row]
    modes = _modes_since(layer, modes_before)
    worst: Optional[dict] = None
    for replay in (1, 2):
        x = demo_inputs(CFG, n, rank, seed + replay)
        static_x.copy_(x.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        row = _check("graph", case.quant, 1, static_out.cpu(), reference_moe(x, weights, quant),
                     n, f"replay {replay} of 2 on new inputs; modes while captured and warmed "
                     f"up {modes or 'none counted'}", modes=modes)
        if worst is None or row["status"] != "passed" or \
                (row["max_rel_err"] or 0) > (worst["max_rel_err"] or 0):
            worst = row
    assert worst is not None
    return [worst]


def layer_job(rank: int, world: int, device: str, plan: list[tuple[str, list[Case]]],
              seed: int = 0) -> list[dict]:
    """Every case of every backend of ``plan`` ([(backend, cases)], in order) on this rank (see
    the module doc); returns the rows it reported. Several backends share one world (one
    process start-up, and each library's buffers set up once); each backend's layers live until
    the end of the job."""
    out: list[dict] = []
    held: list[_Layers] = []
    try:
        for backend, cases in plan:
            step(f"{backend}: import the library")
            with vendor(backend, device):
                layers = _Layers(backend, world, device)
                held.append(layers)
                for case in cases:
                    step(f"{backend} {case.name} {case.quant} tp{case.tp}")
                    try:
                        rows = _run_case(layers, rank, world, case, seed)
                    except BaseException as e:
                        for r in case.rows:
                            row = _row(r, case.quant, case.tp, "failed", None,
                                       f"raised {_refusal(e)}")
                            row["backend"] = backend
                            result(row)
                            out.append(row)
                        raise
                    for row in rows:
                        row["backend"] = backend
                        result(row)
                        out.append(row)
        step("teardown")
    finally:
        for layers in reversed(held):
            with vendor(layers.backend, device):
                layers.destroy()
    return out


# -- rank masking ---------------------------------------------------------------------------------
def _without(weights: MoEWeights, ranks: list[int], world: int) -> MoEWeights:
    """The same weights with the routed experts of ``ranks`` (linear placement) zeroed: the
    reference of a call where those ranks are masked. The libraries' combine leaves a masked
    rank's (token, expert) terms out of the weighted sum and keeps the other weights as they
    are (DeepEP 567632d internode_ll.cu combine: ``if (is_rank_masked(mask, topk_idx /
    num_local_experts)) continue;``; nixl_ep_ll.cu the same), which is exactly a zero output of
    those experts."""
    per = weights.config.num_experts // world
    w2 = weights.w2.clone()
    for r in ranks:
        w2[r * per:(r + 1) * per] = 0
    return dataclasses.replace(weights, w2=w2)


def _mask_rows(layers: _Layers, rank: int, world: int, victim: int, seed: int,
               options: Any = None) -> list[dict]:
    """Masking on the real library, one layer, three calls: all ranks live (the full
    reference); then ``victim`` masked by every other rank while it masks all of them (a
    partition: nobody waits for a peer that does not send, so no kernel times out), each side
    against the reference without the other side's experts; then every mask cleared, the full
    reference again."""
    backend = layers.backend
    rows: list[dict] = []
    weights = MoEWeights.random(CFG, seed)
    step(f"{backend}: build the masking layer")
    layer = layers.build(CFG, weights, 1, None, QUANTS["bf16"], options=options)
    manager = layer.pf.manager
    n = RAGGED[(rank + 1) % len(RAGGED)] or 5
    x = demo_inputs(CFG, n, rank, seed)
    step(f"{backend}: call 1, nobody masked")
    full = reference_moe(x, weights)
    rows.append(_check("mask-before", "bf16", 1, _forward(layer, x, layers.dev), full, n,
                       f"masked {manager.masked_ranks()}", backend=backend))
    others = [r for r in range(world) if r != victim]
    step(f"{backend}: mask (rank {victim} <-> ranks {others})")
    for r in ([victim] if rank != victim else others):
        manager.set_rank_masked(r, True)
    masked = manager.masked_ranks()
    if layers.dev.type == "cuda":
        torch.cuda.synchronize()
    step(f"{backend}: call 2, masked {masked}")
    ref = reference_moe(x, _without(weights, masked, world))
    rows.append(_check("mask", "bf16", 1, _forward(layer, x, layers.dev), ref, n,
                       f"masked {masked}; reference without their experts' terms",
                       backend=backend))
    step(f"{backend}: unmask")
    for r in masked:
        manager.set_rank_masked(r, False)
    if layers.dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()  # every rank unmasked before anyone sends again
    step(f"{backend}: call 3, masks cleared {manager.masked_ranks()}")
    rows.append(_check("unmask", "bf16", 1, _forward(layer, x, layers.dev), full, n,
                       f"masked {manager.masked_ranks()} after unmasking", backend=backend))
    return rows


def mask_job(rank: int, world: int, backend: str, device: str, victim: int,
             seed: int = 0) -> list[dict]:
    """:func:`_mask_rows` in a world of its own; deepep_ll needs DeepEP's mask buffer
    (``enable_shrink``), hence another buffer than the other deepep_ll layers', and
    flashinfer's one-sided kernels their mask compiled in (``enable_rank_mask``)."""
    opts = {"deepep_ll": {"enable_shrink": True},
            "flashinfer_nvlink_one_sided": {"enable_rank_mask": True}}.get(backend, {})
    rows: list[dict] = []
    step(f"{backend}: import the library")
    with vendor(backend, device):
        layers = _Layers(backend, world, device)
        try:
            for row in _mask_rows(layers, rank, world, victim, seed,
                                  backend_options(backend, world, device, **opts)):
                result(row)
                rows.append(row)
            step(f"{backend}: teardown")
        finally:
            layers.destroy()
    return rows


# -- faults ----------------------------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    """The error's first line without a C++ source prefix ("[/path/file.cc:129] ")."""
    import re

    lines = str(e).strip().splitlines()
    return re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0])[:400] if lines else ""


def fault_job(rank: int, world: int, backend: str, device: str, kind: str, victim: int,
              seed: int = 0, call_timeout_s: Optional[float] = None, tokens: int = 8,
              prefill_hint: bool = False) -> dict:
    """One layer call with a fault on rank ``victim``; every rank reports what happened to it
    (``ep_harness.result``): how its call ended (returned / raised: type, first line), the
    seconds from the call's start, and, if it returned, whether the output is the full
    reference (a returned output that is not is a WRONG result). ``kind``: ``refuse`` (the
    victim's input is refused by its own layer before anything is sent: a wrong hidden size)
    or ``kill`` (the victim's process is killed between dispatch and combine: inside its
    experts) or ``kill-before`` (killed before call 2: its peers wait for its dispatch) or
    ``raise`` (the victim's experts raise between dispatch and combine: it lives, raises its
    own error and tells its peers, moe_plugins.callbound.fault_notice) or ``hang`` (the victim stops there, alive, for 10 s past the others' bound).
    ``call_timeout_s``: the other ranks' layers run under moe_plugins.callbound.watchdog with this bound
    (the watchdog ends their processes: its error is reported as call 2's; call 1 then runs twice,
    so that call 2 is under the call bound, not the start-up bound). ``tokens`` per rank (more
    than deepep_auto's low-latency capacity: its normal mode); ``prefill_hint``: each call is
    given an engine's prefill hint (deepep_auto: normal mode without its choice's collective,
    as vLLM's glue hints it). Call 1 (nobody faulty) runs
    first, so buffers and connections are up; after a
    refusal, call 3 (every rank's good input) must be right everywhere: the layer stays
    usable."""
    step(f"{backend}: import the library")
    with vendor(backend, device):
        layers = _Layers(backend, world, device)
        try:
            weights = MoEWeights.random(CFG, seed)
            opts = {"timeout_ms": 20_000} if backend == "nixl_ep" else {}
            step(f"{backend}: build the layer")
            layer = layers.build(CFG, weights, 1, None, QUANTS["bf16"],
                                 options=backend_options(backend, world, device, **opts),
                                 call_timeout_s=None if rank == victim else call_timeout_s)
            n = tokens

            def forward(inp: torch.Tensor) -> torch.Tensor:
                if prefill_hint:  # as vLLM's glue hints each forward pass
                    layer.pf.set_batch_hint(BatchHint(n, prefill=True))
                return _forward(layer, inp, layers.dev)

            x = demo_inputs(CFG, n, rank, seed)
            full = reference_moe(x, weights)
            step(f"{backend}: call 1 (no fault)")
            # under a bound, one good call more: a layer's calls run under the longer start-up
            # bound until one after its first has completed (moe_plugins.callbound.watchdog)
            for _ in range(1 if call_timeout_s is None else 2):
                ok, _, rel = compare(forward(x), full, CFG.dtype)
            result({"call": 1, "ok": ok, "max_rel_err": rel})
            dist.barrier()
            if rank == victim and kind == "kill-before":
                step(f"{backend}: victim killed before call 2's dispatch")
                time.sleep(0.5)  # the step reaches the parent first
                os.kill(os.getpid(), signal.SIGKILL)
            call_x = x
            if rank == victim and kind == "refuse":
                call_x = torch.zeros(n, CFG.hidden + 128, dtype=CFG.dtype)  # refused: wrong hidden
            if rank == victim and kind == "kill":
                inner = layer.experts.apply

                def die_between(prep: Any) -> Any:
                    step(f"{backend}: victim killed between dispatch and combine")
                    time.sleep(0.5)  # the step reaches the parent first
                    os.kill(os.getpid(), signal.SIGKILL)
                    return inner(prep)
                layer.experts.apply = die_between  # type: ignore[method-assign]
            if rank == victim and kind == "raise":
                def raise_between(prep: Any) -> Any:
                    step(f"{backend}: victim's experts raise between dispatch and combine")
                    raise ValueError(f"the experts of EP rank {rank} failed on purpose")
                layer.experts.apply = raise_between  # type: ignore[method-assign]
            if rank == victim and kind == "hang":
                def hang_between(prep: Any) -> Any:
                    step(f"{backend}: victim hangs between dispatch and combine")
                    # past the peers' bound, then gone (the run ends without its whole bound)
                    time.sleep((call_timeout_s or 60.0) + 10.0)
                    os._exit(0)
                layer.experts.apply = hang_between  # type: ignore[method-assign]
            step(f"{backend}: call 2 ({kind} on rank {victim})")
            t0 = time.monotonic()
            if rank != victim:  # the bound, or with none set the backstop, may end this rank
                from moe_plugins.callbound import on_call_timeout

                on_call_timeout(lambda e: result({
                    "call": 2, "outcome": "raised", "type": type(e).__name__,
                    "message": _first_line(e), "seconds": round(time.monotonic() - t0, 2)}))
            try:
                out = forward(call_x)
            except BaseException as e:  # what this rank saw, then the harness records it
                report = {"call": 2, "outcome": "raised", "type": type(e).__name__,
                          "message": _first_line(e), "seconds": round(time.monotonic() - t0, 2)}
                result(report)
                step(f"{backend}: call 2 raised {type(e).__name__}")
            else:
                ok, _, rel = compare(out, full, CFG.dtype)
                report = {"call": 2, "outcome": "returned",
                          "seconds": round(time.monotonic() - t0, 2), "correct": ok,
                          "max_rel_err": rel}
                if not ok and rank != victim:
                    masked_ok, _, _ = compare(
                        out, reference_moe(x, _without(weights, [victim], world)), CFG.dtype)
                    report["matches_reference_without_victim"] = masked_ok
                result(report)
                step(f"{backend}: call 2 returned")
            if kind == "refuse":  # a refused input must leave the layer usable on every rank
                step(f"{backend}: call 3 (every rank's good input)")
                try:
                    ok3 = compare(forward(x), full, CFG.dtype)[0]
                    result({"call": 3, "outcome": "returned", "correct": ok3})
                except BaseException as e:
                    result({"call": 3, "outcome": "raised", "type": type(e).__name__,
                            "message": _first_line(e)})
            return report
        finally:
            # No teardown: after a fault the library may be unable to (a trapped kernel ends
            # the CUDA context; a buffer's destroy may wait for a peer that is gone). The
            # harness ends every rank process after the run.
            layers.built.clear()
