"""The prepare/finalize contract: row-scatter target, the join-and-add helper, finalize result."""
from __future__ import annotations

import pytest
import torch

from moe_plugins.interface import (AsyncResult, PrepareFinalize, RowScatterTarget,
                                   check_prepare_inputs, row_scatter_add)
from moe_plugins.layout import owned_rows
from moe_plugins.overlap import SharedExpertHandle


def _target(n: int = 5, tp: int = 2, rank: int = 1, dtype=torch.float32) -> RowScatterTarget:
    buf = torch.arange(n * 4, dtype=dtype).reshape(n, 4)
    return RowScatterTarget(SharedExpertHandle(buf), owned_rows(n, tp, rank))


def test_row_scatter_adds_owned_rows_only_and_returns_the_buffer():
    t = _target()
    before = t.buffer.clone()
    out = row_scatter_add(t, torch.ones(3, 4))  # rank 1 of tp 2 owns rows 3..4 (chunk 3)
    assert out is t.buffer
    assert torch.equal(out[:3], before[:3])
    assert torch.equal(out[3:], before[3:] + 1)


class _RecordingEvent:
    """Stands in for the side stream's CUDA event on CPU: records that someone waited on it."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


@pytest.mark.parametrize("num_tokens,tp,rank", [(1, 4, 3), (5, 2, 1)], ids=["zero-rows", "two-rows"])
def test_row_scatter_joins_the_shared_expert_before_touching_the_buffer(num_tokens, tp, rank):
    event = _RecordingEvent()
    rows = owned_rows(num_tokens, tp, rank)
    target = RowScatterTarget(SharedExpertHandle(torch.zeros(num_tokens, 4), event), rows)  # type: ignore[arg-type]
    row_scatter_add(target, torch.ones(rows.chunk, 4))
    assert event.waits == 1 and target.shared.joined
    row_scatter_add(target, torch.zeros(rows.chunk, 4))  # idempotent: joined once
    assert event.waits == 1


@pytest.mark.parametrize("combined,match", [
    (torch.ones(3, 4, dtype=torch.bfloat16), "float32 on cpu but the combined output is torch.bfloat16"),
    (torch.ones(1, 4), r"expected \[>= 2, 4\]"),
    (torch.ones(3, 5), r"expected \[>= 2, 4\]"),
])
def test_row_scatter_rejects_mismatched_output(combined, match):
    with pytest.raises(ValueError, match=match):
        row_scatter_add(_target(), combined)


def test_row_scatter_target_checks_buffer_shape():
    with pytest.raises(ValueError, match=r"buffer has shape \(4, 4\), expected \[5, hidden\]"):
        RowScatterTarget(SharedExpertHandle(torch.zeros(4, 4)), owned_rows(5, 2, 0))


def test_row_scatter_target_needs_a_buffer():
    with pytest.raises(ValueError, match="needs the shared expert's output buffer"):
        RowScatterTarget(SharedExpertHandle(None), owned_rows(5, 2, 0))


class _CopyingBackend(PrepareFinalize):
    """A third-party backend that breaks the contract: returns a fresh tensor."""

    def num_dispatchers(self) -> int:
        return 1

    def prepare_async(self, hidden_states, topk_weights, topk_ids, quant):  # pragma: no cover
        raise NotImplementedError

    def finalize_async(self, fused_expert_output, topk_weights, topk_ids, output):
        return AsyncResult(None, lambda: fused_expert_output.clone())


@pytest.mark.parametrize("row_scatter", [False, True])
def test_finalize_returning_another_buffer_is_an_error(row_scatter):
    out = _target() if row_scatter else torch.zeros(2, 4)
    with pytest.raises(TypeError, match="instead of the output buffer it was given"):
        _CopyingBackend().finalize(torch.ones(2, 4), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), out)


@pytest.mark.parametrize("ids_dtype,exc,match", [
    (torch.float32, TypeError, "topk_ids must be int32 or int64, got torch.float32"),
    (torch.int64, None, None),
])
def test_check_prepare_inputs_topk_dtype(ids_dtype, exc, match):
    args = (torch.zeros(3, 8), torch.ones(3, 2), torch.zeros(3, 2, dtype=ids_dtype))
    if exc is None:
        check_prepare_inputs(*args)
    else:
        with pytest.raises(exc, match=match):
            check_prepare_inputs(*args)


def test_check_prepare_inputs_names_both_shapes():
    with pytest.raises(ValueError, match=r"hidden_states \(4, 8\), topk_ids \(8, 2\)"):
        check_prepare_inputs(torch.zeros(4, 8), torch.ones(8, 2), torch.zeros(8, 2, dtype=torch.long))


@pytest.mark.parametrize("field,value", [("hidden", 0), ("hidden", -4), ("num_experts", 0),
                                         ("num_topk", 0), ("max_tokens_per_rank", 0),
                                         ("max_tokens_per_rank", -1)])
def test_dispatch_config_rejects_non_positive_sizes(field, value):
    from moe_plugins.config import DispatchConfig

    kw = {"num_experts": 8, "hidden": 256, "num_topk": 2, field: value}
    with pytest.raises(ValueError, match=rf"DispatchConfig.{field} must be a positive int, got {value}"):
        DispatchConfig(**kw)


# issue 28: num_topk='2' and max_tokens_per_rank=4.5 were accepted and failed inside a kernel
@pytest.mark.parametrize("field,value", [
    ("num_topk", "2"), ("num_topk", 2.0), ("num_topk", True), ("max_tokens_per_rank", 4.5),
    ("max_tokens_per_rank", True), ("max_tokens_per_rank", "256"), ("hidden", 2.5),
    ("hidden", torch.tensor(256)), ("num_experts", False), ("num_experts", None),
])
def test_dispatch_config_rejects_sizes_that_are_not_ints(field, value):
    from moe_plugins.config import DispatchConfig

    kw = {"num_experts": 8, "hidden": 256, "num_topk": 2, field: value}
    with pytest.raises(TypeError) as e:
        DispatchConfig(**kw)
    assert (f"DispatchConfig.{field} must be a positive int, got {value!r} "
            f"({type(value).__name__}); give ") in str(e.value)


@pytest.mark.parametrize("change,error,message", [
    ({"num_topk": 9}, ValueError, "DispatchConfig.num_topk must be in [1, num_experts=8], got 9"),
    ({"dtype": "bfloat16"}, TypeError,
     "DispatchConfig.dtype must be a torch.dtype, got 'bfloat16' (str); pass e.g. torch.bfloat16"),
    ({"dtype": torch.int32}, ValueError,
     "DispatchConfig.dtype must be a floating-point activation dtype, got torch.int32"),
    ({"dtype": torch.bool}, ValueError, "must be a floating-point activation dtype"),
    ({"quant": "fp8_block128"}, TypeError,
     "DispatchConfig.quant must be a QuantSpec, got 'fp8_block128' (str)"),
    ({"quant": None}, TypeError, "DispatchConfig.quant must be a QuantSpec, got None"),
    ({"placement": [0, 1, 2, 3]}, TypeError,
     "DispatchConfig.placement must be an ExpertPlacement or None, got list"),
])
def test_dispatch_config_checks_every_field(change, error, message):
    from moe_plugins.config import DispatchConfig

    with pytest.raises(error) as e:
        DispatchConfig(**{"num_experts": 8, "hidden": 256, "num_topk": 2, **change})
    assert message in str(e.value)


def test_dispatch_config_accepts_the_documented_values():
    from moe_plugins.config import DispatchConfig
    from moe_plugins.placement import ExpertPlacement
    from moe_plugins.quant import QuantScheme, QuantSpec

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cfg = DispatchConfig(8, 256, 8, 1, dtype, QuantSpec(QuantScheme.FP8_BLOCK128),
                             placement=ExpertPlacement.round_robin(8, 2))
        assert cfg.num_topk == 8 and cfg.max_tokens_per_rank == 1 and cfg.dtype is dtype


@pytest.mark.parametrize("args,error,text", [
    ((torch.zeros(3, 8, dtype=torch.int32), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long)),
     TypeError, "integer activations would be truncated"),
    ((torch.zeros(3, 8), torch.ones(3, 3), torch.zeros(3, 3, dtype=torch.long)),
     ValueError, "built for num_topk=2"),
    ((torch.zeros(3, 16), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long)),
     ValueError, "built for hidden=8"),
])
def test_prepare_inputs_checked_against_the_layer(args, error, text):
    from moe_plugins.config import DispatchConfig

    with pytest.raises(error, match=text):
        check_prepare_inputs(*args, DispatchConfig(num_experts=4, hidden=8, num_topk=2))


def _single_rank_layer():
    from moe_plugins.groups import DistContext
    from moe_plugins.runner.layer import MoELayer
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.config import MoEConfig
    from moe_plugins.runner.model import MoEWeights
    from moe_plugins.registry import get_backend

    cfg = MoEConfig(hidden=16, num_experts=4, num_topk=2, intermediate=8, shared_intermediate=8)
    ctx = DistContext(ParallelLayout(1, 1, False), 0, object(), None, torch.device("cpu"))
    return MoELayer(MoEWeights.random(cfg), ctx, get_backend("torch")), cfg


def test_layer_called_after_destroy_raises():
    layer, cfg = _single_rank_layer()
    layer(torch.zeros(2, cfg.hidden))
    layer.destroy()
    with pytest.raises(RuntimeError, match="was destroyed; build a new MoELayer"):
        layer(torch.zeros(2, cfg.hidden))


def test_layer_refuses_bad_activations_and_the_next_call_is_right():
    """A refusal before anything is sent leaves the layer usable (one rank: no peer to be out
    of step with): integer, misshaped, non-tensor and wrong-device activations each raise a
    clear error, and the next call returns what a fresh layer returns."""
    layer, cfg = _single_rank_layer()
    x = torch.randn(3, cfg.hidden)
    expected = _single_rank_layer()[0](x)
    bad = [
        (torch.zeros(2, cfg.hidden, dtype=torch.long), TypeError,
         r"x must be float \[num_tokens, 16\], got torch.int64"),
        (torch.zeros(2, 15), ValueError, r"got torch.float32 \(2, 15\)"),
        (x.numpy(), TypeError, r"x must be a torch.Tensor \[num_tokens, 16\], got numpy.ndarray"),
        (x.tolist(), TypeError, r"got builtins.list; convert it with torch.as_tensor"),
        (x.to("meta"), ValueError, r"x is on meta, the layer on cpu"),
    ]
    for given, exc, text in bad:
        with pytest.raises(exc, match=text):
            layer(given)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def test_lazy_expert_tokens_meta_makes_the_counts_once_on_first_read():
    """The counts of a LazyExpertTokensMeta are made by its function on the first read, once,
    and not at all while nobody reads them."""
    from moe_plugins.interface import ExpertTokensMeta, LazyExpertTokensMeta

    made: list[torch.Tensor] = []

    def make(source: torch.Tensor) -> torch.Tensor:
        made.append(source)
        return source * 2

    source = torch.tensor([1, 0, 3], dtype=torch.int32)
    meta = LazyExpertTokensMeta(make, source)
    assert isinstance(meta, ExpertTokensMeta) and made == []
    assert meta.expert_num_tokens.tolist() == [2, 0, 6]
    assert meta.expert_num_tokens is meta.expert_num_tokens and len(made) == 1


def test_optional_protocols_are_met_by_their_methods_not_a_base_class():
    """A third-party class with the methods takes the same paths as ours: the vLLM adapter's
    split send/receive halves (SplitPhases) and vLLM's fault tolerance (RankMasking)."""
    from moe_plugins.interface import SplitPhases
    from moe_plugins.backend_manager import RankMasking
    from moe_plugins.lowlat.manager import LowLatencyManager
    from moe_plugins.lowlat.prepare_finalize import LowLatencyPrepareFinalize
    from moe_plugins.prepare_finalize.torch import TorchPrepareFinalize

    class Halves:
        def dispatch_send(self, hidden_states, topk_weights, topk_ids, quant, recv_hook): ...
        def expert_shape(self): ...
        def combine_send(self, fused_expert_output, topk_weights, topk_ids, output,
                         recv_hook): ...
        def combine_received(self, dest, output): ...

    class Masks:
        def can_mask(self): return True
        def masked_ranks(self): return []
        def set_rank_masked(self, rank, masked=True): ...
        def clean_buffers(self): ...
        def masked_by_library(self): return []

    assert isinstance(Halves(), SplitPhases) and not isinstance(Masks(), SplitPhases)
    assert isinstance(Masks(), RankMasking) and not isinstance(Halves(), RankMasking)
    assert issubclass(LowLatencyPrepareFinalize, SplitPhases)
    assert not issubclass(TorchPrepareFinalize, SplitPhases)
    assert issubclass(LowLatencyManager, RankMasking)


