"""What the flashinfer MNNVL backends share (``flashinfer_nvlink_two_sided``,
``flashinfer_nvlink_one_sided``): the package and its install hint, the communicator flashinfer
exchanges MNNVL memory handles through (:class:`TorchGroupComm`, flashinfer's ``CommBackend``
over a torch.distributed group) and the kernels' 16-byte row alignment. flashinfer itself is
imported by the backends' managers, lazily.
"""
from __future__ import annotations

import math
import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["FLASHINFER_EXTRA", "INSTALL_HINT", "ROW_ALIGN_BYTES", "TorchGroupComm",
           "pad_row_bytes"]

FLASHINFER_EXTRA = "flashinfer"  # moe-plugins' optional dependency (pyproject.toml)
INSTALL_HINT = "pip install 'flashinfer-python>=0.7.2' (moe-plugins' [flashinfer] extra)"
# The MNNVL kernels move rows as 16-byte vectors.
ROW_ALIGN_BYTES = 16


class TorchGroupComm:
    """flashinfer's ``CommBackend`` interface (``Get_rank``, ``Get_size``, ``allgather``,
    ``bcast``, ``barrier``, ``Split``) over a torch.distributed group. flashinfer uses it to
    exchange the MNNVL memory handles when it creates a workspace (instead of MPI). Objects travel
    pickled in uint8 tensors (torch's *_object collectives need numpy, which moe-plugins does not)."""

    def __init__(self, group: Optional["dist.ProcessGroup"]):
        self.group = group if group is not None else dist.group.WORLD

    def Get_rank(self) -> int:  # noqa: N802 (flashinfer's MPI-style names)
        return dist.get_rank(self.group)

    def Get_size(self) -> int:  # noqa: N802
        return dist.get_world_size(self.group)

    def _device(self) -> torch.device:
        if "nccl" in str(dist.get_backend(self.group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def allgather(self, data: Any) -> tuple[Any, ...]:
        dev, n = self._device(), self.Get_size()
        payload = torch.tensor(list(pickle.dumps(data)), dtype=torch.uint8, device=dev)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], device=dev), group=self.group)
        lengths = [int(t) for t in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
        padded[: payload.numel()] = payload
        bufs = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(bufs, padded, group=self.group)
        return tuple(pickle.loads(bytes(b[:k].tolist())) for b, k in zip(bufs, lengths))

    def bcast(self, data: Any, root: int) -> Any:
        dev, src = self._device(), dist.get_global_rank(self.group, root)
        is_root = self.Get_rank() == root
        payload = list(pickle.dumps(data)) if is_root else []
        size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        dist.broadcast(size, src=src, group=self.group)
        buf = torch.tensor(payload, dtype=torch.uint8, device=dev) if is_root \
            else torch.empty(int(size), dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=src, group=self.group)
        return pickle.loads(bytes(buf.tolist()))

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def Split(self, color: int, key: int) -> "TorchGroupComm":  # noqa: N802
        """MPI_Comm_split. The EP mapping this manager builds (tp_size = EP size, one pp/cp rank)
        always splits into the whole group in rank order, which is this communicator itself."""
        members = self.allgather((color, key, self.Get_rank()))
        colors = {c for c, _, _ in members}
        order = [r for _, r in sorted((k, r) for _, k, r in members)]
        if len(colors) == 1 and order == list(range(len(members))):
            return self
        raise NotImplementedError(
            f"splitting the handle-exchange group into colors {sorted(colors)} (or reordering it) "
            "is not supported; moe-plugins builds an EP mapping that is one group in rank order"
        )


def pad_row_bytes(t: torch.Tensor) -> torch.Tensor:
    """t [rows, cols] -> t (contiguous) when a row is a multiple of 16 bytes, else a copy whose
    rows are zero-padded to that (the kernels move rows as 16-byte vectors)."""
    row_bytes = t.shape[1] * t.element_size()
    if row_bytes % ROW_ALIGN_BYTES == 0:
        return t.contiguous()
    padded = torch.zeros(t.shape[0], math.ceil(row_bytes / ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES,
                         dtype=torch.uint8, device=t.device)
    padded[:, :row_bytes] = t.contiguous().view(torch.uint8)
    return padded.view(t.dtype)
