"""deepep_ll against the REAL DeepEP V1 ``deep_ep.Buffer`` on one GPU (EP world size 1).

Needs a CUDA GPU and DeepEP's V1 line (commit 567632d) built from source; skipped cleanly
otherwise. One process, a one-rank gloo group (DeepEP only all-gathers objects over it; the
kernels run over NVSHMEM, which on a node without an RDMA NIC logs that IBGDA failed to start
and goes on with the local GPU). The checks are tests/ll_gpu_cases.py, shared with nixl_ep.

Run: ``python -m pytest -m gpu tests/gpu -q`` from the repository root.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
deep_ep = pytest.importorskip("deep_ep", reason="needs DeepEP's V1 line built from source")

from ll_gpu_cases import *  # noqa: E402,F401,F403  (the shared tests and fixtures)
from ll_gpu_cases import backend_factory, free_port, one_rank_context  # noqa: E402
from prepare_finalize.deepep_ll import SPEC  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ctx():
    with one_rank_context(init_method=f"tcp://127.0.0.1:{free_port()}") as c:
        yield c


@pytest.fixture(scope="module")
def build(ctx):
    return backend_factory(SPEC, ctx)
