"""benchmarks/host_overhead.py keeps running: its CPU mode, briefly (a smoke test; the numbers
are not checked, only that every path ran and the JSON rows have the documented keys)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_mode_runs_every_path(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--device", "cpu",
         "--tokens", "8", "--samples", "2", "--batch", "2", "--call-timeout-s", "60",
         "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(out.read_text())
    conditions, rows = written["conditions"], written["rows"]
    assert conditions["benchmark"] == "benchmarks/host_overhead.py"
    assert conditions["command"].endswith(f"--call-timeout-s 60 --json {out}")
    assert conditions["versions"]["deep_ep"] == "stand-in benchmarks/zero_cost_deep_ep.py"
    assert rows and all(set(r) == {"backend", "path", "mode", "tokens", "quant", "us"}
                        for r in rows)
    assert all(r["mode"] == "eager" and r["tokens"] == 8 and r["us"] > 0 for r in rows)
    ran = {(r["backend"], r["path"], r["quant"]) for r in rows}
    vllm = importlib.util.find_spec("vllm") is not None
    for quant in ("bf16", "fp8"):
        for path in ("raw", "ours") + (("adapter", "adapter_bound", "vllm_in_tree",
                                        "adapter_shared_bound") if vllm else ()):
            assert ("deepep_ll", path, quant) in ran
    for path in ("raw", "ours") + (("adapter", "adapter_bound") if vllm else ()):
        assert ("torch", path, "bf16") in ran
    assert "ours/raw" in done.stdout  # the table with its ratios was printed
    if vllm:
        assert "bound/off" in done.stdout


def test_a_bad_call_bound_is_refused_before_anything_runs():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--device", "cpu",
         "--call-timeout-s", "0.01"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "below the floor of 0.5 s" in done.stderr, done.stderr
