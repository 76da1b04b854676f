"""A captured CUDA graph's nodes as launches, for the parameterization check (cuda-python).

torch's `CUDAGraph(keep_graph=True)` keeps the raw cudaGraph_t after capture_end (it is
instantiated at the first replay). The driver API lists its nodes (cuGraphGetNodes) and
gives each its type (cuGraphNodeGetType); a kernel node its parameters
(cuGraphKernelNodeGetParams): function, grid, block, dynamic shared memory and argument
array. Each argument's size comes from cuFuncGetParamInfo (cuKernelGetParamInfo for a
library kernel), its bytes from the node's array (or its `extra` buffer). An 8-byte word of
an argument that is a device address (the driver answers cuPointerGetAttribute for it, or
for the byte before it: an end pointer) is marked `ADDRESS` (xgraph.adapter.Unchecked) and
left out: two captures differ in the addresses of their pools, and in nothing else unless
a launch depends on a per-step or a per-call value (the check reports either). An
argument of a class type passed by value is compared by its size only (marked
`by_value(size)`, counted in the report as not compared): ATen's kernels take
their functor, data array and offset calculators so, and their padding, unused slots and
empty functors hold whatever the host stack held before the launch, which differs with the
host code that ran before it (seen on an H200: silu, mul, pow, copy and cat kernels of
models with no leak differed there between steps). Such an argument is one wider than a
word, or, for a template kernel whose mangled name spells its parameters (`...Ev` and
then builtin types, template parameters `T_` and substitutions `S_`), one not of a builtin
type. Those launches are still compared by function, grid, block, shared memory and their
builtin arguments (the element count); the scalars inside a functor are compared on the
CPU backend, which records ops and their non-tensor arguments. Memset
nodes give element size, width, height and value; memcpy nodes their extents; other nodes
their type. A call the installed cuda-bindings lacks raises an XGraphError naming it.
"""

from __future__ import annotations

import bisect
import ctypes
import re
from typing import Any

from xgraph.adapter import ADDRESS, Launch, Unchecked, XGraphError, by_value

_BUFFER_POINTER = 1  # CU_LAUNCH_PARAM_BUFFER_POINTER (0 ends the list)
MAX_PARAMS = 4096  # a kernel's parameters fit in 32 KiB: no more can follow


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise XGraphError(
            "Reading CUDA graph nodes needs cuda-python: pip install cuda-bindings."
        ) from exc
    return driver


class _Driver:
    """The driver calls used here, each checked once: missing or failing ones are named."""

    def __init__(self) -> None:
        self.cu = _driver()
        self.ok = self.cu.CUresult.CUDA_SUCCESS

    def has(self, name: str) -> bool:
        return hasattr(self.cu, name)

    def call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.cu, name, None)
        if fn is None:
            raise XGraphError(
                f"The installed cuda-bindings has no {name}, which reading graph nodes needs; "
                "install cuda-bindings >= 12.4 (pip install -U cuda-bindings)."
            )
        err, *out = fn(*args)
        if err != self.ok:
            raise XGraphError(f"{name} failed ({err}) while reading a captured graph's nodes.")
        return out[0] if len(out) == 1 else tuple(out)


class _Pointers:
    """Whether a word is a device address, by the driver's answer (ranges cached)."""

    def __init__(self, d: _Driver) -> None:
        self.d = d
        attrs = d.cu.CUpointer_attribute
        self.start, self.size = (
            attrs.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            attrs.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        )
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.not_addresses: set[int] = set()

    def _known(self, w: int) -> bool:
        i = bisect.bisect_right(self.starts, w) - 1
        return i >= 0 and w <= self.ends[i]  # <=: an end pointer of the range too

    def __call__(self, w: int) -> bool:
        if w < 1 << 16 or w in self.not_addresses:
            return False  # small values are sizes, strides and counts
        if self._known(w):
            return True
        for probe in (w, w - 1):
            err, start = self.d.cu.cuPointerGetAttribute(self.start, probe)
            if err == self.d.ok:
                err, size = self.d.cu.cuPointerGetAttribute(self.size, probe)
                begin = int(start)
                end = begin + (int(size) if err == self.d.ok else probe - begin + 1)
                i = bisect.bisect(self.starts, begin)
                self.starts.insert(i, begin)
                self.ends.insert(i, end)
                return True
        self.not_addresses.add(w)
        return False


def _words(blob: bytes, is_pointer: _Pointers) -> list[int | Unchecked]:
    """Each 8-byte word of an argument: its value, or ADDRESS (marked, not compared) for a
    device address."""
    out: list[int | Unchecked] = []
    for o in range(0, len(blob), 8):
        w = int.from_bytes(blob[o : o + 8], "little")
        out.append(ADDRESS if len(blob[o : o + 8]) == 8 and is_pointer(w) else w)
    return out


