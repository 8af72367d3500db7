"""The emulated low-latency kernels' fabric as one-sided puts and spin-waits (optional).

The real kernels write each peer's messages into that peer's RDMA buffer (a put) and spin on
a per-peer signal until it arrives or the kernel timeout passes; a rank masked in the mask
buffer is neither sent to nor waited for. The mask is read once, as each send and each wait
begins, never while spinning (DeepEP 567632d csrc/kernels/internode_ll.cu and NIXL EP
examples/device/ep/csrc/kernels/nixl_ep_ll.cu alike: ``if (not is_rank_masked(mask_buffer_ptr,
src_rank)) { while (<signal not arrived> and <not timed out>); }``): masking a peer from the
host skips it in the sends and waits that begin later, and does not end a wait already
spinning on it, which only the peer's signal or the timeout ends (then the kernel masks the
peer itself, or traps without a mask buffer). The default transport of
:mod:`tests.emulation._ll_kernels` (a gloo all-to-all over the whole group) cannot model that:
a dead or stopped member holds every rank's all-to-all. This fabric does, over the job's store:
a put is one key per (generation, call, source, destination), a wait polls the keys of the
sources unmasked when it began. Cleaning the buffer (the mask clean of either library) starts
a new generation: nothing of an older call is read again, as a zeroed buffer holds no signal
of one.

Chosen per process by ``MOE_EMU_LL_FABRIC=store`` (the peer-loss tests set it); the default
stays the all-to-all, which the other emulation tests use.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["FABRIC_ENV", "StoreFabric", "store_fabric_for"]

FABRIC_ENV = "MOE_EMU_LL_FABRIC"
_POLL_S = 0.002
_BUFFERS: dict[str, int] = {}  # buffers built per transport group: each its own key space


class StoreFabric:
    """Puts and spin-waits of one emulated buffer. ``active``: the runtime's mask (read as a
    send or a wait begins); ``timeout_s``: the library's wait bound; ``mask_enabled``: a
    timed-out peer is masked (else the wait fails, as a trapped kernel)."""

    def __init__(self, store: "dist.Store", prefix: str, rank: int, num_ranks: int,
                 active: Callable[[], list[bool]], mask: Callable[[int], None],
                 timeout_s: float, mask_enabled: bool) -> None:
        self.store, self.prefix, self.rank, self.num_ranks = store, prefix, rank, num_ranks
        self.active, self.mask = active, mask
        self.timeout_s, self.mask_enabled = timeout_s, mask_enabled
        self.generation, self.seq = 0, 0

    def reset(self) -> None:
        """A cleaned buffer: a new generation, calls counted from 0 again."""
        self.generation, self.seq = self.generation + 1, 0

    def _key(self, seq: int, src: int, dst: int) -> str:
        return f"{self.prefix}/{self.generation}/{seq}/{src}/{dst}"

    def send(self, msgs: torch.Tensor, dest: torch.Tensor
             ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """msgs uint8 [num_msgs, msg_bytes] for ranks ``dest`` int64 [num_msgs]: put each
        unmasked peer's rows (an empty put too: it is the signal) and return a wait() giving
        (received uint8 [num_recv, msg_bytes], source rank int64 [num_recv]) in source order."""
        self.seq += 1
        seq, width, active = self.seq, msgs.shape[1], self.active()
        own = msgs[dest == self.rank].contiguous()
        for r in range(self.num_ranks):
            if r != self.rank and active[r]:
                rows = msgs[dest == r].contiguous()
                self.store.set(self._key(seq, self.rank, r), rows.numpy().tobytes())

        def wait() -> tuple[torch.Tensor, torch.Tensor]:
            got = {self.rank: own}
            start = time.monotonic()
            active = self.active()  # once, as the wait begins: the kernels read it so
            waiting = [r for r in range(self.num_ranks) if r != self.rank and active[r]]
            while True:
                for r in waiting:
                    key = self._key(seq, r, self.rank)
                    if r not in got and self.store.check([key]):
                        data = self.store.get(key)
                        self.store.delete_key(key)
                        got[r] = torch.frombuffer(bytearray(data), dtype=torch.uint8) \
                            .reshape(-1, width) if data else torch.zeros(0, width,
                                                                         dtype=torch.uint8)
                if all(r in got for r in waiting):
                    break
                if time.monotonic() - start > self.timeout_s:
                    self._timed_out([r for r in waiting if r not in got])
                    break
                time.sleep(_POLL_S)
            srcs = sorted(got)  # a timed-out peer's rows are not received
            recv = torch.cat([got[r] for r in srcs])
            src = torch.cat([torch.full((got[r].shape[0],), r, dtype=torch.int64)
                             for r in srcs])
            return recv, src

        return wait

    def barrier(self, name: str, bound_s: float = 30.0) -> None:
        """Every rank of the buffer meets here (a library barrier over all ranks that reads no
        mask: DeepEP's teardown). The real one waits forever for a lost rank; this one raises
        RuntimeError after ``bound_s`` naming the ranks that never came."""
        keys = [f"{self.prefix}/{name}/{r}" for r in range(self.num_ranks)]
        self.store.set(keys[self.rank], b"")
        start = time.monotonic()
        while not self.store.check(keys):
            if time.monotonic() - start > bound_s:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise RuntimeError(f"emulation: the library's barrier {name!r} over every rank "
                                   f"waited {bound_s:g} s for ranks {missing} (the real one "
                                   "never returns)")
            time.sleep(0.01)

    def _timed_out(self, ranks: list[int]) -> None:
        if not self.mask_enabled:
            raise RuntimeError("CUDA error: unspecified launch failure (emulation: a kernel "
                               f"waited longer than {self.timeout_s:g} s for ranks {ranks})")
        for r in ranks:
            self.mask(r)


def store_fabric_for(group: "dist.ProcessGroup", rank: int, num_ranks: int,
                     active: Callable[[], list[bool]], mask: Callable[[int], None],
                     timeout_s: float, mask_enabled: bool) -> Optional[StoreFabric]:
    """The store fabric of a new buffer on ``group`` where ``MOE_EMU_LL_FABRIC=store``, else
    None (the all-to-all). Buffers are built in one order on every rank, so their count on the
    group names the same key space everywhere."""
    if os.environ.get(FABRIC_ENV, "") != "store":
        return None
    name = getattr(group, "group_name", "world")
    _BUFFERS[name] = _BUFFERS.get(name, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    return StoreFabric(store, f"emu_ll/{name}/{_BUFFERS[name]}", rank, num_ranks, active, mask,
                       timeout_s, mask_enabled)
