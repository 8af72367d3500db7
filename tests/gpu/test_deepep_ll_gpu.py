"""deepep_ll against the REAL DeepEP V1 ``deep_ep.Buffer`` on one GPU (EP world size 1).

Needs a CUDA GPU and DeepEP's V1 line (commit 567632d) built from source; skipped cleanly
otherwise. One process, a one-rank gloo group (DeepEP only all-gathers objects over it; the
kernels run over NVSHMEM, which on a node without an RDMA NIC logs that IBGDA failed to start
and goes on with the local GPU). The checks are tests/ll_gpu_cases.py, shared with nixl_ep.

Run: ``python -m pytest -m gpu tests/gpu -q`` from the repository root.
"""
from __future__ import annotations

import datetime
import socket

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
deep_ep = pytest.importorskip("deep_ep", reason="needs DeepEP's V1 line built from source")

import torch.distributed as dist  # noqa: E402

from ll_gpu_cases import *  # noqa: E402,F401,F403  (the shared tests and fixtures)
from ll_gpu_cases import CFG, DEV, MAX_TOKENS  # noqa: E402
from moe_plugins.config import DispatchConfig  # noqa: E402
from moe_plugins.groups import DistContext  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.low_latency import destroy_all_buffers  # noqa: E402
from moe_plugins.overlap import clear_side_streams  # noqa: E402
from moe_plugins.quant import QuantSpec  # noqa: E402
from prepare_finalize.deepep_ll import SPEC  # noqa: E402

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ctx():
    torch.cuda.set_device(0)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120))
    yield DistContext(ParallelLayout(1, 1, True), 0, dist.group.WORLD, None, DEV)
    destroy_all_buffers()
    clear_side_streams()
    if owns_group:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def build(ctx):
    def make(quant: QuantSpec, hidden: int = CFG.hidden):
        return SPEC.build(ctx, DispatchConfig(CFG.num_experts, hidden, CFG.num_topk, MAX_TOKENS,
                                              CFG.dtype, quant))
    return make
