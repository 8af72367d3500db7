"""The all-to-all time model: its residuals on the published rows it was fitted on, how it
behaves away from them (tokens, links, SMs, transports), the presets, docs/planner.md's tables,
and the plan CLI's time output."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from moe_plugins.layout import ParallelLayout
from moe_plugins.planner.calibration import (CALIBRATION_MODEL, CALIBRATION_ROWS, predict_us,
                                             published_us, residuals)
from moe_plugins.planner.compare import (compare_backends, crossover_backends, crossover_tokens,
                                         sweep_tokens)
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.plan import plan_layer
from moe_plugins.planner.presets import LINK_PRESETS, link_preset
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
@pytest.mark.parametrize("row", CALIBRATION_ROWS, ids=lambda r: r.label.replace(" ", "-"))
def test_calibration_row_within_ten_percent(row):
    pub, pred = published_us(row), predict_us(row)
    assert abs(pred / pub - 1) <= 0.10, (row, pub, pred)


def test_bandwidth_rows_convert_as_deepep_counts():
    """A published bandwidth turns into the time that moves DeepEP's counted bytes at it."""
    intranode = next(r for r in CALIBRATION_ROWS if r.unit == "GB/s" and r.ep == 8)
    hits = 8 * (1 - (224 * 223 * 222 * 221 * 220 * 219 * 218 * 217)
                / (256 * 255 * 254 * 253 * 252 * 251 * 250 * 249))
    assert published_us(intranode) == pytest.approx(
        4096 * hits * 7168 * (1 + 4 / 128) / (intranode.value * 1e3))


def _doc_rows(heading: str) -> list[list[str]]:
    """The cells of the markdown table under ``heading`` in docs/planner.md."""
    text = DOC.read_text()
    section = text.split(heading, 1)[1]
    lines = [ln for ln in section.split("\n\n", 2)[1].splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_docs_calibration_table_is_the_models():
    rows = _doc_rows("## Calibration rows")
    want = [[r.label, f"{r.value:g} {r.unit}", f"{pub:.0f}", f"{pred:.0f}", f"{res * 100:+.1f}%"]
            for r, pub, pred, res in residuals()]
    assert rows == want


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
    times = [_times(backend, ep, n, link) for n in TOKENS]
    for phase in (0, 1):
        seq = [t[phase] for t in times]
        assert all(b >= a for a, b in zip(seq, seq[1:])), (phase, seq)
        assert seq[-1] > 2 * seq[0]  # bytes matter at 4096 tokens


@pytest.mark.parametrize("backend", ["deepep_ll", "deepep_ht", "torch"])
def test_rdma_is_slower_than_nvlink(backend):
    """The same 16 ranks in one NVLink domain, then on two nodes."""
    one = _times(backend, 16, 512, dataclasses.replace(H200, gpus_per_node=16))
    two = _times(backend, 16, 512, H200)
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
    from prepare_finalize.deepep_auto import PLANNED_CAPACITY

    for n, family in ((PLANNED_CAPACITY, "deepep_ll"), (PLANNED_CAPACITY + 1, "deepep_ht")):
        plan = plan_layer(CALIBRATION_MODEL, ParallelLayout(16, 1, True), n,
                          get_backend("deepep_auto"), FP8, link=H800)
        assert plan.transport is get_backend(family).transport
        assert plan.recommended.time.combine_us == pytest.approx(_times(family, 16, n)[1])


def test_flashinfer_stays_in_one_nvlink_domain():
    with pytest.raises(ValueError, match="16 EP ranks span 2 domains of 8 GPUs"):
        _times("flashinfer_nvlink_two_sided", 16, 64)
    nvl72 = dataclasses.replace(H200, gpus_per_node=72)
    assert _times("flashinfer_nvlink_two_sided", 16, 64, nvl72)[0] > 0


def test_single_node_preset_refuses_a_second_node():
    with pytest.raises(ValueError, match="16 ranks need 2 nodes of 8 GPUs; preset 'h200-nvlink'"):
        _times("deepep_ll", 16, 64, LINK_PRESETS["h200-nvlink"])


def test_presets_and_overrides():
    assert sorted(LINK_PRESETS) == ["h100-cx7", "h200-cx7", "h200-nvlink", "h800-cx7"]
    assert all(p.name == name for name, p in LINK_PRESETS.items())
    slow = link_preset("h800-cx7", rdma_gbps=25.0)
    assert slow.rdma_gbps == 25.0 and slow.name == "h800-cx7 (with rdma_gbps)"
    assert link_preset("h800-cx7", rdma_gbps=50.0) is H800  # the preset's own value
    assert _times("deepep_ll", 16, 128, slow)[0] > _times("deepep_ll", 16, 128)[0]
    with pytest.raises(ValueError) as e:
        link_preset("h100")
    assert str(e.value) == ("unknown link preset 'h100'; expected one of h100-cx7, h200-cx7, "
                            "h200-nvlink, h800-cx7")


def test_comparison_and_crossover():
    layout = ParallelLayout(16, 1, True)
    ranked = compare_backends(CALIBRATION_MODEL, layout, 128, FP8, link=H800)
    usable = [b for b in ranked if b.usable]
    assert [b.total_us for b in usable] == sorted(b.total_us for b in usable)
    assert not ranked[-1].usable and "one NVLink domain" in ranked[-1].reason
    low, normal = crossover_backends()
    assert get_backend(low).transport is Transport.LOW_LATENCY
    assert get_backend(normal).transport is Transport.NORMAL
    counts = [1, 8, 64, 128, 512, 4096]
    points = sweep_tokens(CALIBRATION_MODEL, layout, counts, FP8, [low, normal], link=H800)
    at, text = crossover_tokens(counts, points, low, normal)
    diff = [{b.backend: b.total_us for b in row}[normal] - {b.backend: b.total_us
                                                           for b in row}[low] for row in points]
    i = next(i for i, d in enumerate(diff) if d <= 0)
    assert diff[i - 1] > 0 and counts[i - 1] < at <= counts[i]
    assert f"{at:.0f} tokens" in text
    # a sweep that ends before it: the low-latency side wins throughout
    short = crossover_tokens(counts[:i], points[:i], low, normal)
    assert short[0] is None and "stays faster" in short[1]


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
             "1,8,64,128,512,4096"]
    out = json.loads(_ok(run_cli(*flags, "--json")))
    cross = out["crossover"]
    counts = [p["tokens_per_dp_group"] for p in out["sweep"]]
    totals = {b: [next(x["total_us"] for x in p["backends"] if x["backend"] == b)
                  for p in out["sweep"]] for b in (cross["low_latency"], cross["normal"])}
    assert all(b >= a for seq in totals.values() for a, b in zip(seq, seq[1:]))
    i = next(i for i, n in enumerate(counts) if n >= cross["tokens_per_dp_group"])
    ll, ht = totals[cross["low_latency"]], totals[cross["normal"]]
    assert ht[i] <= ll[i] and ht[i - 1] > ll[i - 1]
    table = _ok(run_cli(*flags))
    assert cross["text"] in table
    # the table's 4096-token line holds the same totals
    last = next(ln for ln in table.splitlines() if ln.strip().startswith("4096"))
    assert [float(v) for v in last.split()[1:]] == [
        round(next(x["total_us"] for x in out["sweep"][-1]["backends"] if x["backend"] == b), 1)
        for b in sorted(totals)]


@pytest.mark.parametrize("args,message", [
    (["--link", "h800"], "argument --link: unknown link preset 'h800'; expected one of "
                         "h100-cx7, h200-cx7, h200-nvlink, h800-cx7"),
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
