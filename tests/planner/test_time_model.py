"""The all-to-all time model: its residuals on the published rows it was fitted on, how it
behaves away from them (tokens, links, SMs, transports), the presets, docs/planner.md's tables,
and the plan CLI's time output."""
from __future__ import annotations

import dataclasses
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
from moe_plugins.layout import ParallelLayout
from moe_plugins.planner.calibration import (CALIBRATION_MODEL, CHECK_ROWS, FITTED_ROWS,
                                             PUBLISHED_ROWS, predict_us, published_us,
                                             residuals)
from moe_plugins.planner.compare import compare_backends, crossover_backends
from moe_plugins.planner.crossover import mode_crossover
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.plan import plan_layer
from moe_plugins.planner.presets import LINK_PRESETS, PUBLISHED_NVLINK_ONE_SIDED, link_preset
from moe_plugins.planner.transport_time import FITTED
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import Transport, get_backend
from tests.checks import run_cli

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "planner.md"
FP8 = QuantSpec(QuantScheme.FP8_BLOCK128)
H800, H200 = LINK_PRESETS["h800-cx7"], LINK_PRESETS["h200-cx7"]


def _times(backend: str, ep: int, tokens: int, link: LinkModel = H800,
           cfg=CALIBRATION_MODEL) -> tuple[float, float]:
    t = plan_layer(cfg, ParallelLayout(ep, 1, True), tokens, get_backend(backend), FP8,
                   link=link).recommended.time
    return t.dispatch_us, t.combine_us


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", FITTED_ROWS, ids=lambda r: r.label.replace(" ", "-"))
def test_fitted_row_within_ten_percent(row):
    pub, pred = published_us(row), predict_us(row)
    assert abs(pred / pub - 1) <= 0.10, (row, pub, pred)


@pytest.mark.parametrize("row", CHECK_ROWS, ids=lambda r: r.label.replace(" ", "-"))
def test_row_not_fitted_within_eleven_percent(row):
    """The published low-latency rows at EP 64-256, which the fit did not see."""
    pub, pred = published_us(row), predict_us(row)
    assert abs(pred / pub - 1) <= 0.11, (row, pub, pred)


def _deepep_bytes(tokens: int, ranks_or_nodes: int, senders: int, fp8: bool) -> float:
    """DeepEP's counted bytes for 256 experts, top-8, hidden 7168: rows = senders x tokens x
    P(a block of 256 / ranks_or_nodes experts is hit), as math.comb gives it."""
    block = 256 // ranks_or_nodes
    hit = 1 - math.comb(256 - block, 8) / math.comb(256, 8)
    return senders * tokens * hit * 7168 * 2 * ((1 + 4 / 128) / 2 if fp8 else 1)


def test_bandwidth_rows_convert_as_deepep_counts():
    """A published bandwidth is the time that moves DeepEP's counted bytes at it: intranode,
    rank 0's received rows (8 senders, a rank's 32 experts); internode, rank 0's (token,
    node) rows (1 sender, a node's experts)."""
    want = {(8, "dispatch"): _deepep_bytes(4096, 8, 8, True) / 153e3,
            (8, "combine"): _deepep_bytes(4096, 8, 8, False) / 158e3,
            (16, "dispatch"): _deepep_bytes(4096, 2, 2, True) / 43e3,
            (16, "combine"): _deepep_bytes(4096, 2, 2, False) / 43e3,
            (32, "dispatch"): _deepep_bytes(4096, 4, 4, True) / 58e3,
            (32, "combine"): _deepep_bytes(4096, 4, 4, False) / 57e3}
    got = {(r.ep, r.phase): published_us(r) for r in FITTED_ROWS if r.unit == "GB/s"}
    assert got.keys() == want.keys()
    for key, us in want.items():
        assert got[key] == pytest.approx(us, rel=1e-12), key


