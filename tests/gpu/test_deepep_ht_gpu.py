"""deepep_ht and deepep_auto against the REAL DeepEP V1 (567632d) with TWO processes on ONE GPU.

DeepEP's normal-mode kernels run on 2, 4 or 8 ranks only (``SWITCH_RANKS``), so one rank per
GPU cannot run them on a one-GPU machine. Here two processes share ``cuda:0`` (DeepEP's
intranode buffers are exchanged as CUDA IPC handles, which another process on the same device
can open) over a gloo group of 2 (NCCL refuses two ranks on one device; DeepEP itself only
all-gathers objects over the group), run by the one-device harness (tests/gpu/ep_harness.py).
Each rank runs prepare -> reference experts -> finalize for bf16 and FP8 dispatch at several
batch sizes (deepep_auto: on both sides of its threshold) and compares element-wise with the
single-process reference of its own tokens (tests/gpu/deepep_ht_ranks.py).

Every step is reported by the ranks as it starts, the whole run is bounded
(``MOE_PLUGINS_GPU_TIMEOUT_S``, default 300 s; on expiry every rank is killed), and where it
stopped (each rank's steps with their times, results, error text or "timed out") is written as
JSON to ``MOE_PLUGINS_GPU_RECORD`` (default ``tests/gpu/results/deepep_two_ranks_one_gpu.json``)
for tests/gpu/README.md. A run that did not finish within its bound fails naming the step where
each rank stopped; so does a rank that raised or died, or a numerical mismatch.
Timings from a shared GPU mean nothing: none are taken.

Run: ``python -m pytest -m gpu tests/gpu/test_deepep_ht_gpu.py -q -rxs`` from the repository
root, with DeepEP 567632d importable and this package installed editable.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("deep_ep", reason="needs DeepEP's V1 line (567632d) built from source")

from tests.gpu import deepep_ht_ranks as ranks  # noqa: E402
from benchmarks.conditions import current_commit  # noqa: E402
from tests.gpu.ep_harness import now_iso, run_world, verdict, write_record  # noqa: E402

pytestmark = pytest.mark.gpu

WORLD = 2
TIMEOUT_S = float(os.environ.get("MOE_PLUGINS_GPU_TIMEOUT_S", "300"))
RECORD = Path(os.environ.get("MOE_PLUGINS_GPU_RECORD", Path(__file__).parent / "results"
                             / "deepep_two_ranks_one_gpu.json"))


@pytest.mark.parametrize("backend", ["deepep_ht", "deepep_auto"])
def test_two_ranks_on_one_gpu_match_reference(backend):
    run = run_world(ranks.run_ht, WORLD, backend, "cuda", device="cuda", timeout_s=TIMEOUT_S,
                    name=f"{backend} two ranks on one GPU")
    write_record(RECORD, backend, dict(
        run.record(), backend=backend, recorded=now_iso(), commit=current_commit(),
        deep_ep="567632d (as built on the GPU machine)", torch=torch.__version__,
        device_name=torch.cuda.get_device_name(0)))
    # a mismatch a rank reported before a later step stalled is a failure, not an xfail
    bad = [(o.rank, r) for o in run.outcomes for r in o.results if not r.get("ok", True)]
    assert not bad, f"{backend}: outputs differ from the reference: {bad} (recorded in {RECORD})"
    verdict(run, f"{backend} with two ranks on one GPU (recorded in {RECORD})")
    ranks.check_results(backend, run.values)
