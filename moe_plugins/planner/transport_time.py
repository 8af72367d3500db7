"""How long one dispatch or combine all-to-all takes, per transport family
(:class:`moe_plugins.registry.Transport`), on the links of a :class:`LinkModel`.

Inputs are what the plan counts: ``rows[s][d]``, the rows (low-latency: messages, one per
(token, expert) pair) rank ``s`` sends rank ``d``, each ``row_bytes`` on the wire (the backend's
wire layout: padded hidden, ``x_sf``, metadata and header); for the normal mode also
``node_rows[s][n]``, the rows ``s`` sends node ``n`` (one per token and destination node). A
combine moves the same rows back with the combine row's bytes; every family below is symmetric
in sending and receiving, so one function times both phases. The result is the busiest rank's
time in microseconds; self-sends are local copies and cost nothing.

The families, from how their kernels move data:

- LOW_LATENCY (DeepEP low-latency, NIXL EP): every message is put by the GPU itself, to ranks of
  the node over NVLink when ``LinkModel.ll_nvlink`` allows, else through the NIC over RDMA;
  NVLink and RDMA work at once. Time: a fixed cost + the latency of the slowest link used +
  the larger of (NVLink bytes / NVLink rate, RDMA bytes / RDMA rate), bytes being the larger of
  what the rank sends and what it receives on that link.
- NORMAL (DeepEP normal mode): a token goes once over RDMA to each destination node (to the
  GPU with the sender's local index), which forwards it over NVLink to the ranks of its node
  that need it; the RDMA and NVLink stages are pipelined, so the slower stage sets the time. A
  notify step (counts) precedes the data. The copies are made by ``LinkModel.sms`` SMs; the
  published runs used :attr:`FittedConstants.reference_sms`, fewer SMs are assumed to scale the
  rates linearly (not calibrated).
- NVLINK_TWO_SIDED and NVLINK_ONE_SIDED (FlashInfer): one row per (token, rank) inside one
  NVLink domain (one-sided: the sender writes it straight into the receiver's buffer, no count
  exchange before it); a layout beyond ``LinkModel.gpus_per_node`` ranks is refused. Not
  calibrated: both use the low-latency family's fixed cost and NVLink efficiency.
- NCCL (the torch reference over NCCL): a count exchange, then one ``all_to_all_v`` of rows
  (combine: one); each exchange costs a low-latency kernel's fixed cost and the latency of the
  slowest link used, and the rows the busiest link's bytes. Not calibrated: it borrows the
  low-latency fixed cost and the normal mode's link efficiencies. The host sync of the count
  exchange is not modelled.

:data:`CALIBRATED` names the families the published rows cover; the others borrow constants.

Calibration: the constants in :data:`FITTED` are fitted on the published DeepEP V1 README rows
(H800, one ConnectX-7 400 Gb/s per GPU, EP 8-32) and nothing else, by
:mod:`moe_plugins.planner.fit` (``python -m moe_plugins.planner.fit``; a test holds
:data:`FITTED` to its result); :mod:`moe_plugins.planner.calibration` lists those rows with
their sources and the model's residual on each. Every other figure is a prediction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from moe_plugins.planner.link_model import LinkModel
from moe_plugins.registry import Transport

__all__ = ["FittedConstants", "FITTED", "CALIBRATED", "all_to_all_us"]


@dataclass(frozen=True)
class FittedConstants:
    """The model's fitted constants (dimensionless efficiencies are achieved / nominal rate).

    ll_fixed_us: fixed cost of one low-latency kernel (us), link latency excluded.
    ll_nvlink_efficiency, ll_rdma_efficiency: rates low-latency messages reach on each link.
    normal_nvlink_efficiency, normal_rdma_efficiency: rates of the normal mode's NVLink and
        RDMA stages at ``reference_sms`` SMs.
    normal_fixed_us: fixed cost of a normal-mode dispatch or combine (us): the notify step and
        the data step, each assumed to cost one low-latency kernel's fixed cost. An assumption,
        not a fit: every published normal-mode row is at 4096 tokens per rank, where it is
        2-6% of the time.
    reference_sms: SMs of the published normal-mode runs (DeepEP's tests use 24).
    """

    ll_fixed_us: float = 32.7
    ll_nvlink_efficiency: float = 0.814
    ll_rdma_efficiency: float = 0.945
    normal_nvlink_efficiency: float = 0.684
    normal_rdma_efficiency: float = 0.894
    normal_fixed_us: float = 2 * 32.7
    reference_sms: int = 24


#: Fitted on the DeepEP V1 README rows only, by :mod:`moe_plugins.planner.fit` (rounded to
#: the digits written here; see the module docstring).
FITTED = FittedConstants()

#: The transport families a published row was fitted on; the others borrow their constants.
CALIBRATED = frozenset({Transport.LOW_LATENCY, Transport.NORMAL})

_Matrix = Sequence[Sequence[float]]


def _gbps_us(num_bytes: float, gbps: float) -> float:
    """Microseconds to move ``num_bytes`` at ``gbps`` GB/s."""
    return num_bytes / (gbps * 1e3)


def _busiest(send: list[float], recv: list[float]) -> list[float]:
    """Per rank, the larger of what it sends and what it receives."""
    return [max(s, r) for s, r in zip(send, recv)]


def _link_split(rows: _Matrix, link: LinkModel, nvlink_allowed: bool
                ) -> tuple[list[float], list[float]]:
    """Per rank, rows over NVLink and rows over RDMA (the larger of sent and received)."""
    n = len(rows)
    nv_s, nv_r, rd_s, rd_r = ([0.0] * n for _ in range(4))
    for s in range(n):
        for d in range(n):
            if s == d or not rows[s][d]:
                continue
            if nvlink_allowed and link.node(s) == link.node(d):
                nv_s[s] += rows[s][d]
                nv_r[d] += rows[s][d]
            else:
                rd_s[s] += rows[s][d]
                rd_r[d] += rows[s][d]
    return _busiest(nv_s, nv_r), _busiest(rd_s, rd_r)


def _latency(link: LinkModel, nvlink: float, rdma: float) -> float:
    """Latency of the slowest link that carries anything (us)."""
    return max(link.nvlink_latency_us if nvlink else 0.0, link.rdma_latency_us if rdma else 0.0)


def _low_latency_us(rows: _Matrix, row_bytes: int, link: LinkModel, c: FittedConstants) -> float:
    nv, rd = _link_split(rows, link, link.ll_nvlink)
    worst = 0.0
    for a, b in zip(nv, rd):
        data = max(_gbps_us(a * row_bytes, link.nvlink_gbps * c.ll_nvlink_efficiency),
                   _gbps_us(b * row_bytes, link.rdma_gbps * c.ll_rdma_efficiency))
        worst = max(worst, _latency(link, a, b) + data)
    return c.ll_fixed_us + worst


def _normal_us(rows: _Matrix, node_rows: _Matrix, row_bytes: int, link: LinkModel,
               c: FittedConstants) -> float:
    n, g = len(rows), link.gpus_per_node
    local = [r % g for r in range(n)]
    # RDMA: one row per (token, remote node), landing on the GPU of the sender's local index
    rd_s, rd_r = [0.0] * n, [0.0] * n
    for s in range(n):
        for node, v in enumerate(node_rows[s]):
            if node == link.node(s) or not v:
                continue
            rd_s[s] += v
            rd_r[min(node * g + local[s], n - 1)] += v
    # NVLink: the forwarder (the destination's node, the sender's local index) hands each row
    # to its destination rank; rows whose destination is the forwarder itself stay put
    nv_s, nv_r = [0.0] * n, [0.0] * n
    for s in range(n):
        for d in range(n):
            if not rows[s][d] or local[s] == local[d]:
                continue
            fwd = min(link.node(d) * g + local[s], n - 1)
            nv_s[fwd] += rows[s][d]
            nv_r[d] += rows[s][d]
    scale = min(1.0, link.sms / c.reference_sms)
    worst = 0.0
    for a, b in zip(_busiest(nv_s, nv_r), _busiest(rd_s, rd_r)):
        data = max(_gbps_us(a * row_bytes, link.nvlink_gbps * c.normal_nvlink_efficiency * scale),
                   _gbps_us(b * row_bytes, link.rdma_gbps * c.normal_rdma_efficiency * scale))
        worst = max(worst, _latency(link, a, b) + data)
    return c.normal_fixed_us + worst


def _nvlink_us(rows: _Matrix, row_bytes: int, link: LinkModel, c: FittedConstants,
               transport: Transport) -> float:
    n = len(rows)
    if link.node(n - 1) != 0:
        kind = "two-sided" if transport is Transport.NVLINK_TWO_SIDED else "one-sided"
        raise ValueError(f"flashinfer's {kind} all-to-all runs inside one NVLink domain; "
                         f"{n} EP ranks span {link.node(n - 1) + 1} domains of "
                         f"{link.gpus_per_node} GPUs; give the domain size with --gpus-per-node "
                         "(e.g. 72 for an NVL72 rack) or pick another backend")
    nv, _ = _link_split(rows, link, True)
    worst = max((_gbps_us(a * row_bytes, link.nvlink_gbps * c.ll_nvlink_efficiency)
                 + _latency(link, a, 0.0) for a in nv), default=0.0)
    return c.ll_fixed_us + worst


def _nccl_us(rows: _Matrix, row_bytes: int, link: LinkModel, c: FittedConstants,
             exchanges: int) -> float:
    nv, rd = _link_split(rows, link, True)
    data = max((max(_gbps_us(a * row_bytes, link.nvlink_gbps * c.normal_nvlink_efficiency),
                    _gbps_us(b * row_bytes, link.rdma_gbps * c.normal_rdma_efficiency))
                for a, b in zip(nv, rd)), default=0.0)
    lat = max((_latency(link, a, b) for a, b in zip(nv, rd)), default=0.0)
    return exchanges * (c.ll_fixed_us + lat) + data


def all_to_all_us(transport: Transport, phase: str, rows: _Matrix, row_bytes: int,
                  link: LinkModel, node_rows: Optional[_Matrix] = None,
                  constants: Optional[FittedConstants] = None) -> float:
    """Busiest-rank time (us) of one ``phase`` ('dispatch' | 'combine') on ``transport``.

    rows: [src][dst] rows (low-latency: messages) of the dispatch; the combine passes the same
    matrix. row_bytes: bytes of one row in this phase. node_rows: [src][node] rows, needed by
    the NORMAL transport. Raises ValueError for a layout the transport cannot run (flashinfer
    beyond one NVLink domain, more nodes than the link model has). constants: None, the
    fitted :data:`FITTED`."""
    constants = constants if constants is not None else FITTED
    if phase not in ("dispatch", "combine"):
        raise ValueError(f"phase must be 'dispatch' or 'combine', got {phase!r}")
    link.check_fits(len(rows))
    if transport is Transport.LOW_LATENCY:
        return _low_latency_us(rows, row_bytes, link, constants)
    if transport is Transport.NORMAL:
        if node_rows is None:
            raise ValueError("the normal-mode time needs node_rows ([src][node] rows)")
        return _normal_us(rows, node_rows, row_bytes, link, constants)
    if transport in (Transport.NVLINK_TWO_SIDED, Transport.NVLINK_ONE_SIDED):
        return _nvlink_us(rows, row_bytes, link, constants, transport)
    if transport is Transport.NCCL:
        return _nccl_us(rows, row_bytes, link, constants, 2 if phase == "dispatch" else 1)
    # a family added to Transport without its time function here (docs/adding_a_backend.md)
    raise ValueError(f"the planner has no time model for transport {transport!r}; add one to "
                     "moe_plugins/planner/transport_time.py")
