"""The one-GPU EP matrix (tests/gpu/ep_matrix.py) on CPU, with the emulated libraries: the same
rank functions and harness the GPU runs use, reduced to a few small worlds (2-4 ranks) so it
fits the normal suite; the whole matrix on CPU is ``python -m tests.gpu.ep_matrix --device cpu``
(or ``DEVICE=cpu bash scripts/gpu/ep_matrix.sh``). Also: the two-process DeepEP normal-mode rank
function of tests/gpu/test_deepep_ht_gpu.py on the emulated deep_ep, the matrix's coverage and
its markdown table."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from tests.backend_lists import NORMAL_MODE
from tests.gpu import deepep_ht_ranks
from tests.gpu.ep_harness import run_world, verdict
from tests.gpu.ep_matrix import (STATUSES, jobs, main, merge_records, rows_to_markdown,
                                 run_matrix)

pytestmark = pytest.mark.multirank

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_reduced_matrix_passes_on_cpu(tmp_path):
    record, runs = tmp_path / "ep.json", tmp_path / "runs.json"
    rows = run_matrix("cpu", scale="reduced", record=record, runs=runs,
                      skip=() if HAS_VLLM else ("vllm/",), log=lambda line: None)
    assert json.loads(record.read_text()) == rows
    assert all(r["from_run"]["commit"] for r in rows)  # the code that ran each row
    bad = [r for r in rows if r["status"] != "passed"]
    assert not bad, rows_to_markdown(bad)
    paths = {(r["path"], r["backend"]) for r in rows}
    assert ("layer", "deepep_ll") in paths and ("layer", "torch") in paths
    if HAS_VLLM:
        assert ("vllm", "deepep_ll") in paths
    cases = {r["case"] for r in rows}
    assert {"ragged", "auto-ll", "auto-normal", "auto-link", "sp", "mask", "unmask",
            "fault-kill", "fault-hang-watchdog"} <= cases
    hang = next(r for r in rows if r["case"] == "fault-hang-watchdog")
    # rank 0 ended by the 3 s watchdog, not by gloo's 20 s timeout
    took = re.search(r"rank 0: CallTimeoutError after ([\d.]+) s", hang["detail"])
    assert took and 3.0 <= float(took.group(1)) < 5.0, hang["detail"]
    assert any(r["quant"] == "ue8m0" for r in rows)
    for rec in json.loads(runs.read_text()):
        assert rec["stray"] == [] and not rec["timed_out"], rec["name"]
        for rank in rec["ranks"]:
            assert rank["steps"], f"{rec['name']} rank {rank['rank']} reported no step"


@pytest.mark.parametrize("backend", NORMAL_MODE)  # from the registry (tests/backend_lists.py)
def test_two_process_normal_mode_rank_function_on_cpu(backend):
    """What tests/gpu/test_deepep_ht_gpu.py runs on the GPU, on the emulated deep_ep."""
    run = run_world(deepep_ht_ranks.run_ht, 2, backend, "cpu", device="cpu", timeout_s=120)
    verdict(run, backend)
    deepep_ht_ranks.check_results(backend, run.values)
    assert [s[0] for s in run.outcomes[0].steps][-1] == "teardown"


def test_the_full_matrix_covers_the_issue():
    """Every backend at the EP sizes the issue names, both halves, bounds inside one call."""
    full = jobs("cuda")
    names = [j.name for j in full]
    assert len(names) == len(set(names))
    layer = {(r[0], j.world) for j in full if j.path == "layer" and j.kind == "rows"
             for r in j.rows}
    want = {("deepep_ll", e) for e in (2, 4, 8)} | {("deepep_ht", e) for e in (2, 4, 8)} \
        | {("deepep_auto", e) for e in (2, 4, 8)} | {("nixl_ep", 2), ("nixl_ep", 4)} \
        | {("flashinfer_nvlink_two_sided", 2), ("flashinfer_nvlink_two_sided", 4)} \
        | {("flashinfer_nvlink_one_sided", 2), ("flashinfer_nvlink_one_sided", 4)} \
        | {("torch", 4)}
    assert want <= layer, want - layer
    # deepep_auto built with a link, both quants, at every EP size of the matrix
    assert {(e, q) for e in (2, 4, 8) for q in ("bf16", "fp8_block128")} <= {
        (j.world, r[2]) for j in full for r in j.rows if r[:2] == ("deepep_auto", "auto-link")}
    vllm = {(r[0], j.world) for j in full if j.path == "vllm" for r in j.rows}
    assert {(b, e) for b in ("deepep_ll", "deepep_ht", "nixl_ep", "flashinfer_nvlink_one_sided")
            for e in (2, 4)} <= vllm
    # ours beside vLLM's in-tree one-sided class: in half A, whose set-up has vLLM's kit and
    # flashinfer (scripts/gpu/ep_matrix.sh); on CPU tests/vllm_glue/test_vllm_one_sided_in_tree.py
    assert {j.half for j in full if j.path == "vllm"
            and j.backend == "flashinfer_nvlink_one_sided"} == {"A"}
    faults = {(j.rows[0][0], j.rows[0][1]) for j in full if j.kind == "fault"}
    assert {("deepep_ll", "fault-refuse"), ("deepep_ll", "fault-kill"),
            ("deepep_ll", "fault-kill-watchdog"), ("deepep_ht", "fault-kill-watchdog"),
            ("deepep_ht", "fault-kill-before-watchdog"),
            ("deepep_auto", "fault-kill-before-watchdog"),
            ("deepep_auto", "fault-refuse"), ("flashinfer_nvlink_two_sided", "fault-refuse")} <= faults
    assert {j.half for j in full} == {"A", "B"}
    survive = {(j.rows[0][0], j.rows[0][1]) for j in full if j.name.startswith("survive/")}
    assert survive == {(b, f"survive-{f}") for b in ("deepep_ll", "nixl_ep")
                       for f in ("kill", "stop")}  # a peer's loss costs one call
    assert all(j.bound_s <= 600 for j in full)
    rows = [(j.name, c) for j in full for c in j.rows]
    assert len(rows) == len(set(rows))
    cases = {c[1] for j in full for c in j.rows}
    assert {"eplb", "rebalance", "mask", "unmask", "row_scatter", "sp", "ours=in-tree", "dbo",
            "graph"} <= cases
    # our layer captured in a CUDA graph: deepep_auto (low latency) and deepep_ht (refuses)
    graphed = {r[0] for j in full if j.path == "layer" for r in j.rows if r[1] == "graph"}
    assert {"deepep_ll", "deepep_ht", "deepep_auto"} <= graphed
    assert not any(r[1] == "graph" for j in jobs("cpu") if j.path == "layer" for r in j.rows)
    masked = {r[0] for j in full for r in j.rows if r[1] == "mask"}
    assert masked == {"deepep_ll", "nixl_ep", "flashinfer_nvlink_one_sided"}
    quants = {(r[0], r[2]) for j in full for r in j.rows}
    assert {("deepep_ll", "ue8m0"), ("nixl_ep", "ue8m0"), ("deepep_ht", "fp8_block128")} <= quants


def test_record_as_markdown(tmp_path, capsys):
    rows = [dict(backend="deepep_ll", path="layer", ep=4, tp=1, quant="bf16", case="ragged",
                 status="passed", max_rel_err=0.0061, detail="4 ranks | within", job="j"),
            dict(backend="nixl_ep", path="vllm", ep=2, tp=1, quant="bf16", case="graph",
                 status="not_run", max_rel_err=None, detail="not started", job="k")]
    table = rows_to_markdown(rows)
    assert table.splitlines()[0].startswith(
        "| path | vllm | backend | ep | tp | quant | case | status")
    line = "| layer |  | deepep_ll | 4 | 1 | bf16 | ragged | passed | 6.10e-03 | 4 ranks \\| within |"
    assert line in table
    assert table.splitlines()[-1] == "1 passed, 1 not_run (2 rows)"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(rows[:1]))
    b.write_text(json.dumps(rows[1:]))
    out = tmp_path / "merged.json"
    assert main(["--merge", str(a), str(b), "-o", str(out)]) == 0
    # a record older than from_run: each row says which record it came from, commit unknown
    assert json.loads(out.read_text()) == [
        dict(rows[0], from_run={"commit": "unknown", "record": "a.json"}, vllm="unknown"),
        dict(rows[1], from_run={"commit": "unknown", "record": "b.json"}, vllm="unknown")]
    assert main(["--markdown", str(out)]) == 0
    # the merged rows say vllm "unknown" where the record did not say
    assert capsys.readouterr().out.strip() == table.replace(
        "| vllm |  | nixl_ep", "| vllm | unknown | nixl_ep") + "\n\nCommits: unknown: 2 rows"
    assert set(STATUSES) == {"passed", "failed", "not_run", "refused"}


def test_merge_keeps_earlier_rows_only_where_the_new_run_has_none(tmp_path, capsys):
    """Rows of an earlier record are kept where the merged records lack them, and say so in
    from_run (commit, note), never in hand-written detail."""
    def row(case: str, commit: str, status: str = "passed") -> dict:
        return dict(backend="deepep_ll", path="layer", ep=4, tp=1, quant="bf16", case=case,
                    status=status, max_rel_err=None, detail=f"{case} at {commit}", job="j",
                    from_run={"commit": commit})

    new_a, new_b = [row("ragged", "bbbbbbb")], [row("fault-refuse", "bbbbbbb")]
    old = [row("ragged", "aaaaaaa", "failed"), row("fault-kill", "aaaaaaa", "failed")]
    paths = {}
    for name, rows in (("A.json", new_a), ("B.json", new_b), ("old.json", old)):
        paths[name] = tmp_path / name
        paths[name].write_text(json.dumps(rows))
    out = tmp_path / "merged.json"
    assert main(["--merge", str(paths["A.json"]), str(paths["B.json"]), "--earlier",
                 str(paths["old.json"]), "-o", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [(r["case"], r["status"], r["from_run"]["commit"]) for r in merged] == [
        ("ragged", "passed", "bbbbbbb"), ("fault-refuse", "passed", "bbbbbbb"),
        ("fault-kill", "failed", "aaaaaaa")]
    assert merged[0]["from_run"] == {"commit": "bbbbbbb"}  # the commit says where it came from
    kept = merged[2]
    assert kept["detail"] == "fault-kill at aaaaaaa"  # the row itself is unchanged
    assert kept["from_run"] == {"commit": "aaaaaaa",
                                "note": "kept from an earlier record: not re-run at commit "
                                        "bbbbbbb"}
    assert main(["--markdown", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "Commits: bbbbbbb: 2 rows; aaaaaaa: 1 rows (kept from an earlier record: not re-run at "
        "commit bbbbbbb)")


def test_merge_keeps_vllms_path_per_release(tmp_path):
    """vLLM's path of two releases: both kept, each row naming its release; an earlier row of
    unknown release gives way to a newer row of the same case, whatever its release; rows of
    our layer path are one case whatever vLLM was installed."""
    def row(path: str, vllm, commit: str, case: str = "ours=in-tree") -> dict:
        r = dict(backend="deepep_ll", path=path, ep=2, tp=1, quant="bf16", case=case,
                 status="passed", max_rel_err=None, detail=commit, job="j",
                 from_run={"commit": commit})
        if vllm is not None:
            r["vllm"] = vllm
        return r

    v34 = [row("vllm", "vllm 0.34.0", "c34"), row("layer", "vllm 0.34.0", "c34", "ragged")]
    v33 = [row("vllm", "vllm 0.33.0", "c33")]
    old = [row("vllm", None, "old"), row("vllm", None, "old", "dbo"),
           row("layer", None, "old", "ragged")]
    merged = merge_records([("34.json", v34), ("33.json", v33)], [("old.json", old)])
    got = sorted((r["path"], r["case"], r["vllm"], r["from_run"]["commit"]) for r in merged)
    assert got == [("layer", "ragged", "vllm 0.34.0", "c34"),
                   ("vllm", "dbo", "unknown", "old"),
                   ("vllm", "ours=in-tree", "vllm 0.33.0", "c33"),
                   ("vllm", "ours=in-tree", "vllm 0.34.0", "c34")]


def test_a_fault_row_whose_survivors_did_not_end_is_failed_and_carries_its_settings():
    """A fault job exists to show that the survivors end: one that did not end within the
    job's bound is ``failed`` (never an expected failure), and the row says what the fault ran
    under (victim, fault, bounds, timeouts)."""
    from types import SimpleNamespace

    from tests.gpu.ep_matrix import _fault_job, _fault_row

    job = _fault_job("deepep_ll", "kill", "B", "cuda", margin_s=30, call_timeout_s=15)
    survivor = SimpleNamespace(rank=0, status="timed_out", cause=None, results=[],
                               describe=lambda: "rank 0 timed out at step 'call 2'")
    victim = SimpleNamespace(rank=1, status="died", cause="killed by signal SIGKILL",
                             results=[], describe=lambda: "rank 1 died")
    run = SimpleNamespace(bounded=object(), timed_out=True, stray=[],
                          outcomes=[survivor, victim])
    (row,) = _fault_row(job, run)
    assert row["status"] == "failed" and "ranks [0] did not end within 45 s" in row["detail"]
    assert row["settings"] == {"victim": 1, "fault": "kill", "tokens": 8, "prefill_hint": False,
                               "call_timeout_s": 15,
                               "first_call_timeout_s": 600.0, "pg_timeout_s": 300.0,
                               "library_timeout_s": 100.0, "job_bound_s": 45.0}
    assert "[victim=1, fault=kill, tokens=8, prefill_hint=False, call_timeout_s=15" in rows_to_markdown([row])


def test_merge_names_the_gpu_of_each_run(tmp_path, capsys):
    """A run names its GPU in from_run; a record written before that gets it from --gpu-of,
    and the table's last line says which commit ran on which GPU."""
    def row(case: str, run: dict) -> dict:
        return dict(backend="torch", path="layer", ep=2, tp=1, quant="bf16", case=case,
                    status="passed", max_rel_err=None, detail="", job="j", from_run=run)

    paths = {}
    for name, rows in (("new.json", [row("ragged", {"commit": "bbbbbbb"})]),
                       ("named.json", [row("eplb", {"commit": "ccccccc", "gpu": "GPU X"})]),
                       ("old.json", [row("sp", {"commit": "aaaaaaa"})])):
        paths[name] = tmp_path / name
        paths[name].write_text(json.dumps(rows))
    out = tmp_path / "merged.json"
    assert main(["--merge", str(paths["new.json"]), str(paths["named.json"]), "--earlier",
                 str(paths["old.json"]), "--gpu-of", "new.json=GPU Y", "--gpu-of",
                 f"{paths['named.json']}=GPU Z", "--gpu-of", "old.json=GPU W",
                 "-o", str(out)]) == 0
    merged = {r["case"]: r["from_run"] for r in json.loads(out.read_text())}
    assert merged["ragged"] == {"commit": "bbbbbbb", "gpu": "GPU Y"}
    assert merged["eplb"] == {"commit": "ccccccc", "gpu": "GPU X"}  # what the run said stays
    assert merged["sp"]["gpu"] == "GPU W"
    assert main(["--markdown", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(
        "Commits: bbbbbbb on GPU Y: 1 rows; ccccccc on GPU X: 1 rows; aaaaaaa on GPU W: 1 rows")
    with pytest.raises(SystemExit):
        main(["--merge", str(paths["new.json"]), "--gpu-of", "new.json", "-o", str(out)])


def test_merge_keeps_flashinfers_rows_per_release(tmp_path):
    """flashinfer's rows name the release that ran (its two-sided API differs between
    releases): rows of two releases are both kept, and the table names the release."""
    def row(library: str, commit: str) -> dict:
        return dict(backend="flashinfer_nvlink_two_sided", path="layer", ep=2, tp=1,
                    quant="bf16", case="ragged", status="passed", max_rel_err=None, detail="",
                    job="j", from_run={"commit": commit}, library=library)

    merged = merge_records([("new.json", [row("flashinfer-python 0.7.4", "b")])],
                           [("old.json", [row("flashinfer-python 0.7.2.post1", "a"),
                                          row("flashinfer-python 0.7.4", "a")])])
    assert sorted((r["library"], r["from_run"]["commit"]) for r in merged) == [
        ("flashinfer-python 0.7.2.post1", "a"), ("flashinfer-python 0.7.4", "b")]
    assert "| flashinfer_nvlink_two_sided (flashinfer-python 0.7.4) | 2 |" in \
        rows_to_markdown(merged)


def test_merge_names_a_version_the_run_could_not_read(tmp_path):
    """A run that found a library's distribution without METADATA writes NO_VERSION, never a
    made-up one; --version-of names it at merge and keeps the run's value in from_run.stamped,
    and refuses to replace a version the run did read."""
    from tests.gpu.ep_matrix import NO_VERSION

    def row(case: str, nixl: str) -> dict:
        return dict(backend="nixl_ep", path="layer", ep=2, tp=1, quant="bf16", case=case,
                    status="passed", max_rel_err=None, detail="", job="j",
                    from_run={"commit": "aaaaaaa", "versions": {"nixl": nixl}})

    unread, read = tmp_path / "unread.json", tmp_path / "read.json"
    unread.write_text(json.dumps([row("ragged", f"nixl-cu13 {NO_VERSION}")]))
    read.write_text(json.dumps([row("eplb", "nixl-cu13 1.5.1")]))
    out = tmp_path / "merged.json"
    assert main(["--merge", str(unread), str(read), "--version-of",
                 "unread.json=nixl=nixl-cu13 1.5.1", "-o", str(out)]) == 0
    merged = {r["case"]: r["from_run"] for r in json.loads(out.read_text())}
    assert merged["ragged"]["versions"] == {"nixl": "nixl-cu13 1.5.1"}
    assert merged["ragged"]["stamped"] == {"nixl": f"nixl-cu13 {NO_VERSION}"}
    assert merged["eplb"] == {"commit": "aaaaaaa", "versions": {"nixl": "nixl-cu13 1.5.1"}}
    with pytest.raises(SystemExit):  # the run read 1.5.1: nothing may replace it
        main(["--merge", str(read), "--version-of", "read.json=nixl=nixl-cu13 1.5.2",
              "-o", str(out)])
    with pytest.raises(SystemExit):
        main(["--merge", str(unread), "--version-of", "unread.json=nixl", "-o", str(out)])


def test_a_run_says_when_a_distribution_names_no_version(tmp_path, monkeypatch):
    """A dist-info without METADATA (a stripped wheel) is recorded as found without a version,
    not as 'None'."""
    from tests.gpu.ep_matrix import NO_VERSION, current_versions

    (tmp_path / "nixl_cu13-1.5.1.dist-info" / "licenses").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert current_versions("cuda")["nixl"] == f"nixl-cu13 {NO_VERSION}"
    (tmp_path / "nixl_cu13-1.5.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nixl-cu13\nVersion: 1.5.1\n")
    assert current_versions("cuda")["nixl"] == "nixl-cu13 1.5.1"


def test_a_run_stamps_its_rows_with_this_checkouts_commit_and_a_gpu_runs_versions(
        tmp_path, monkeypatch):
    """Every row names the commit it ran at (this checkout's, never "unknown"), and a GPU run's
    rows the library versions it ran (the stack table reads them from from_run.versions).
    Nothing is started (no budget): the rows are stamped all the same. The GPU's name is the
    one thing given here (this host has none); the versions are read as on a GPU host."""
    import subprocess

    import torch

    import tests.gpu.ep_matrix as ep_matrix
    from tests.checks import ROOT

    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()
    rows = run_matrix("cpu", only=["torch"], budget_s=0, log=lambda line: None)
    assert rows and all(r["from_run"]["commit"].split("+")[0] == head for r in rows), rows[0]
    assert all("versions" not in r["from_run"] for r in rows)  # a CPU run ran the emulations
    monkeypatch.setattr(ep_matrix, "current_gpu", lambda device: "GPU X")
    rows = run_matrix("cuda", only=["torch"], budget_s=0, log=lambda line: None)
    assert rows and all(r["status"] == "not_run" for r in rows)
    for r in rows:
        assert r["from_run"]["commit"].split("+")[0] == head, r["from_run"]
        assert r["from_run"]["gpu"] == "GPU X"
        assert r["from_run"]["versions"]["torch"] == torch.__version__, r["from_run"]
