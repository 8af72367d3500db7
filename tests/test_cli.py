"""The moe-plugins command line, run as a user runs it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent / "moe-plugins"


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout)


def test_list_json_has_the_documented_keys():
    res = _run("list", "--json")
    assert res.returncode == 0, res.stderr
    torch_row = next(r for r in json.loads(res.stdout) if r["name"] == "torch")
    assert {"name", "usable", "reason", "ep_dp", "dp", "tp", "sp", "placements",
            "quants"} <= set(torch_row)
    assert torch_row["usable"] is True and torch_row["reason"] is None
    assert torch_row["placements"] is True  # round-robin and EPLB placements


@pytest.mark.multirank
def test_demo_ep_times_tp_uses_row_scatter_with_one_collective():
    res = _run("demo", "--ranks", "4", "--tp", "2", "--ep", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["strategy"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert set(rows) == {"ROW_SCATTER_ALLREDUCE", "SP_ALLGATHER", "GATHER_PLUS_ALLREDUCE"}
    row = rows["ROW_SCATTER_ALLREDUCE"]
    assert row["default"] is True and row["tp_collectives"] == 1
    assert rows["GATHER_PLUS_ALLREDUCE"]["tp_collectives"] == 2
    assert row["max_abs_err"] < 1e-3
    # 8 tokens per DP group over tp=2: each rank owns 4 rows x topk 2
    assert row["dispatched_pairs"] == [8, 8, 8, 8]
    assert {"strategy", "max_abs_err", "tp_collectives", "dispatched_pairs", "dispatched_bytes",
            "ms_per_layer"} <= set(row)


def test_demo_rejects_a_layout_that_does_not_split():
    res = _run("demo", "--ranks", "3", "--tp", "2", "--ep")
    assert res.returncode == 2
    assert "--ranks 3 is not a multiple of --tp 2" in res.stderr


def test_demo_rejects_dp_without_ep():
    res = _run("demo", "--ranks", "2", "--tp", "1")
    assert res.returncode == 2 and "enable expert parallelism" in res.stderr