def test_a_prepare_finalize_that_does_not_keep_its_config_is_refused_at_build():
    """Engines read a layer's shape from ``PrepareFinalize.cfg``; a backend whose class does not
    keep the config it was built with is refused when the layer is built, naming the class and
    the fix (the built-in backends keep it: every layer the suite builds goes through here)."""
    import dataclasses

    import torch.distributed as dist

    from moe_plugins.config import MoEConfig
    from moe_plugins.groups import DistContext
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.prepare_finalize.torch import TorchPrepareFinalize
    from moe_plugins.registry import get_backend
    from moe_plugins.runner.layer import MoELayer
    from moe_plugins.runner.model import MoEWeights

    def forgets(manager, cfg):
        return TorchPrepareFinalize(manager, dataclasses.replace(cfg))  # an equal copy, not cfg

    spec = dataclasses.replace(get_backend("torch"), name="forgetful", prepare_finalize=forgets)
    cfg = MoEConfig(hidden=16, num_experts=4, num_topk=2, intermediate=8, shared_intermediate=8)
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # EP on (one rank): tokens go through the backend, so the layer builds a prepare/finalize
        ctx = DistContext(ParallelLayout(1, 1, True), 0, dist.group.WORLD, None,
                          torch.device("cpu"))
        with pytest.raises(TypeError, match=r"backend 'forgetful': TorchPrepareFinalize does "
                                            r"not keep the layer config .* set self.cfg = cfg"):
            MoELayer(MoEWeights.random(cfg), ctx, spec)
        layer = MoELayer(MoEWeights.random(cfg), ctx, get_backend("torch"))
        assert layer.pf.cfg.hidden == cfg.hidden
        layer.destroy()
    finally:
        dist.destroy_process_group()
