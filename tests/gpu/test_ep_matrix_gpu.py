"""The one-GPU EP matrix (tests/gpu/ep_matrix.py) as pytest cases: one test per job of the half
named by ``MOE_PLUGINS_EP_MATRIX`` (``A`` or ``B``; the two halves need different libraries, see
scripts/gpu/ep_matrix.sh, which is the usual way to run it). Skipped without CUDA, and without
that variable (each half takes several minutes: ``-m gpu tests/gpu`` must not start it by
accident).

A job's rows go to ``MOE_PLUGINS_EP_RECORD`` (default ``tests/gpu/results/ep_one_gpu.json``,
rows of the same job replaced). A failed row fails its test, and a row that did not finish
within the job's bound is a failed row (its detail names where each rank stopped), in every
job: a run that ran out of its bound did not show what it is there for. Refused rows (the
backend or library refused the configuration) pass, their reason is in the record; a job not
started (the budget ran out) is skipped.

Run: ``MOE_PLUGINS_EP_MATRIX=B python -m pytest -m gpu tests/gpu/test_ep_matrix_gpu.py -rxs``
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
HALF = os.environ.get("MOE_PLUGINS_EP_MATRIX")
if HALF not in ("A", "B"):
    pytest.skip("set MOE_PLUGINS_EP_MATRIX=A or B to run the EP matrix (scripts/gpu/ep_matrix.sh)",
                allow_module_level=True)

from tests.gpu.ep_matrix import _select, jobs, run_job  # noqa: E402

pytestmark = pytest.mark.gpu

RECORD = Path(os.environ.get("MOE_PLUGINS_EP_RECORD",
                             Path(__file__).parent / "results" / "ep_one_gpu.json"))
JOBS = _select(jobs("cuda"), HALF, (), ())


@pytest.mark.parametrize("job", JOBS, ids=[j.name for j in JOBS])
def test_ep_matrix_job(job):
    rows, _ = run_job(job, "cuda")
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(RECORD.read_text()) if RECORD.exists() else []
    RECORD.write_text(json.dumps([r for r in old if r.get("job") != job.name] + rows, indent=1)
                      + "\n")
    failed = [r for r in rows if r["status"] == "failed"]
    assert not failed, "; ".join(f"{r['case']} {r['quant']} tp{r['tp']}: {r['detail']}"
                                 for r in failed)
    not_run = [r for r in rows if r["status"] == "not_run"]
    if not_run:
        pytest.skip(f"{job.name}: {not_run[0]['detail']}")
