"""flashinfer_nvlink_two_sided against the REAL flashinfer (0.7.2.post1: MnnvlMoe and moe_ep;
0.7.4: moe_ep's NVLinkTwoSidedAlltoAll) on ONE GPU
shared by two processes: our backend refuses a single rank, so two gloo ranks (a RankPool)
both run on cuda:0, each mapping the other's MNNVL workspace (cuMemCreate memory shared as
FABRIC handles, or on one host without FABRIC support as POSIX file descriptors).

Needs a CUDA GPU and flashinfer (scripts/gpu/flashinfer.sh installs the kit's wheel; its
all-to-all kernels are JIT-compiled with nvcc on first use); skipped cleanly otherwise. The rank
functions are those of the emulation tests (tests/backends/flashinfer_two_sided_ranks.py) with the real library
(``flavor=None``) on ``device="cuda:0"``; every output is compared element-wise with the
single-process reference. moe_ep's NVLink platform check is answered True on a one-GPU host
(tests/gpu/flashinfer_one_gpu.py: why, and that nothing else changes). Numerics only: timings
from a shared GPU mean nothing.

Run: ``bash scripts/gpu/flashinfer.sh`` on the GPU machine.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer (scripts/gpu/flashinfer.sh installs it)", allow_module_level=True)

from tests.backends import flashinfer_two_sided_ranks as fi  # noqa: E402
from moe_plugins.all2all.flashinfer_nvlink_two_sided import FlashInferTwoSidedOptions, TwoSidedApi, _available_apis  # noqa: E402
from tests.checks import assert_matches_reference  # noqa: E402
from tests.gpu.flashinfer_one_gpu import on_one_gpu  # noqa: E402
from moe_plugins.layout import ParallelLayout  # noqa: E402
from moe_plugins.config import MoEConfig  # noqa: E402
from moe_plugins.quant import NVFP4_BLOCK, QuantScheme, QuantSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]

DEV = "cuda:0"  # both ranks
EP2 = ParallelLayout(2, 1, True)
FP8, NVFP4 = QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4
VERSION, APIS = _available_apis()
# Both ranks are on one host and one GPU: a Mapping of 2 GPUs per node keeps them on one node
# (the default, torch.cuda.device_count(), would be 1 and put rank 1 on a second node).
GPUS_PER_NODE = 2


def _cfg(**kw: object) -> MoEConfig:
    return MoEConfig(**{"hidden": 256, "num_experts": 8, "num_topk": 2, "intermediate": 64,
                        "shared_intermediate": 128, "dtype": torch.bfloat16, **kw})


def _api(name: str) -> TwoSidedApi:
    api = TwoSidedApi(name)
    if api not in APIS:
        pytest.skip(f"flashinfer {VERSION} has no {api.value} API")
    return api


def _run(pool: "object", fn: object, *args: object, **kwargs: object) -> list:
    """``fn`` on both ranks; on a one-GPU host past moe_ep's NVLink platform check
    (tests/gpu/flashinfer_one_gpu.py says why that is sound with both ranks on one GPU)."""
    return pool.run(on_one_gpu, fn, *args, **kwargs)  # type: ignore[attr-defined]


QUANTS = fi.QUANTS  # the emulation tests' (id, quant, activation dtype)
API_NAMES = [a.value for a in TwoSidedApi if a is not TwoSidedApi.AUTO]


def test_the_installed_flashinfer_has_a_two_sided_api():
    assert APIS, f"flashinfer {VERSION} has neither MnnvlMoe nor moe_ep"
    print(f"flashinfer {VERSION}: {[a.value for a in APIS]}")


def test_layer_with_default_options(rank_pool):
    """The whole layer (shared expert included) as an engine builds it: default options, so the
    Mapping has torch.cuda.device_count() = 1 GPU per node. A failure here that the test below
    does not show is the Mapping's view of two ranks on one GPU, not the kernels."""
    cfg = _cfg()
    results = _run(rank_pool(2), fi.run_layer, EP2, cfg, 9, QuantSpec(), None, device=DEV)
    assert_matches_reference(results, EP2, cfg, 9, QuantSpec())
    assert {r["api"] for r in results} == {APIS[0].value}


@pytest.mark.parametrize("name,quant,dtype", QUANTS, ids=[q[0] for q in QUANTS])
@pytest.mark.parametrize("api_name", API_NAMES)
def test_routed_matches_reference(rank_pool, api_name, name, quant, dtype):
    api = _api(api_name)
    cfg = _cfg(shared_intermediate=0, dtype=dtype)  # routed only: the finalize output is the reference
    options = FlashInferTwoSidedOptions(api=api, gpus_per_node=GPUS_PER_NODE)
    results = _run(rank_pool(2), fi.run_routed, EP2, cfg, 8, quant, None, options, device=DEV)
    assert_matches_reference(results, EP2, cfg, 8, quant)
    for r in results:
        assert r["api"] == api.value
        # On a GPU the backend counts calls and pairs only (bytes would need a device read per
        # call: prepare_finalize/flashinfer_nvlink_two_sided.py, moe_plugins.counters.host_count), so no byte counts.
        assert r["sf_bytes"] == 0


R = 2 * 8  # receive rows: num_ranks * max_tokens_per_rank
SWIZZLED_NVFP4_SF = (-(-R // 128) * 128) * (-(-(256 // NVFP4_BLOCK) // 4) * 4)
X_SF_CASES = [
    # quant, swizzle option, x (dtype, columns), x_sf (dtype, shape) or None, swizzled
    ("fp8", QuantSpec(FP8), True, (torch.float8_e4m3fn, 256), (torch.float32, (R, 2)), False),
    ("nvfp4-swizzled", QuantSpec(NVFP4), True, (torch.uint8, 128),
     (torch.float8_e4m3fn, (SWIZZLED_NVFP4_SF,)), True),
    ("nvfp4-rowaligned", QuantSpec(NVFP4), False, (torch.uint8, 128),
     (torch.float8_e4m3fn, (R, 16)), False),
    ("nvfp4-deferred", QuantSpec(NVFP4, True), True, (torch.float32, 256), None, False),
]


@pytest.mark.parametrize("case,quant,swizzle,x,sf,swizzled", X_SF_CASES,
                         ids=[c[0] for c in X_SF_CASES])
@pytest.mark.parametrize("api_name", API_NAMES)
def test_prepare_x_sf(rank_pool, api_name, case, quant, swizzle, x, sf, swizzled):
    """What prepare hands the experts after the real all-to-all: the wire dtype, the scales
    (NVFP4 scales interleaved into the 128x4 layout after the all-to-all when asked), and the
    receive layout; the experts' output then matches the reference."""
    api = _api(api_name)
    cfg = _cfg(shared_intermediate=0, dtype=torch.float32)
    options = FlashInferTwoSidedOptions(api=api, nvfp4_swizzled_sf=swizzle,
                                        gpus_per_node=GPUS_PER_NODE)
    results = _run(rank_pool(2), fi.run_routed, EP2, cfg, 8, quant, None, options, device=DEV)
    assert_matches_reference(results, EP2, cfg, 8, quant)
    for r in results:
        assert (r["x_dtype"], r["x_shape"]) == (x[0], (R, x[1]))
        assert r["x_sf"] == sf and r["x_sf_swizzled"] is swizzled
        assert r["topk_ids"].dtype == torch.int64 and r["topk_ids"].shape == (R, cfg.num_topk)
        assert int(r["topk_ids"].min()) >= -1 and int(r["topk_ids"].max()) < 4
