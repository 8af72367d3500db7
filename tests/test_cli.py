"""The moe-plugins command line, run as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checks import CLI as BIN
from tests.checks import ROOT, cli_env, run_cli


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=timeout)


def test_the_cli_under_test_is_this_checkouts():
    """What _run starts imports this checkout's moe_plugins, not the one the venv has installed
    (an editable install of another worktree)."""
    res = subprocess.run([sys.executable, "-c", "import moe_plugins; print(moe_plugins.__file__)"],
                         capture_output=True, text=True, env=cli_env(), cwd="/", timeout=60)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).resolve().is_relative_to(ROOT)


def test_list_json_has_the_documented_keys():
    res = _run("list", "--json")
    assert res.returncode == 0, res.stderr
    torch_row = next(r for r in json.loads(res.stdout) if r["name"] == "torch")
    assert {"name", "usable", "reason", "ep_dp", "dp", "tp", "sp", "placements",
            "quants"} <= set(torch_row)
    assert torch_row["usable"] is True and torch_row["reason"] is None
    assert torch_row["placements"] is True  # round-robin and EPLB placements


def test_list_markdown_is_one_row_per_backend_from_the_registry():
    """`list --markdown`: README's which-backend table, the same whatever this machine has."""
    res = _run("list", "--markdown")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("| backend | pick it for | needs |") and lines[1].startswith("|---")
    names = [line.split("|")[1].strip().strip("`") for line in lines[2:]]
    assert {"torch", "deepep_ll", "nixl_ep"} <= set(names)
    torch_row = lines[2 + names.index("torch")]
    assert "torch only" in torch_row and "SP" in torch_row and "nvfp4" in torch_row
    assert "usable" not in res.stdout  # no column depends on the machine
    both = _run("list", "--markdown", "--json")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


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
    assert {"strategy", "ok", "max_abs_err", "tp_collectives", "dispatched_pairs",
            "dispatched_bytes", "ms_per_layer"} <= set(row)
    assert all(r["ok"] is True for r in rows.values())


def test_demo_rejects_a_layout_that_does_not_split():
    res = _run("demo", "--ranks", "3", "--tp", "2", "--ep")
    assert res.returncode == 2
    assert "--ranks 3 is not a multiple of --tp 2" in res.stderr


def test_demo_rejects_dp_without_ep():
    res = _run("demo", "--ranks", "2", "--tp", "1")
    assert res.returncode == 2 and "enable expert parallelism" in res.stderr


