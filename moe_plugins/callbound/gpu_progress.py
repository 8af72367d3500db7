"""The GPU's side of the call bound's completion marks (:mod:`moe_plugins.callbound.watchdog`): a
page-locked host buffer of uint32 words mapped into the GPU's address space, and
the driver call that enqueues on a stream the write of one word after the work before it. The
watchdog thread reads the words from host memory; it makes no CUDA call."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Callable, Optional

import torch

__all__ = ["CudaProgress", "raw_stream"]

logger = logging.getLogger(__name__)


class CudaProgress:
    """A page-locked host buffer of ``slots`` uint32 words (and a spare one for the probe),
    mapped into every CUDA context of the process, and the driver call that writes one of them
    on a stream (the GPU writes, the watchdog thread reads host memory). Made on the first CUDA
    call, on the caller's thread (a CUDA context is current there); ``ok`` False: no driver
    path works here."""

    #: the driver calls that can write a word, tried in this order by a probe
    PATHS = ("cuStreamWriteValue32", "cuMemsetD32Async")

    def __init__(self, slots: int, paths: tuple[str, ...] = PATHS) -> None:
        self.slots = slots
        self.paths = paths
        self.ok = False
        self.how = "none"
        self.words: Optional[ctypes.Array] = None
        self.dptr = 0
        self._fn: Callable[..., int] = lambda *args: -1
        self._memset = False
        try:
            self._setup()
        except (OSError, AttributeError, RuntimeError) as e:
            logger.error("moe-plugins watchdog: no CUDA driver path to mark a call's completion "
                         "(%s); CUDA calls are watched until their host part returns, not until "
                         "their GPU work completes", e)

    def _setup(self) -> None:
        try:  # the driver torch loaded
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so")
        self._context(lib)
        ptr = ctypes.c_void_p()
        # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP: pinned, mapped in every context
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                       ctypes.c_uint]
        rc = lib.cuMemHostAlloc(ctypes.byref(ptr), 4 * (self.slots + 1), 0x01 | 0x02)
        if rc:
            raise RuntimeError(f"cuMemHostAlloc failed with CUresult {rc}")
        dptr = ctypes.c_uint64()
        get = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
        get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        rc = get(ctypes.byref(dptr), ptr, 0)
        if rc:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUresult {rc}")
        self.words = (ctypes.c_uint32 * self.slots).from_address(ptr.value)
        ctypes.memset(ptr.value, 0, 4 * (self.slots + 1))
        self.dptr = dptr.value
        write = getattr(lib, "cuStreamWriteValue32_v2", None) or getattr(
            lib, "cuStreamWriteValue32", None)
        memset = getattr(lib, "cuMemsetD32Async", None)
        found = {}
        if write is not None:  # (stream, address, value, flags)
            write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            found["cuStreamWriteValue32"] = (write, False)
        if memset is not None:  # (address, value, count, stream)
            memset.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
            found["cuMemsetD32Async"] = (memset, True)
        stream = raw_stream(torch.cuda.current_device())
        candidates = [(how, *found[how]) for how in self.paths if how in found]
        for how, fn, is_memset in candidates:  # the probe: a write into the spare last word
            self._fn, self._memset = fn, is_memset
            rc = self.write(stream, self.slots, 1)
            if rc == 0:
                self.ok, self.how = True, how
                logger.debug("moe-plugins watchdog: GPU progress writes by %s", how)
                return
            logger.debug("moe-plugins watchdog: %s failed with CUresult %d", how, rc)
        raise RuntimeError(f"none of {', '.join(self.paths)} works here")

    @staticmethod
    def _context(lib: ctypes.CDLL) -> None:
        """Make the current device's primary context current on this thread where none is
        (torch makes it current lazily; the driver calls below need one)."""
        lib.cuInit(0)
        ctx = ctypes.c_void_p()
        if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
            return
        dev = ctypes.c_int()
        rc = lib.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device())
        if rc == 0:
            rc = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        if rc == 0:
            lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            rc = lib.cuCtxSetCurrent(ctx)
        if rc:
            raise RuntimeError(f"no CUDA context for the progress buffer (CUresult {rc})")

    def write(self, stream: int, slot: int, value: int) -> int:
        """Enqueue on ``stream`` the write of ``value`` into ``slot``; the driver's CUresult
        (0: done)."""
        if self._memset:
            return self._fn(self.dptr + 4 * slot, value, 1, stream)
        return self._fn(stream, self.dptr + 4 * slot, value, 0)


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(index: int) -> int:
    """The handle of the current CUDA stream of device ``index`` (0: the legacy default)."""
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream
