"""Named link models for systems the planner knows (``moe-plugins plan --link NAME``), each
with where its numbers come from. Bandwidths are per GPU and direction (GB/s), latencies
per message (us). The link latencies are orders of magnitude, not measurements; the time
model's fitted constants (:data:`moe_plugins.planner.transport_time.FITTED`) come from the
H800 rows alone and are assumed to carry over to the other systems."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from moe_plugins.planner.link_model import LinkModel

__all__ = ["LINK_PRESETS", "link_preset", "link_from_config", "PublishedTimes",
           "PUBLISHED_NVLINK_ONE_SIDED"]

_LATENCY = dict(nvlink_latency_us=3.0, rdma_latency_us=5.0)

#: name -> link model. Sources:
#: - h800-cx7: the set-up of DeepEP V1's published performance tables (its README): H800 SXM,
#:   NVLink 400 GB/s bidirectional (8 NVLink 4 links, 200 GB/s per direction; the README
#:   quotes ~160 GB/s reached), one ConnectX-7 400 Gb/s InfiniBand NIC per GPU (50 GB/s), 8
#:   GPUs per node, 24 SMs for the normal mode as DeepEP's tests set. Low-latency messages to
#:   the node's own ranks go over NVLink: the published EP 8 row moves about 86 GB/s of
#:   remote bytes per GPU, more than its one 50 GB/s NIC can carry (docs/planner.md).
#: - h100-cx7, h200-cx7: H100 / H200 SXM (NVIDIA's datasheets: NVLink 900 GB/s bidirectional,
#:   18 NVLink 4 links, 450 GB/s per direction), one ConnectX-7 400 Gb/s NIC per GPU (50 GB/s),
#:   8 GPUs per node (HGX), DeepEP V1's default of 20 SMs for the normal mode.
#: - h200-nvlink: one HGX H200 node (8 GPUs, NVLink as above); no second node.
#: - gb200-nvl72: one GB200 NVL72 rack, one NVLink domain of 72 GPUs (NVIDIA's GB200 NVL72
#:   datasheet: NVLink 5, 1.8 TB/s bidirectional per GPU, 900 GB/s per direction); no second
#:   domain. The system of the published one-sided row below (:data:`PUBLISHED_NVLINK_ONE_SIDED`).
LINK_PRESETS: dict[str, LinkModel] = {
    "h800-cx7": LinkModel(nvlink_gbps=200.0, rdma_gbps=50.0, gpus_per_node=8, ll_nvlink=True,
                          sms=24, name="h800-cx7", **_LATENCY),
    "h100-cx7": LinkModel(nvlink_gbps=450.0, rdma_gbps=50.0, gpus_per_node=8, ll_nvlink=True,
                          sms=20, name="h100-cx7", **_LATENCY),
    "h200-cx7": LinkModel(nvlink_gbps=450.0, rdma_gbps=50.0, gpus_per_node=8, ll_nvlink=True,
                          sms=20, name="h200-cx7", **_LATENCY),
    "h200-nvlink": LinkModel(nvlink_gbps=450.0, rdma_gbps=50.0, gpus_per_node=8, ll_nvlink=True,
                             sms=20, nodes=1, name="h200-nvlink", **_LATENCY),
    "gb200-nvl72": LinkModel(nvlink_gbps=900.0, rdma_gbps=50.0, gpus_per_node=72, ll_nvlink=True,
                             sms=20, nodes=1, name="gb200-nvl72", **_LATENCY),
}


@dataclass(frozen=True)
class PublishedTimes:
    """A published dispatch / combine time (us) of one backend family on a preset's system."""

    source: str
    preset: str
    transport: str
    ep: int
    num_experts: int
    dtype: str
    tokens_per_rank: int
    dispatch_us: float
    combine_us: float


#: TensorRT-LLM's blog post on its one-sided MoE all-to-all over NVLink (the kernels flashinfer's
#: NVLinkOneSidedAlltoAll runs): GB200 NVL72, EP 8, 256 experts, BF16, 128 tokens per rank. Not
#: used to fit the time model (the NVLink families borrow the low-latency constants); the planner
#: tests hold the model's prediction for it within a factor of 2.
PUBLISHED_NVLINK_ONE_SIDED = PublishedTimes(
    source="NVIDIA TensorRT-LLM blog, one-sided MoE all-to-all over NVLink (GB200 NVL72 table)",
    preset="gb200-nvl72", transport="nvlink_one_sided", ep=8, num_experts=256, dtype="bf16",
    tokens_per_rank=128, dispatch_us=31.7, combine_us=38.1)


def link_preset(name: str, **overrides: object) -> LinkModel:
    """The preset ``name`` with ``overrides`` (LinkModel fields) applied; an overridden preset
    is named ``'<name> (with <fields>)'``. ValueError lists the presets for an unknown name."""
    if name not in LINK_PRESETS:
        raise ValueError(f"unknown link preset {name!r}; expected one of "
                         f"{', '.join(sorted(LINK_PRESETS))}")
    base = LINK_PRESETS[name]
    unknown = sorted(set(overrides) - set(_LINK_FIELDS))
    if unknown:
        raise TypeError(f"link_preset({name!r}) got unknown LinkModel field(s) "
                        f"{', '.join(unknown)}; expected some of {', '.join(_LINK_FIELDS)}, "
                        f"e.g. link_preset({name!r}, rdma_gbps=25)")
    changed = {k: v for k, v in overrides.items() if getattr(base, k) != v}
    if not changed:
        return base
    return dataclasses.replace(base, **changed,
                               name=f"{name} (with {', '.join(sorted(changed))})")


_LINK_FIELDS = tuple(f.name for f in dataclasses.fields(LinkModel) if f.name != "name")


def link_from_config(value: Any, where: str) -> LinkModel:
    """The link model an engine's settings name (``where`` says which setting, for errors): a
    preset name (``"h200-cx7"``), or an object of :class:`LinkModel` fields, optionally over a
    preset (``{"preset": "h200-cx7", "rdma_gbps": 25}``, ``{"nvlink_gbps": 450,
    "gpus_per_node": 8}``). ValueError / TypeError say what was given and what is expected."""
    if isinstance(value, str):
        return _named(value, where)
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a preset name or an object of link fields, got "
                        f"{type(value).__name__}; e.g. \"h200-cx7\" or "
                        "{\"preset\": \"h200-cx7\", \"rdma_gbps\": 25}")
    fields = dict(value)
    preset = fields.pop("preset", None)
    unknown = sorted(set(fields) - set(_LINK_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown link field(s) {unknown}; expected 'preset' and any of "
                         f"{list(_LINK_FIELDS)}")
    try:
        if preset is None:
            return LinkModel(**fields)
        if not isinstance(preset, str):
            raise TypeError(f"the preset must be a name, got {type(preset).__name__}")
        return link_preset(_named(preset, where).name, **fields)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def _named(name: str, where: str) -> LinkModel:
    if name not in LINK_PRESETS:
        raise ValueError(f"{where}: unknown link preset {name!r}; expected one of "
                         f"{', '.join(sorted(LINK_PRESETS))}, or an object of link fields")
    return LINK_PRESETS[name]