@pytest.mark.parametrize("args,message", [
    (("demo", "--tp", "0"), "argument --tp: must be >= 1, got 0"),
    (("plan", "--tp", "0"), "argument --tp: must be >= 1, got 0"),
    (("demo", "--tokens", "-5"), "argument --tokens: must be >= 0, got -5"),
    (("demo", "--iters", "-1"), "argument --iters: must be >= 1, got -1"),
    (("demo", "--ranks", "x"), "argument --ranks: expected an integer, got 'x'"),
    (("demo", "--timeout", "0"), "argument --timeout: must be > 0, got 0"),
    (("plan", "--layers", "0"), "argument --layers: must be >= 1, got 0"),
    (("demo", "--call-timeout-s", "bad"),
     "argument --call-timeout-s: --call-timeout-s='bad' is not a number of seconds"),
    (("demo", "--ep", "--call-timeout-s", "0.01"), "'0.01' is below the floor of 0.5 s"),
    (("demo", "--ranks", "2", "--ep", "--experts", "7"),
     "--experts 7 is not divisible by the EP size 2"),
    # issue 28: each through the console script; the neighbours in-process below
    (("plan", "--ep", "--nvlink-gbps", "inf"),
     "argument --nvlink-gbps: must be a finite number, got 'inf'"),
    (("--log-level", "bogus", "list"),
     "argument --log-level: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case), "
     "got 'bogus'"),
    (("plan", "--ep", "--tokens-per-dp", "-1,2,3,4"),
     "argument --tokens-per-dp: token counts must be >= 0, got -1 in '-1,2,3,4'"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    res = _run(*args, timeout=60)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr
    assert res.stdout == ""


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _sockets(pid: int) -> int:
    """How many sockets process ``pid`` holds open."""
    try:
        fds = Path(f"/proc/{pid}/fd").iterdir()
        return sum(os.readlink(fd).startswith("socket:") for fd in fds)
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.multirank
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_killed_demo_leaves_no_rank_behind(sig):
    import signal
    import time

    proc = subprocess.Popen([str(BIN), "demo", "--ranks", "2", "--ep", "--iters", "100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline:  # the two rank processes
            ranks = [p for p in _children(proc.pid)
                     if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
            time.sleep(0.2)
        assert len(ranks) == 2, "demo did not start its ranks"
        time.sleep(1.0)
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks), f"ranks left running after {sig}"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.multirank
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_demo_with_a_stopped_rank_ends_in_one_line_naming_it():
    """A demo rank stopped (SIGSTOP) mid-run: before, the demo waited out its pool's deadline
    (--timeout + 30 s) and ended in a TimeoutError traceback. Now it ends within seconds: one
    line on stderr naming the stopped rank's process and the fix, exit status 1, no rank left."""
    import signal
    import time

    proc = subprocess.Popen([str(BIN), "demo", "--ranks", "2", "--ep", "--iters", "100000",
                             "--timeout", "10"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = [p for p in _children(proc.pid)
                     if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
            time.sleep(0.2)
        assert len(ranks) == 2, "demo did not start its ranks"
        while time.monotonic() < deadline and min(map(_sockets, ranks)) < 2:
            time.sleep(0.2)  # the store's connection, then gloo's: the ranks run the layer
        time.sleep(1.0)
        stopped = max(ranks)
        t0 = time.monotonic()
        os.kill(stopped, signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
        assert took < 20, f"the demo took {took:.0f} s to give up on a stopped rank"
        lines = err.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("moe-plugins: error: rank ") and "is stopped" in lines[0]
        assert f"process {stopped} in state T" in lines[0] and "SIGCONT" in lines[0], lines[0]
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks), "ranks left behind"
    finally:
        if proc.poll() is None:  # its ranks, stopped or not, get SIGKILL with it (parent-death)
            proc.kill()


@pytest.mark.multirank
def test_demo_without_renormalization_matches_and_rows_say_ok():
    res = _run("demo", "--ranks", "2", "--ep", "--no-renormalize", "--iters", "1", "--json")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert rows and all(r["ok"] is True for r in rows)


# -- flag values (issue 28), parsed as main parses them -----------------------------------------
@pytest.mark.parametrize("argv,message", [
    # link speeds: finite and > 0; latencies and the budget: finite and >= 0
    (["plan", "--nvlink-gbps", "nan"],
     "argument --nvlink-gbps: must be a finite number, got 'nan'"),
    (["plan", "--nvlink-gbps", "Infinity"],
     "--nvlink-gbps: must be a finite number, got 'Infinity'"),
    (["plan", "--rdma-gbps", "1e400"], "--rdma-gbps: must be a finite number, got '1e400'"),
    (["plan", "--rdma-gbps", "0"], "argument --rdma-gbps: must be > 0, got 0"),
    (["plan", "--rdma-gbps", "-50"], "argument --rdma-gbps: must be > 0, got -50"),
    (["plan", "--nvlink-gbps", "fast"], "argument --nvlink-gbps: expected a number, got 'fast'"),
    (["plan", "--nvlink-us", "-inf"], "argument --nvlink-us: must be a finite number, got '-inf'"),
    (["plan", "--nvlink-us", "-1"], "argument --nvlink-us: must be >= 0, got -1"),
    (["plan", "--rdma-us", "nan"], "argument --rdma-us: must be a finite number, got 'nan'"),
    (["plan", "--shared-expert-budget-gb", "nan"],
     "argument --shared-expert-budget-gb: must be a finite number, got 'nan'"),
    (["plan", "--shared-expert-budget-gb", "-0.5"],
     "argument --shared-expert-budget-gb: must be >= 0, got -0.5"),
    (["demo", "--timeout", "inf"], "argument --timeout: must be a finite number, got 'inf'"),
    (["demo", "--timeout", "-1"], "argument --timeout: must be > 0, got -1"),
    (["plan", "--gpus-per-node", "true"],
     "argument --gpus-per-node: expected an integer, got 'true'"),
    (["plan", "--gpus-per-node", "8.0"],
     "argument --gpus-per-node: expected an integer, got '8.0'"),
    (["plan", "--layers", "-2"], "argument --layers: must be >= 1, got -2"),
    # --tokens-per-dp: counts >= 0, integers, with or without '='
    (["plan", "--tokens-per-dp=-1,2,3,4"], "argument --tokens-per-dp: token counts must be >= 0, "
                                           "got -1 in '-1,2,3,4'"),
    (["plan", "--tokens-per-dp", "3,-2"], "token counts must be >= 0, got -2 in '3,-2'"),
    (["plan", "--tokens-per-dp", "1,,2"], "argument --tokens-per-dp: expected comma-separated "
                                          "integer token counts, one per DP group, got '1,,2'"),
    (["plan", "--tokens-per-dp", "1.5,2"], "expected comma-separated integer token counts"),
    (["plan", "--tokens-per-dp", ""], "expected comma-separated integer token counts"),
    # --log-level: logging's names, any case
    (["--log-level", "10", "list"], "argument --log-level: expected one of DEBUG, INFO"),
    (["--log-level", "", "list"], "argument --log-level: expected one of DEBUG, INFO"),
])
def test_bad_flag_values_exit_2_with_one_line(capsys, argv, message):
    from moe_plugins.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("argv,attr,value", [
    (["--log-level", "debug", "list"], "log_level", "DEBUG"),
    (["--log-level", "Info", "list"], "log_level", "INFO"),
    (["list"], "log_level", "WARNING"),
    (["plan", "--tokens-per-dp", "7,0,3"], "tokens_per_dp", [7, 0, 3]),
    (["plan", "--tokens", "-0"], "tokens", 0),
    (["plan", "--nvlink-gbps", "1e-3"], "nvlink_gbps", 1e-3),
    (["plan", "--rdma-us", "0"], "rdma_us", 0.0),
    (["plan", "--shared-expert-budget-gb", "0"], "shared_expert_budget_gb", 0.0),
    (["plan"], "tokens", None),  # plan resolves it against --tokens-per-dp
    (["demo"], "tokens", 8),
    (["demo"], "call_timeout_s", None),  # not given: the environment's, else off
    (["demo", "--call-timeout-s", "-0"], "call_timeout_s", 0.0),  # off
    (["demo", "--call-timeout-s", "0.5"], "call_timeout_s", 0.5),
    (["demo", "--call-timeout-s", "30"], "call_timeout_s", 30.0),
])
def test_good_flag_values_parse(argv, attr, value):
    from moe_plugins.cli import build_parser

    assert getattr(build_parser().parse_args(argv), attr) == value


BAD_BOUNDS = [("soon", "'soon' is not a number of seconds"),
              ("off", "'off' is not a number of seconds"),
              ("1e-400", "'1e-400' is below the floor of 0.5 s"),
              ("0.4999999", "'0.4999999' is below the floor of 0.5 s")]


@pytest.mark.parametrize("raw,message", BAD_BOUNDS, ids=[b[0] for b in BAD_BOUNDS])
@pytest.mark.parametrize("where", ["env", "first-env", "flag"])
def test_a_bad_call_bound_is_one_line_before_ranks_start(raw, message, where):
    """Checked once in the demo's process, through the call bound's parser, before any rank
    starts (not once per rank after they started, with exit status 1): the variable, the
    start-up bound's variable and --call-timeout-s alike."""
    env, argv = cli_env(), [str(BIN), "demo", "--ranks", "2", "--ep"]
    if where == "env":
        env["MOE_PLUGINS_CALL_TIMEOUT_S"], source = raw, "$MOE_PLUGINS_CALL_TIMEOUT_S="
    elif where == "first-env":
        env["MOE_PLUGINS_FIRST_CALL_TIMEOUT_S"] = raw
        source = "$MOE_PLUGINS_FIRST_CALL_TIMEOUT_S="
    else:
        argv += ["--call-timeout-s", raw]
        source = "--call-timeout-s="
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and source + message in lines[0], res.stderr
    assert "accepted: 0 in any spelling" in lines[0] and res.stdout == ""