def test_published_rows_name_their_source():
    assert len(PUBLISHED_ROWS) == 18 and len(FITTED_ROWS) == 12
    for r in PUBLISHED_ROWS:
        assert r.source.startswith("deepseek-ai/DeepEP README.md at 567632d, Performance, ")
        assert f"#EP {r.ep}" in r.source and r.phase in r.source
    assert {r.ep for r in CHECK_ROWS} == {64, 128, 256}
    assert all(r.backend == "deepep_ll" for r in CHECK_ROWS)


def test_the_code_constants_are_the_fit():
    """transport_time.FITTED is what `python -m moe_plugins.planner.fit` fits from the
    published rows, rounded to the digits the code keeps; --check says so."""
    from moe_plugins.planner.fit import fit, main

    assert fit()[1] == FITTED
    assert main(["--check"]) == 0


def test_the_fit_recovers_known_constants():
    """Rows made by the model itself under other constants: the fit finds those constants
    (what the fit does, not only that it lands on the code's numbers)."""
    from moe_plugins.planner.all_to_all import plan_all_to_all
    from moe_plugins.planner.calibration import CALIBRATION_QUANT, PublishedRow
    from moe_plugins.planner.fit import fit, rounded
    from moe_plugins.planner.transport_time import FittedConstants

    truth = rounded(FittedConstants(ll_fixed_us=25.3, ll_nvlink_efficiency=0.7,
                                    ll_rdma_efficiency=0.9, normal_nvlink_efficiency=0.6,
                                    normal_rdma_efficiency=0.85))
    rows = []
    for r in FITTED_ROWS:
        plan = plan_all_to_all(CALIBRATION_MODEL, ParallelLayout(r.ep, 1, True), [r.tokens] * r.ep,
                               get_backend(r.backend), CALIBRATION_QUANT, H800,
                               max_tokens=r.tokens)
        disp, comb = plan.times(truth)
        rows.append(PublishedRow(r.backend, r.ep, r.tokens, r.phase,
                                 disp if r.phase == "dispatch" else comb, "us", "the model", True))
    assert fit(rows)[1] == truth


def test_a_traffic_error_fails_the_drift_check(monkeypatch):
    """The published times do not come from the model's traffic code: 30% too many rows in
    the model (ranks and nodes a token reaches) moves every normal-mode prediction, not the
    published figures, and each of those rows then fails the 10% check."""
    from moe_plugins.planner import all_to_all, traffic

    before = [published_us(r) for r in FITTED_ROWS]
    hit, nodes = traffic.expected_ranks_hit, traffic.node_traffic
    monkeypatch.setattr(traffic, "expected_ranks_hit", lambda *a: hit(*a) * Fraction(13, 10))
    monkeypatch.setattr(all_to_all, "node_traffic",
                        lambda *a, **k: [[v * 1.3 for v in row] for row in nodes(*a, **k)])
    assert [published_us(r) for r in FITTED_ROWS] == before
    failing = [r.label for r in FITTED_ROWS if abs(predict_us(r) / published_us(r) - 1) > 0.10]
    assert failing == [r.label for r in FITTED_ROWS if r.unit == "GB/s"]


