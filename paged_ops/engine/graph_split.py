"""Many CUDA graphs from one stream capture: each batch bucket's decode graph is cut out of it.

Measured on an H200 (torch 2.11+cu130, benchmarks/NOTES.md section 28): from a process's fourth
stream capture on, *every* CUDA graph of the process replays ~0.18 us slower per kernel node (a
chain of 100 tiny kernels: 1.03 -> 1.21 us per kernel; the engine's batch-1 decode graph: 859 ->
895 us in one process, 870 us in an LLM with 2 graphs vs 913 us with 7). Captured graphs not yet
instantiated count; deleting graphs does not undo it; the capture mode, stream and memory pool do
not matter. More executable graphs instantiated from one capture, and graphs built through the
graph API (``cuGraphCreate`` + a child-graph node), did not slow anything. The engine captures a
graph per batch bucket (13 for ``max_num_seqs=256``), so its graphs all replay in the slow mode.

So :class:`SegmentedCapture` records every bucket's forward in *one* capture and notes which
nodes each forward added; :meth:`SegmentedCapture.graphs` then makes one executable graph per
forward from a clone of the capture with every other node removed (the forwards run one after
another on one stream, so a forward's nodes depend only on each other and on earlier forwards'
nodes, whose edges go with them). The capture itself is never instantiated; it owns the memory
pool the forwards allocated from, as ``torch.cuda.graph(..., pool=...)`` shared one pool before.
The engine uses it only with ``PAGED_OPS_ONE_CAPTURE=1`` (``ModelRunner._one_capture``): it is
correct on the H200, but its end-to-end gain is not measured yet.

The CUDA driver API is called through ``ctypes`` (``libcuda.so.1``); :func:`available` says
whether it can be. The graphs hold no random-number state: torch's replay prologue (generator
offsets) is not run, so a forward that draws random numbers must not be captured this way.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_CUDA_SUCCESS = 0
_CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _cuda() -> ctypes.CDLL:
    lib = _driver()
    if lib is None:
        raise RuntimeError("graph_split: libcuda.so.1 (the CUDA driver) cannot be loaded")
    return lib


def available() -> bool:
    """Whether the CUDA driver API this module calls can be loaded (CUDA machines)."""
    lib = _driver()
    return lib is not None and all(
        hasattr(lib, name)
        for name in ("cuGraphClone", "cuGraphNodeFindInClone", "cuGraphDestroyNode",
                     "cuGraphInstantiateWithFlags", "cuGraphLaunch", "cuGraphGetNodes")
    ) and (hasattr(lib, "cuStreamGetCaptureInfo_v3") or hasattr(lib, "cuStreamGetCaptureInfo_v2"))  # fmt: skip


def _check(rc: int, what: str) -> None:
    if rc != _CUDA_SUCCESS:
        raise RuntimeError(f"graph_split: {what} failed with CUresult {rc}")


def _capturing_graph(stream: torch.cuda.Stream) -> ctypes.c_void_p:
    """The CUgraph that ``stream``'s active capture records into."""
    lib = _cuda()
    status, ident, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
    deps, count = ctypes.c_void_p(), ctypes.c_size_t()
    handle = ctypes.c_void_p(stream.cuda_stream)
    if hasattr(lib, "cuStreamGetCaptureInfo_v3"):
        edges = ctypes.c_void_p()
        rc = lib.cuStreamGetCaptureInfo_v3(
            handle, ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
            ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(count),
        )  # fmt: skip
    else:
        rc = lib.cuStreamGetCaptureInfo_v2(
            handle, ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
            ctypes.byref(deps), ctypes.byref(count),
        )  # fmt: skip
    _check(rc, "cuStreamGetCaptureInfo")
    if status.value != _CAPTURE_ACTIVE or not graph.value:
        raise RuntimeError("graph_split: the stream is not capturing")
    return graph


def _nodes(graph: ctypes.c_void_p) -> set[int]:
    """Handles of every node of ``graph``."""
    lib = _cuda()
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    if count.value == 0:  # a non-NULL array with a count of 0 is CUDA_ERROR_INVALID_VALUE
        return set()
    array = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(graph, array, ctypes.byref(count)), "cuGraphGetNodes")
    return {int(array[i]) for i in range(count.value)}