class _Kernels:
    """Names and parameter layouts of kernel functions, read once per function."""

    def __init__(self, d: _Driver) -> None:
        self.d = d
        self.seen: dict[int, tuple[str, list[tuple[int, int]], list[bool]]] = {}

    def layout(self, p: Any) -> tuple[str, list[tuple[int, int]], list[bool]]:
        """(name, [(offset, size)] of each parameter, whether each parameter's bytes are
        compared) of a node's function or kernel."""
        handle, prefix = (p.func, "cuFunc") if int(p.func) else (p.kern, "cuKernel")
        key = int(handle)
        if key not in self.seen:
            name = _text(self.d.call(f"{prefix}GetName", handle))
            params = self._params(prefix, handle)
            compared = builtin_parameters(name, len(params)) or [s <= 8 for _, s in params]
            self.seen[key] = (name, params, compared)
        return self.seen[key]

    def _params(self, prefix: str, handle: Any) -> list[tuple[int, int]]:
        """(offset, size) of each parameter: asked one by one until the driver says there is
        no such parameter (no count call needed, so older drivers answer too)."""
        info = getattr(self.d.cu, f"{prefix}GetParamInfo", None)
        if info is None:
            self.d.call(f"{prefix}GetParamInfo")  # raises, naming the missing call
        out: list[tuple[int, int]] = []
        while len(out) < MAX_PARAMS:
            err, offset, size = info(handle, len(out))
            if err != self.d.ok:
                break
            out.append((int(offset), int(size)))
        return out


# a template function's mangled name ends with its return type (v) and its parameters: a
# builtin type, a pointer to one, a template parameter or a substitution each
_BUILTIN = r"P?K?[abcdefhijlmnostxy]"
_PARAMETER = re.compile(rf"{_BUILTIN}|T\d*_|S[0-9A-Z]*_")
_SIGNATURE = re.compile(rf"Ev((?:{_BUILTIN}|T\d*_|S[0-9A-Z]*_)+)$")


def builtin_parameters(name: str, count: int) -> list[bool] | None:
    """Per parameter, whether it is of a builtin type (or a pointer to one), read off the
    mangled name of a template kernel; None where the name does not spell `count`
    parameters that simply (a Triton kernel, a plain C function)."""
    m = _SIGNATURE.search(name)
    if m is None:
        return None
    params = _PARAMETER.findall(m.group(1))
    if len(params) != count:
        return None
    return [not p.startswith(("T", "S")) for p in params]


def _text(name: Any) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _arguments(p: Any, params: list[tuple[int, int]]) -> list[bytes]:
    """Each argument's bytes, from the node's kernelParams array or its extra buffer."""
    if int(p.kernelParams):
        array = (ctypes.c_void_p * len(params)).from_address(int(p.kernelParams))
        return [
            ctypes.string_at(array[i], size) if array[i] else b""
            for i, (_, size) in enumerate(params)
        ]
    if not int(p.extra):
        return [b"" for _ in params]
    extra = ctypes.cast(int(p.extra), ctypes.POINTER(ctypes.c_void_p))
    buffer, k = 0, 0
    while k < 8 and extra[k]:  # (key, value) pairs up to CU_LAUNCH_PARAM_END
        if extra[k] == _BUFFER_POINTER:
            buffer = extra[k + 1] or 0
        k += 2
    return [ctypes.string_at(buffer + o, size) if buffer else b"" for o, size in params]


def _kernel(d: _Driver, kernels: _Kernels, is_pointer: _Pointers, node: Any) -> Launch:
    p = d.call("cuGraphKernelNodeGetParams", node)
    name, params, compared = kernels.layout(p)
    config: list[tuple[str, Any]] = [
        ("grid", (int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ))),
        ("block", (int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ))),
        ("shared memory", int(p.sharedMemBytes)),
    ]
    for i, blob in enumerate(_arguments(p, params)):
        if compared[i]:
            words = _words(blob, is_pointer)
            config.append((f"arg {i}", words[0] if words else None))
        else:  # a class by value: its padding and unused slots are stack bytes
            config.append((f"arg {i}", by_value(len(blob))))
    return Launch("kernel", name, tuple(config))


def _memset(d: _Driver, node: Any) -> Launch:
    p = d.call("cuGraphMemsetNodeGetParams", node)
    fields = ("elementSize", "width", "height", "value")
    return Launch("memset", "memset", tuple((f, int(getattr(p, f))) for f in fields))


def _memcpy(d: _Driver, node: Any) -> Launch:
    p = d.call("cuGraphMemcpyNodeGetParams", node)
    fields = ("WidthInBytes", "Height", "Depth")
    return Launch("memcpy", "memcpy", tuple((f, int(getattr(p, f))) for f in fields))


def read_launches(raw_graph: int) -> list[Launch]:
    """The nodes of a raw cudaGraph_t (CUDAGraph.raw_cuda_graph()) as launches, in the
    driver's order (the order of capture: two captures of one forward list alike)."""
    d = _Driver()
    graph = d.cu.CUgraph(int(raw_graph))
    _, count = d.call("cuGraphGetNodes", graph, 0)
    nodes, _ = d.call("cuGraphGetNodes", graph, int(count))
    types = d.cu.CUgraphNodeType
    kernels, is_pointer = _Kernels(d), _Pointers(d)
    out = []
    for node in nodes:
        t = d.call("cuGraphNodeGetType", node)
        if t == types.CU_GRAPH_NODE_TYPE_KERNEL:
            out.append(_kernel(d, kernels, is_pointer, node))
        elif t == types.CU_GRAPH_NODE_TYPE_MEMSET:
            out.append(_memset(d, node))
        elif t == types.CU_GRAPH_NODE_TYPE_MEMCPY:
            out.append(_memcpy(d, node))
        else:
            out.append(
                Launch(
                    "node", str(getattr(t, "name", t)).removeprefix("CU_GRAPH_NODE_TYPE_").lower()
                )
            )
    return out