def _doc_rows(heading: str) -> list[list[str]]:
    """The cells of the markdown table under ``heading`` in docs/planner.md."""
    text = DOC.read_text()
    section = text.split(heading, 1)[1]
    lines = [ln for ln in section.split("\n\n", 2)[1].splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


@pytest.mark.parametrize("heading,rows", [("## Calibration rows", FITTED_ROWS),
                                          ("## Rows not fitted", CHECK_ROWS)])
def test_docs_calibration_tables_are_the_models(heading, rows):
    want = [[r.label, f"{r.value:g} {r.unit}", f"{pub:.0f}", f"{pred:.0f}", f"{res * 100:+.1f}%"]
            for r, pub, pred, res in residuals(rows)]
    assert _doc_rows(heading) == want


def test_docs_state_the_range():
    """README and docs/planner.md give the fitted rows' worst residual, the bound on the rows
    not fitted, and the model's EP 8 prediction set beside DeepEP PR #173's H20 numbers, as the
    model gives them now."""
    fitted = max(abs(res) for *_, res in residuals(FITTED_ROWS)) * 100
    unfitted = max(abs(res) for *_, res in residuals(CHECK_ROWS)) * 100
    assert unfitted <= 11
    readme = (ROOT / "README.md").read_text()
    planner = DOC.read_text()
    for text in (readme, planner):
        assert f"within {fitted:.1f}%" in " ".join(text.split())
        assert "within 11%" in " ".join(text.split())
    disp, comb = _times("deepep_ll", 8, 128, LINK_PRESETS["h100-cx7"])
    assert (f"the `h100-cx7` preset's prediction is {disp:.0f} / {comb:.0f} us"
            in " ".join(planner.split()))


# Our own H200 EP 1 round trips (benchmarks/results): a CUDA graph of DeepEP's dispatch and
# combine on one GPU, 32 experts, top-8, hidden 7168.
EP1_FILES = ["deepep_ll_latency_fp8_t8.json", "deepep_ll_latency_fp8_t64.json",
             "deepep_ll_latency_fp8_t128.json", "deepep_ll_latency_bf16_t64.json"]


def ep1_rows() -> list[list[str]]:
    out = []
    for name in EP1_FILES:
        data = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        c = data["config"]
        cfg = dataclasses.replace(CALIBRATION_MODEL, num_experts=c["experts"])
        quant = FP8 if c["fp8"] else QuantSpec()
        t = plan_layer(cfg, ParallelLayout(1, 1, True), c["tokens"], get_backend("deepep_ll"),
                       quant, link=LINK_PRESETS["h200-nvlink"]).recommended.time
        measured = data["graph_round_trip_us"]["raw, hook mode"]
        predicted = t.dispatch_us + t.combine_us
        out.append([f"{c['tokens']}", "FP8" if c["fp8"] else "BF16", f"{measured:.1f}",
                    f"{predicted:.1f}", f"{(predicted / measured - 1) * 100:+.0f}%", name])
    return out


def test_docs_ep1_table_is_the_models():
    assert _doc_rows("## Our H200 measurements at EP 1") == ep1_rows()


# --------------------------------------------------------------------------------------------
# Behaviour away from the calibration rows
# --------------------------------------------------------------------------------------------
TOKENS = [1, 2, 8, 64, 256, 1024, 4096]


@pytest.mark.parametrize("backend", ["deepep_ll", "deepep_ht", "torch", "deepep_auto"])
@pytest.mark.parametrize("ep,link", [(8, H800), (16, H800), (32, H200)],
                         ids=["ep8-h800", "ep16-h800", "ep32-h200"])
def test_time_grows_with_tokens(backend, ep, link):
    limit = get_backend(backend).token_limit
    taken = [n for n in TOKENS if limit is None or n <= limit(ep).tokens]
    times = [_times(backend, ep, n, link) for n in taken]
    for phase in (0, 1):
        seq = [t[phase] for t in times]
        assert all(b >= a for a, b in zip(seq, seq[1:])), (phase, seq)
        assert seq[-1] > 2 * seq[0]  # bytes matter at the largest batch


@pytest.mark.parametrize("backend", ["deepep_ll", "deepep_ht", "torch"])
def test_rdma_is_slower_than_nvlink(backend):
    """The same 16 ranks in one NVLink domain, then on two nodes."""
    one = _times(backend, 16, 256, dataclasses.replace(H200, gpus_per_node=16))
    two = _times(backend, 16, 256, H200)
    assert two[0] > one[0] and two[1] > one[1]


def test_low_latency_nvlink_setting():
    """Off, the node's own ranks are reached through the NIC: the low-latency family slows
    down, the normal mode (which forwards over NVLink regardless) does not."""
    off = dataclasses.replace(H800, ll_nvlink=False)
    assert _times("deepep_ll", 8, 128, off)[0] > 1.5 * _times("deepep_ll", 8, 128, H800)[0]
    assert _times("deepep_ht", 8, 128, off) == _times("deepep_ht", 8, 128, H800)


def test_normal_mode_sms():
    base = _times("deepep_ht", 16, 4096, dataclasses.replace(H800, sms=24))
    fewer = _times("deepep_ht", 16, 4096, dataclasses.replace(H800, sms=12))
    more = _times("deepep_ht", 16, 4096, dataclasses.replace(H800, sms=48))
    assert fewer[0] > 1.5 * base[0] and more == base  # the links bind above the tested SMs


def test_auto_is_timed_in_the_mode_it_takes():
    """deepep_auto is planned as its low-latency half below the crossover (at most the capacity
    the plan assumes) and as its normal-mode half from it: the same times as deepep_ll and
    deepep_ht at that batch."""
    from moe_plugins.prepare_finalize.deepep_auto import PLANNED_CAPACITY

    for ep, link in ((16, H800), (8, H800)):  # crossover 71 (inside the capacity), 334 (beyond)
        c = _crossover(ep, link).tokens
        switch = min(c, PLANNED_CAPACITY + 1)
        for n, family in ((switch - 1, "deepep_ll"), (switch, "deepep_ht")):
            plan = plan_layer(CALIBRATION_MODEL, ParallelLayout(ep, 1, True), n,
                              get_backend("deepep_auto"), FP8, link=link)
            assert plan.transport is get_backend(family).transport, (ep, n)
            t = plan.recommended.time
            assert (t.dispatch_us, t.combine_us) == _times(family, ep, n, link), (ep, n)


def _crossover(ep: int, link: LinkModel, quant: QuantSpec = FP8):
    return mode_crossover(CALIBRATION_MODEL, ParallelLayout(ep, 1, True), quant,
                          get_backend("deepep_ll"), get_backend("deepep_ht"), link)


@pytest.mark.parametrize("ep,link", [(8, H800), (16, H800), (32, H800), (16, H200), (32, H200)],
                         ids=["ep8-h800", "ep16-h800", "ep32-h800", "ep16-h200", "ep32-h200"])
@pytest.mark.parametrize("quant", [FP8, QuantSpec()], ids=["fp8", "bf16"])
def test_crossover_is_the_first_batch_where_normal_mode_is_faster(ep, link, quant):
    """Each mode's own plan (no search) at batches around the crossover: the low-latency mode
    is as fast or faster below it, normal mode strictly faster from it."""
    c = _crossover(ep, link, quant).tokens
    assert c is not None and c > 1

    def normal_faster(n: int) -> bool:
        times = {b.backend: b.total_us for b in compare_backends(
            CALIBRATION_MODEL, ParallelLayout(ep, 1, True), n, quant, ["deepep_ll", "deepep_ht"],
            link=link)}
        return times["deepep_ht"] < times["deepep_ll"]

    for n in sorted({1, c // 2, c - 1}):
        assert not normal_faster(n), (n, c)
    for n in (c, c + 1, 2 * c):
        assert normal_faster(n), (n, c)


def test_threshold_is_the_crossover_within_the_capacity():
    from moe_plugins.planner.crossover import low_latency_threshold
    from moe_plugins.prepare_finalize.deepep_auto import SPEC

    modes = SPEC.call_modes
    for ep, link, capacity, rows in ((16, H800, 256, 70), (16, H800, 64, 64),
                                     (8, H800, 256, 256), (8, H800, 512, 333)):
        t = low_latency_threshold(CALIBRATION_MODEL, ep, FP8, link, modes, capacity)
        assert t.rows == rows == min(_crossover(ep, link).tokens - 1, capacity), (ep, capacity)
        assert t.capacity == capacity and "h800-cx7" in t.reason
    # a link that keeps the low-latency mode faster at every batch: the capacity
    far = dataclasses.replace(H800, rdma_gbps=400.0, sms=4)
    t = low_latency_threshold(CALIBRATION_MODEL, 16, FP8, far, modes, 256)
    assert t.crossover.tokens is None and t.rows == 256 and "up to" in t.reason
    # normal mode faster from the first token: low-latency only for empty batches (and captures)
    slow = dataclasses.replace(H800, ll_nvlink=False, rdma_gbps=0.01)
    t = low_latency_threshold(CALIBRATION_MODEL, 16, FP8, slow, modes, 256)
    assert t.crossover.tokens == 1 and t.rows == 0


def test_flashinfer_stays_in_one_nvlink_domain():
    with pytest.raises(ValueError, match="16 EP ranks span 2 domains of 8 GPUs"):
        _times("flashinfer_nvlink_two_sided", 16, 64)
    nvl72 = dataclasses.replace(H200, gpus_per_node=72)
    assert _times("flashinfer_nvlink_two_sided", 16, 64, nvl72)[0] > 0


def test_one_sided_stays_in_one_nvlink_domain_and_the_published_gb200_row():
    """flashinfer's one-sided all-to-all: refused where the EP ranks span NVLink domains (the
    comparison then says why), served inside an NVL72 rack; the model's prediction of the
    published GB200 NVL72 row (EP 8, 256 experts, BF16, 128 tokens) within a factor of 2 (the
    NVLink families are not calibrated)."""
    with pytest.raises(ValueError, match="one-sided all-to-all runs inside one NVLink domain"):
        _times("flashinfer_nvlink_one_sided", 16, 64)
    row = PUBLISHED_NVLINK_ONE_SIDED
    link = LINK_PRESETS[row.preset]
    assert link.gpus_per_node == 72 and "TensorRT-LLM" in row.source
    t = plan_layer(dataclasses.replace(CALIBRATION_MODEL, num_experts=row.num_experts),
                   ParallelLayout(row.ep, 1, True), row.tokens_per_rank,
                   get_backend("flashinfer_nvlink_one_sided"), QuantSpec(), link=link)
    assert t.transport is Transport.NVLINK_ONE_SIDED
    for predicted, published in ((t.recommended.time.dispatch_us, row.dispatch_us),
                                 (t.recommended.time.combine_us, row.combine_us)):
        assert published / 2 <= predicted <= published * 2, (predicted, published)
    ranked = compare_backends(CALIBRATION_MODEL, ParallelLayout(16, 1, True), 128, FP8,
                              link=H800)
    one_sided = next(b for b in ranked if b.backend == "flashinfer_nvlink_one_sided")
    assert not one_sided.usable and "one NVLink domain" in one_sided.reason


def test_single_node_preset_refuses_a_second_node():
    with pytest.raises(ValueError, match="16 ranks need 2 nodes of 8 GPUs; preset 'h200-nvlink'"):
        _times("deepep_ll", 16, 64, LINK_PRESETS["h200-nvlink"])


def test_presets_and_overrides():
    assert sorted(LINK_PRESETS) == ["gb200-nvl72", "h100-cx7", "h200-cx7", "h200-nvlink",
                                    "h800-cx7"]
    assert all(p.name == name for name, p in LINK_PRESETS.items())
    slow = link_preset("h800-cx7", rdma_gbps=25.0)
    assert slow.rdma_gbps == 25.0 and slow.name == "h800-cx7 (with rdma_gbps)"
    assert link_preset("h800-cx7", rdma_gbps=50.0) is H800  # the preset's own value
    assert _times("deepep_ll", 16, 128, slow)[0] > _times("deepep_ll", 16, 128)[0]
    with pytest.raises(ValueError) as e:
        link_preset("h100")
    assert str(e.value) == ("unknown link preset 'h100'; expected one of gb200-nvl72, h100-cx7, "
                            "h200-cx7, h200-nvlink, h800-cx7")


def test_comparison_ranks_the_backends():
    layout = ParallelLayout(16, 1, True)
    ranked = compare_backends(CALIBRATION_MODEL, layout, 128, FP8, link=H800)
    usable = [b for b in ranked if b.usable]
    assert [b.total_us for b in usable] == sorted(b.total_us for b in usable)
    assert not ranked[-1].usable and "one NVLink domain" in ranked[-1].reason
    low, normal = crossover_backends()
    assert get_backend(low).transport is Transport.LOW_LATENCY
    assert get_backend(normal).transport is Transport.NORMAL


# --------------------------------------------------------------------------------------------
# Batches the backends take
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ep", [2, 4, 16])
def test_auto_never_picks_a_backend_for_a_batch_it_refuses(ep):
    """At every batch, each backend the comparison finds usable takes that many tokens per
    rank (its ``token_limit``, the check its manager makes); deepep_ll beyond its limit is
    unusable, with the limit and its cause; the fastest usable one is what auto picks."""
    limit = get_backend("deepep_ll").token_limit(ep)
    assert limit.tokens == (510 if ep == 2 else 511)  # default QP depth, capacity rounding
    cfg = dataclasses.replace(CALIBRATION_MODEL, num_experts=16 * ep)
    for n in (1, 128, limit.tokens, limit.tokens + 1, 4096, 10**7):
        ranked = compare_backends(cfg, ParallelLayout(ep, 1, True), n, FP8, link=H200)
        for b in ranked:
            spec = get_backend(b.backend)
            cap = spec.token_limit(ep) if spec.token_limit is not None else None
            if cap is not None and n > cap.tokens:
                assert not b.usable and f"takes at most {cap.tokens} tokens per rank" in b.reason
                assert "NVSHMEM_QP_DEPTH=1024" in b.reason
            elif b.backend == "deepep_ll":
                assert b.usable, (n, b.reason)
        assert ranked[0].usable  # what --backend auto recommends
        if n > limit.tokens:
            assert ranked[0].backend != "deepep_ll"


def test_the_limit_is_the_managers_check(monkeypatch):
    """deepep_ll's token limit is the largest batch whose buffer (rounded up as the kernels
    need) passes the manager's own QP-depth check, at the NVSHMEM_QP_DEPTH in force."""
    from moe_plugins.all2all.deepep_ll import DeepEPLLManager
    from moe_plugins.lowlat.limits import token_capacity

    for depth, ep, want in ((1024, 4, 511), (1024, 2, 510), (1024, 1, 508), (2048, 4, 1023),
                            (300, 8, 149)):
        monkeypatch.setenv("NVSHMEM_QP_DEPTH", str(depth))
        limit = get_backend("deepep_ll").token_limit(ep)
        assert limit.tokens == want and f"NVSHMEM_QP_DEPTH={depth}" in limit.reason
        check = DeepEPLLManager._qp_depth_error
        assert check(token_capacity(want, ep), depth) is None
        assert check(token_capacity(want + 1, ep), depth) is not None
        plan_layer(CALIBRATION_MODEL, ParallelLayout(ep, 1, True), want,
                   get_backend("deepep_ll"), FP8)
        with pytest.raises(ValueError, match=f"takes at most {want} tokens per rank"):
            plan_layer(CALIBRATION_MODEL, ParallelLayout(ep, 1, True), want + 1,
                       get_backend("deepep_ll"), FP8)


def test_deepep_auto_needs_its_capacity_within_the_low_latency_limit(monkeypatch):
    """deepep_auto takes any batch (normal mode above its threshold), but its low-latency
    buffers hold the capacity the plan assumes (256): a QP depth too small for them refuses
    it, and the crossover search stops at what deepep_ll takes."""
    layout = ParallelLayout(8, 1, True)
    assert plan_layer(CALIBRATION_MODEL, layout, 10**6, get_backend("deepep_auto"), FP8,
                      link=H800).transport is Transport.NORMAL
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "400")
    with pytest.raises(ValueError, match="its mode as 'deepep_ll' with 256 tokens per rank .*"
                                         "takes at most 199 tokens per rank"):
        plan_layer(CALIBRATION_MODEL, layout, 8, get_backend("deepep_auto"), FP8, link=H800)
    c = _crossover(8, H800)  # 334 at the default depth (test_threshold_is_the_crossover...)
    assert c.tokens is None and c.limit == 199 and "NVSHMEM_QP_DEPTH=400" in c.text


def test_cli_auto_says_why_a_backend_cannot_take_the_batch():
    flags = [*_V3, "--tokens", "10000000", "--backend", "auto", "--link", "h200-cx7"]
    rows = [json.loads(ln) for ln in _ok(run_cli(*flags, "--json")).splitlines()]
    comp = {b["backend"]: b for b in rows[0]["backend_comparison"]}
    assert not comp["deepep_ll"]["usable"] and rows[0]["backend"] != "deepep_ll"
    assert "takes at most 511 tokens per rank" in comp["deepep_ll"]["reason"]
    table = _ok(run_cli(*flags))
    assert "deepep_ll                    cannot serve this layer: backend 'deepep_ll' takes at " \
           "most 511 tokens per rank over 16 EP ranks" in table
    named = run_cli(*_V3, "--tokens", "10000000", "--backend", "deepep_ll")
    assert named.returncode == 2 and "takes at most 511 tokens per rank" in named.stderr


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
_V3 = ["plan", "--model-config", str(ROOT / "examples" / "model_configs" / "deepseek-v3.json"),
       "--dp", "16", "--ep", "--quant", "fp8_block128"]


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cli_times_in_json_and_table_agree():
    flags = [*_V3, "--tokens", "128", "--backend", "deepep_ll", "--link", "h800-cx7"]
    row = json.loads(_ok(run_cli(*flags, "--json")).splitlines()[0])
    assert {"dispatch_us", "combine_us", "transport", "transport_calibrated", "link"} <= set(row)
    assert row["transport"] == "low_latency" and row["transport_calibrated"] is True
    assert row["link"]["name"] == "h800-cx7" and row["link"]["rdma_gbps"] == 50.0
    assert row["dispatch_us"] == pytest.approx(_times("deepep_ll", 16, 128)[0])
    table = _ok(run_cli(*flags))
    line = next(ln for ln in table.splitlines() if ln.startswith("LOCAL*"))
    disp, comb, total = (float(v) for v in line.split()[-4:-1])
    assert (disp, comb) == (round(row["dispatch_us"], 1), round(row["combine_us"], 1))
    assert total == round(row["time_us"]["total"], 1)
    assert "link model h800-cx7:" in table and "fitted on DeepEP V1" in table
    # a link flag overrides the preset
    slow = json.loads(_ok(run_cli(*flags, "--rdma-gbps", "25", "--json")).splitlines()[0])
    assert slow["link"]["rdma_gbps"] == 25.0 and slow["dispatch_us"] > row["dispatch_us"]
    assert slow["link"]["name"] == "h800-cx7 (with rdma_gbps)"


def test_cli_auto_names_the_fastest():
    flags = [*_V3, "--tokens", "128", "--backend", "auto", "--link", "h200-cx7"]
    rows = [json.loads(ln) for ln in _ok(run_cli(*flags, "--json")).splitlines()]
    comp = rows[0]["backend_comparison"]
    usable = [b for b in comp if b["usable"]]
    assert [b["total_us"] for b in usable] == sorted(b["total_us"] for b in usable)
    assert all(r["backend"] == usable[0]["backend"] for r in rows)
    table = _ok(run_cli(*flags))
    best, nxt = usable[0], usable[1]
    gap = nxt["total_us"] - best["total_us"]
    assert (f"fastest: {best['backend']}, {gap:.1f} us per layer "
            f"({(nxt['total_us'] / best['total_us'] - 1) * 100:.0f}%) ahead of {nxt['backend']}"
            in table)


def test_cli_sweep_prints_the_curve_and_crossover():
    flags = [*_V3, "--link", "h800-cx7", "--backend", "deepep_ll", "--sweep-tokens",
             "1,8,64,128,511,4096"]
    out = json.loads(_ok(run_cli(*flags, "--json")))
    cross = out["crossover"]
    counts = [p["tokens_per_dp_group"] for p in out["sweep"]]
    totals = {b: [next(x["total_us"] for x in p["backends"] if x["backend"] == b)
                  for p in out["sweep"][:-1]] for b in (cross["low_latency"], cross["normal"])}
    assert all(b >= a for seq in totals.values() for a, b in zip(seq, seq[1:]))
    i = next(i for i, n in enumerate(counts) if n >= cross["tokens_per_dp_group"])
    ll, ht = totals[cross["low_latency"]], totals[cross["normal"]]
    assert ht[i] <= ll[i] and ht[i - 1] > ll[i - 1]
    # the batch a deepep_auto layer of this shape built with this link switches at (tp 1)
    from moe_plugins.planner.crossover import low_latency_threshold
    from moe_plugins.prepare_finalize.deepep_auto import SPEC

    layer = low_latency_threshold(CALIBRATION_MODEL, 16, FP8, H800, SPEC.call_modes, 256)
    assert cross["tokens_per_dp_group"] == cross["rows_per_rank"] == layer.rows + 1 == 71
    assert out["thresholds"] == [{"backend": "deepep_auto", "rows_per_rank": 70,
                                  "capacity": 256, "text": layer.reason}]
    table = _ok(run_cli(*flags))
    assert cross["text"] in table
    assert "deepep_auto built with this link: low-latency up to 70 tokens per rank" in table
    # the table's 511-token line holds the same totals; at 4096 deepep_ll cannot take the batch
    line = next(ln for ln in table.splitlines() if ln.strip().startswith("511"))
    assert [float(v) for v in line.split()[1:]] == [
        round(next(x["total_us"] for x in out["sweep"][-2]["backends"] if x["backend"] == b), 1)
        for b in sorted(totals)]
    last = next(ln for ln in table.splitlines() if ln.strip().startswith("4096"))
    assert last.split()[-1] == "-"
    assert ("deepep_ll from 4096 tokens per DP group: backend 'deepep_ll' takes at most 511 "
            "tokens per rank") in table


@pytest.mark.parametrize("args,message", [
    (["--link", "h800"], "argument --link: unknown link preset 'h800'; expected one of "
                         "gb200-nvl72, h100-cx7, h200-cx7, h200-nvlink, h800-cx7"),
    (["--sweep-tokens", "8,4"], "argument --sweep-tokens: expected increasing token counts"),
    (["--sweep-tokens", "1,8", "--tokens", "8"], "--sweep-tokens sets the tokens of every DP"),
    (["--link", "h200-nvlink"], "16 ranks need 2 nodes of 8 GPUs; preset 'h200-nvlink' has 1"),
])
def test_cli_time_model_errors(args, message):
    proc = run_cli(*_V3, *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_ep1_rows_use_one_gpu_and_no_links():
    """At EP 1 every message is a self-send: the prediction is the fixed costs alone, the same
    at every token count (the measured round trips grow with tokens: docs/planner.md)."""
    assert len({r[3] for r in ep1_rows()}) == 1


def test_every_transport_family_has_a_time_model():
    """A backend's ``transport`` is one of Transport's members, and the planner times each
    (docs/adding_a_backend.md: a new family comes with its time function); anything else is
    refused, not timed as another family."""
    from moe_plugins.planner.transport_time import all_to_all_us

    rows, node_rows = [[0, 4], [4, 0]], [[4], [4]]  # 2 ranks of one node
    for transport in Transport:
        for phase in ("dispatch", "combine"):
            assert all_to_all_us(transport, phase, rows, 2048, H800, node_rows) > 0, transport
    with pytest.raises(ValueError, match="no time model for transport 'pigeon'"):
        all_to_all_us("pigeon", "dispatch", rows, 2048, H800)  # type: ignore[arg-type]


def test_a_preset_with_an_unknown_field_is_a_type_error_naming_it():
    with pytest.raises(TypeError) as e:
        link_preset("h800-cx7", bogus=1)
    assert "link_preset('h800-cx7') got unknown LinkModel field(s) bogus" in str(e.value)
    assert "rdma_gbps" in str(e.value)