class ExecGraph:
    """One executable graph cut out of a :class:`SegmentedCapture` (``replay()`` like
    ``torch.cuda.CUDAGraph``'s, on the current stream)."""

    def __init__(self, handle: ctypes.c_void_p, capture: SegmentedCapture) -> None:
        self._handle = handle
        self._capture = capture  # keeps the memory pool alive while this graph can run
        self._finalizer = weakref.finalize(self, _destroy_exec, handle.value)

    def replay(self) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        _check(_cuda().cuGraphLaunch(self._handle, ctypes.c_void_p(stream)), "cuGraphLaunch")


def _destroy_exec(handle: int) -> None:
    _cuda().cuGraphExecDestroy(ctypes.c_void_p(handle))


class SegmentedCapture:
    """One stream capture of several forwards, each marked by :meth:`segment`.

    Usage::

        capture = SegmentedCapture()
        with capture.recording():
            for bucket in buckets:
                with capture.untracked():
                    prepare(bucket)      # host work; its device work is not recorded
                with capture.segment(bucket):
                    outputs[bucket] = forward(bucket)
        graphs = capture.graphs()        # bucket -> ExecGraph
    """

    def __init__(self) -> None:
        self._torch_graph = torch.cuda.CUDAGraph(keep_graph=True)
        self._segments: dict[Any, set[int]] = {}
        self._graph: ctypes.c_void_p | None = None
        self.side_stream = torch.cuda.Stream()  # not captured: the steps' metadata copies

    @contextmanager
    def recording(self) -> Iterator[None]:
        # relaxed: the side stream's copies and event waits are not errors during the capture
        with torch.cuda.graph(self._torch_graph, capture_error_mode="relaxed"):
            self._graph = _capturing_graph(torch.cuda.current_stream())
            yield
        self._graph = ctypes.c_void_p(self._torch_graph.raw_cuda_graph())

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Device work of the body runs on :attr:`side_stream`, outside the capture (e.g. a
        step's metadata copies: only its host side matters to the forward being recorded);
        waited for on exit."""
        with torch.cuda.stream(self.side_stream):
            yield
        self.side_stream.synchronize()

    @contextmanager
    def segment(self, key: Any) -> Iterator[None]:
        """The nodes the body adds to the capture are the graph of ``key``."""
        if self._graph is None:
            raise RuntimeError("graph_split: segment() outside recording()")
        if key in self._segments:
            raise ValueError(f"graph_split: segment {key!r} recorded twice")
        before = _nodes(self._graph)
        yield
        self._segments[key] = _nodes(self._graph) - before

    def graphs(self) -> dict[Any, ExecGraph]:
        """One executable graph per segment, uploaded to the current stream."""
        lib = _cuda()
        assert self._graph is not None, "graphs() before recording()"
        every = _nodes(self._graph)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        out: dict[Any, ExecGraph] = {}
        for key, keep in self._segments.items():
            if not keep:
                raise RuntimeError(f"graph_split: segment {key!r} captured no work")
            clone = ctypes.c_void_p()
            _check(lib.cuGraphClone(ctypes.byref(clone), self._graph), "cuGraphClone")
            try:
                for node in every - keep:
                    copy = ctypes.c_void_p()
                    _check(lib.cuGraphNodeFindInClone(ctypes.byref(copy), ctypes.c_void_p(node),
                                                      clone), "cuGraphNodeFindInClone")  # fmt: skip
                    _check(lib.cuGraphDestroyNode(copy), "cuGraphDestroyNode")
                handle = ctypes.c_void_p()
                _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(handle), clone,
                                                       ctypes.c_ulonglong(0)), "instantiate")  # fmt: skip
            finally:
                lib.cuGraphDestroy(clone)
            graph = ExecGraph(handle, self)
            if hasattr(lib, "cuGraphUpload"):  # not on the first replay
                _check(lib.cuGraphUpload(handle, stream), "cuGraphUpload")
            out[key] = graph
        return out
