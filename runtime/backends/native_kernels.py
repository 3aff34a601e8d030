"""Native CPU kernels the torch backend builds on first use (C, OpenMP, loaded with ctypes).

Why native: decode attention over a paged KV cache needs each row's keys, which live on
scattered pages. torch has no paged attention on CPU, so the torch path gathers the pages
into a workspace first, copying every key and value once more per step. The kernel in
`native/paged_decode_attention.c` reads the pages in place, once, with an online softmax in
vector loops, over (row, key span) work items shared by the threads.
`native/small_rows_matmul.c` is one more candidate form for decode projections (a
weight-streaming product for a few rows); warmup keeps it only where it measures fastest.
`native/fused_decode_layers.c` runs a whole decoder stack of a few-row float32 decode step in
one call (no per-op overhead); warmup keeps it only for the row counts where it beats the
per-op path.

The library is compiled once per source, compiler and CPU (`-march=native`) into
`$LLM_RUNTIME_NATIVE_CACHE` (default `~/.cache/llm-runtime/native`), under a file lock so
concurrent processes build it once. Without a C compiler the kernel is unavailable and
`unavailable_reason()` says why; callers fall back to the torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import torch

from runtime.quant.matrix import QuantizedMatrix

logger = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name("native") / name
    for name in (
        "paged_decode_attention.c",
        "small_rows_matmul.c",
        "fused_decode_layers.c",
        "quant_matmul.c",
        "quant_gemm.c",
        "argmax_rows.c",
    )
)
# Headers the sources include: part of the build's identity, not compiled on their own.
_HEADERS = tuple(
    Path(__file__).with_name("native") / name
    for name in (
        "quant_blocks.h",
        "quant_blocks_i8.h",
        "quant_blocks_i16.h",
        "gemm_panels.h",
        "gemm_panels_i16.h",
        "scratch_alloc.h",
        "exp_nonpositive.h",
    )
)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_I64: type[ctypes.c_int64] = ctypes.c_int64
# The attention's `mode` bits (ATTENTION_* in paged_decode_attention.c).
_ATTENTION_SPREAD = 1
_ATTENTION_READS_ONLY = 2
_PTR: type[ctypes.c_void_p] = ctypes.c_void_p


class NativeKernelsUnavailable(RuntimeError):
    """The native library cannot be built or loaded here (the message says why)."""


def _cache_dir() -> Path:
    configured = os.environ.get("LLM_RUNTIME_NATIVE_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "llm-runtime" / "native"


def c_compiler() -> str:
    """The C compiler the native kernels are built with: `CC`, else `cc` or `gcc`."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeKernelsUnavailable("no C compiler found (set CC or install gcc)")
    return compiler


def _cpu_identity() -> bytes:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return b""
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))).encode()


def _build(compiler: str) -> Path:
    source = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, check=False, text=True
        ).stdout
    except OSError as error:  # CC names a program that is not there (or cannot run)
        raise NativeKernelsUnavailable(
            f"the C compiler {compiler!r} cannot run: {error}"
        ) from error
    digest = hashlib.sha256(
        source + " ".join(_FLAGS).encode() + version.encode() + _cpu_identity()
    ).hexdigest()[:16]
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"llm-runtime-kernels-{digest}.so"
    if library.exists():
        return library
    with open(directory / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            staged = Path(scratch) / library.name
            sources = [str(path) for path in _SOURCES]
            command = [compiler, *_FLAGS, "-o", str(staged), *sources, "-lm"]
            result = subprocess.run(command, capture_output=True, check=False, text=True)
            if result.returncode != 0:
                raise NativeKernelsUnavailable(
                    f"compiling the native kernels failed ({' '.join(command)}): "
                    f"{result.stderr.strip()[-400:]}"
                )
            os.replace(staged, library)
    logger.info("built native kernels: %s", library)
    return library


def _int64_indices(pages: torch.Tensor, n_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The page table and key counts as the native kernels read them: contiguous int64."""
    return pages.to(torch.int64).contiguous(), n_keys.to(torch.int64).contiguous()


PagedDecodeInputs = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float
]
"""`(q, k_cache, v_cache, pages, n_keys, scale)` of one paged decode attention call."""


class PagedDecodeAttention:
    """`out[b] = softmax(q[b] K_b^T * scale) V_b` over row b's pages, read in place."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernels = {
            torch.float32: library.paged_decode_attention_f32,
            torch.bfloat16: library.paged_decode_attention_bf16,
        }
        for kernel in self._kernels.values():
            # ... scale, threads, spread
            kernel.argtypes = [*[_PTR] * 6, *[_I64] * 6, ctypes.c_float, *[ctypes.c_int] * 2]
            kernel.restype = ctypes.c_int
        self._walk = library.paged_kv_walk
        # k, v, element bytes, pages, n_keys, batch, kv, head_dim, block_size, width, threads
        self._walk.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, *[_I64] * 5, ctypes.c_int]
        self._walk.restype = ctypes.c_int

    def __call__(self, *inputs: *PagedDecodeInputs, spread: bool = False) -> torch.Tensor:
        """`unchecked` after checking its inputs: q `[B, kv, g, hd]`; caches
        `[blocks, kv, block_size, hd]`; pages `[B, W]`; n_keys `[B]` (keys per row).
        Returns float32 `[B, kv, g, hd]`. `spread`: the next page's lines are prefetched into
        L2, most during each page's read pass and all again through its math, instead of
        into L1 during the read pass (same result; which is faster depends on the CPU, so
        warmup times both)."""
        self._check(*inputs)
        return self.unchecked(*inputs, spread=spread)

    def walk(self, *inputs: *PagedDecodeInputs) -> int:
        """The call's memory side alone, for benchmarks: every key and value the attention
        would read, read in its order with its prefetches, without the math. Returns the OR
        of the bytes read. Timed beside the kernel, it splits attention's time into the
        access pattern's and the math's that does not hide under the reads."""
        self._check(*inputs)
        q, k_cache, v_cache, pages, n_keys, _scale = inputs
        return self.unchecked_walk(q.shape, k_cache, v_cache, pages, n_keys)

    def unchecked_walk(
        self,
        q_shape: torch.Size,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: torch.Tensor,
        n_keys: torch.Tensor,
    ) -> int:
        """`walk` for inputs already checked, as `unchecked` is to `__call__`: a benchmark
        timing the walk over every layer checks once, so that its time is the reads' (checking
        each call added ~50 us a layer on Zen 4)."""
        batch, kv, _, head_dim = q_shape
        pages64, keys64 = _int64_indices(pages, n_keys)
        seen = self._walk(
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.element_size(),
            pages64.data_ptr(),
            keys64.data_ptr(),
            batch,
            kv,
            head_dim,
            k_cache.shape[2],
            pages64.shape[1],
            torch.get_num_threads(),
        )
        if seen < 0:
            raise MemoryError("the paged K/V walk could not allocate its row order")
        return int(seen)

    def _check(self, *inputs: *PagedDecodeInputs) -> None:
        """Raises ValueError naming the first input that does not fit the kernel."""
        q, k_cache, v_cache, pages, n_keys, _scale = inputs
        batch, kv, _, head_dim = q.shape
        blocks, cache_kv, block_size, cache_hd = k_cache.shape
        if (cache_kv, cache_hd) != (kv, head_dim) or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"q {list(q.shape)} does not fit the caches {list(k_cache.shape)} / "
                f"{list(v_cache.shape)}"
            )
        kernel = self._kernels.get(k_cache.dtype)
        if kernel is None or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"cache dtype {k_cache.dtype}: allowed are float32 and bfloat16")
        contiguous = k_cache.is_contiguous() and v_cache.is_contiguous()
        if k_cache.device.type != "cpu" or not contiguous:
            raise ValueError("the caches must be contiguous CPU tensors")
        if pages.dim() != 2 or pages.shape[0] != batch or n_keys.shape != (batch,):
            raise ValueError(
                f"pages {list(pages.shape)} / n_keys {list(n_keys.shape)}: allowed are "
                f"[{batch}, W] and [{batch}]"
            )
        width = pages.shape[1]
        if batch and int(n_keys.max()) > width * block_size:
            raise ValueError(f"n_keys exceed the {width} page(s) of {block_size} tokens per row")
        if pages.numel() and (int(pages.min()) < -1 or int(pages.max()) >= blocks):
            raise ValueError(f"pages hold entries outside -1 and [0, {blocks})")

    def unchecked(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: torch.Tensor,
        n_keys: torch.Tensor,
        scale: float,
        *,
        spread: bool = False,
    ) -> torch.Tensor:
        """`__call__` for inputs the caller has validated (the model's decode does, once per
        step): a bad page id or key count here reads out of bounds."""
        batch, kv, group, head_dim = q.shape
        block_size = k_cache.shape[2]
        kernel = self._kernels[k_cache.dtype]
        q32 = q.to(torch.float32).contiguous()
        pages64, keys64 = _int64_indices(pages, n_keys)
        width = pages64.shape[1]
        out = torch.empty_like(q32)
        failed = kernel(
            q32.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            pages64.data_ptr(),
            keys64.data_ptr(),
            out.data_ptr(),
            batch,
            kv,
            group,
            head_dim,
            block_size,
            width,
            float(scale),
            torch.get_num_threads(),
            _ATTENTION_SPREAD if spread else 0,
        )
        if failed:
            raise MemoryError("paged decode attention could not allocate its scratch buffers")
        return out


class SmallRowsMatmul:
    """`rows @ W^T` for a few rows, streaming a contiguous `[out, in]` W once (float32 out)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernels = {
            torch.float32: library.small_rows_matmul_f32,
            torch.bfloat16: library.small_rows_matmul_bf16,
        }
        for kernel in self._kernels.values():
            kernel.argtypes = [*[_PTR] * 3, *[_I64] * 3, ctypes.c_int]
            kernel.restype = None

    def __call__(self, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        kernel = self._kernels.get(weight.dtype)
        if kernel is None or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(
                f"weight {weight.dtype} {list(weight.shape)} on {weight.device}: allowed is a "
                "2-D float32 or bfloat16 CPU tensor"
            )
        if rows.dim() != 2 or rows.shape[1] != weight.shape[1]:
            raise ValueError(
                f"rows has shape {list(rows.shape)}: allowed is [R, {weight.shape[1]}]"
            )
        return self.unchecked(weight.contiguous(), rows)

    def unchecked(self, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`__call__` for a contiguous 2-D CPU weight and matching rows (a decode projection
        calls this about 150 times a step, so it skips the checks)."""
        n_out, n_in = weight.shape
        x = (
            rows
            if rows.dtype == torch.float32 and rows.is_contiguous()
            else rows.float().contiguous()
        )
        out = torch.empty(x.shape[0], n_out)
        self._kernels[weight.dtype](
            weight.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], n_out, n_in, _threads()
        )
        return out


class ArgmaxRows:
    """Each row's first largest index (`native/argmax_rows.c`), as `torch.argmax(x, dim=-1)`
    gives it: NaN counts as largest, ties go to the first index."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernel = library.argmax_rows
        self._kernel.argtypes = [_PTR, _I64, _I64, _PTR, ctypes.c_int]
        self._kernel.restype = None

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `__call__` computes over x: a non-empty 2-D contiguous float32 CPU tensor."""
        return (
            x.dim() == 2
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.shape[1] > 0
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """int64 `[rows]`; raises where `takes(x)` is false."""
        if not self.takes(x):
            raise ValueError(
                f"x is {x.dtype} {list(x.shape)} on {x.device}: allowed is a contiguous 2-D "
                "float32 CPU tensor with at least one column"
            )
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._kernel(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), _threads())
        return out


class QuantBlocks(ctypes.Structure):
    """`qb_matrix` of `native/quant_blocks.h`: the kernels' view of a `QuantizedMatrix`."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("scale_f16", ctypes.c_int32),
        ("block", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("qs", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
    ]


QUANT_KIND_CODES = {"q4": 0, "q8": 1}


def quant_descriptor(matrix: QuantizedMatrix) -> int:
    """The address of `matrix`'s `qb_matrix` descriptor (built once, cached on the matrix).

    The descriptor lives as long as the matrix (which also keeps its tensors alive)."""
    view = matrix.native_view
    if view:
        return view[1]  # type: ignore[return-value]
    if matrix.device.type != "cpu":
        raise ValueError(f"matrix is on {matrix.device}: the native kernels need a CPU matrix")
    blocks = QuantBlocks(
        kind=QUANT_KIND_CODES[matrix.kind],
        scale_f16=int(matrix.scales.dtype == torch.float16),
        block=matrix.block,
        cols=matrix.cols,
        qs=matrix.qs.data_ptr(),
        scales=matrix.scales.data_ptr(),
        mins=None if matrix.mins is None else matrix.mins.data_ptr(),
    )
    view.extend((blocks, ctypes.addressof(blocks)))
    return view[1]  # type: ignore[return-value]


_PRODUCT_REASONS = {1: "out of memory for its prepared activations"}
_GEMM_REASONS = {1: "out of memory for its panels"}
_INT16_REASONS = {
    1: "out of memory for the int16 activations",
    2: "the int16-activation form takes q4 blocks and q8 blocks of 32 values only",
    3: "this CPU has no AVX-512 VNNI (the int16-activation kernel needs it)",
}
_INT8_REASONS = {
    1: "out of memory for the int8 activations",
    2: "allowed are q4 blocks and q8 blocks of 16, 32 or 64 values",
    3: "this CPU has no AVX-512 VNNI (the library was built without it)",
}
_ROUNDED_ERRORS: dict[int, type[Exception]] = {
    1: MemoryError,
    2: ValueError,
    3: NativeKernelsUnavailable,
}


class QuantMatmul:
    """`x @ W^T` with W a `QuantizedMatrix` read in its blocks (never dequantized whole), and
    row tiles of W dequantized into a caller's buffer (for prefill's torch.mm)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._matmul = library.quant_matmul
        self._matmul.argtypes = [_PTR] * 3 + [_I64] * 2 + [ctypes.c_int]
        self._matmul.restype = ctypes.c_int
        self._dequantize = library.quant_dequantize_rows
        self._dequantize.argtypes = [_PTR, _I64, _I64, _PTR, ctypes.c_int]
        self._dequantize.restype = None
        self._take = library.quant_take_rows
        self._take.argtypes = [_PTR, _PTR, _I64, _PTR]
        self._take.restype = None
        self._matmul_i8 = library.quant_matmul_i8
        self._matmul_i8.argtypes = [_PTR] * 3 + [_I64] * 2 + [ctypes.c_int]
        self._matmul_i8.restype = ctypes.c_int
        self._gemm = library.quant_gemm
        self._gemm.argtypes = [_PTR] * 3 + [_I64] * 2 + [ctypes.c_int]
        self._gemm.restype = ctypes.c_int
        self.int8_available = bool(library.quant_i8_available())
        """This CPU runs the int8-activation form (AVX-512 VNNI, `quant_blocks_i8.h`)."""
        self._matmul_i16 = library.quant_matmul_i16
        self._matmul_i16.argtypes = [_PTR] * 3 + [_I64] * 2 + [ctypes.c_int]
        self._matmul_i16.restype = ctypes.c_int
        self.int16_panel_from_rows = int(library.quant_i16_panel_from_rows())
        """Rows from which int16 products run on int16 panels (`gemm_panels_i16.h`): below,
        q4 blocks stream, and q8 blocks stream at one row (the fused stack's keep float32
        activations at 2 rows up to this)."""
        self.int16_available = bool(library.quant_q4_int16())
        """This CPU runs q4 products with int16 activations (AVX-512 VNNI,
        `quant_blocks_i16.h`)."""

    def __call__(self, matrix: QuantizedMatrix, x: torch.Tensor) -> torch.Tensor:
        """`unchecked` after checking x: `[R, matrix.cols]` on the CPU. Returns float32
        `[R, matrix.rows]`."""
        if x.dim() != 2 or x.shape[1] != matrix.cols or x.device.type != "cpu":
            raise ValueError(
                f"x is {list(x.shape)} on {x.device}: allowed is a CPU tensor [R, {matrix.cols}]"
            )
        return self.unchecked(matrix, x)

    def unchecked(self, matrix: QuantizedMatrix, x: torch.Tensor) -> torch.Tensor:
        """`__call__` without the checks (a decode step calls this ~150 times): x must be a
        2-D CPU tensor `[R, matrix.cols]` (cast to contiguous float32 when it is not)."""
        return self._run(self._matmul, "quant_matmul", _PRODUCT_REASONS, matrix, x)

    def unchecked_gemm(self, matrix: QuantizedMatrix, x: torch.Tensor) -> torch.Tensor:
        """`unchecked` for many rows (`native/quant_gemm.c`): panels of the weight dequantized
        into a per-thread buffer and multiplied by a register-tiled kernel, for prefill and
        large decode batches. Same tolerance as `unchecked`; only the summation order
        differs."""
        return self._run(self._gemm, "quant_gemm", _GEMM_REASONS, matrix, x)

    def unchecked_int8(self, matrix: QuantizedMatrix, x: torch.Tensor) -> torch.Tensor:
        """`unchecked` with the activations quantized to int8 per block (VNNI): within
        `runtime.quant.rounded_activations.error_bound` of the exact product, not bit-equal.
        Raises where `int8_available` is false or the blocks are not q4 / q8 of 16, 32 or 64."""
        return self._run(self._matmul_i8, "quant_matmul_i8", _INT8_REASONS, matrix, x)

    def unchecked_int16(self, matrix: QuantizedMatrix, x: torch.Tensor) -> torch.Tensor:
        """`unchecked` over q4 blocks or q8 blocks of 32 with the activations rounded to int16
        per block (VNNI): within `runtime.quant.rounded_activations.error_bound(...,
        INT16_LEVELS)` of the exact product, not bit-equal. Raises where `int16_available` is
        false or the blocks are not ones `int16_takes`."""
        return self._run(self._matmul_i16, "quant_matmul_i16", _INT16_REASONS, matrix, x)

    @staticmethod
    def _run(
        kernel: Callable[..., int],
        name: str,
        reasons: dict[int, str],
        matrix: QuantizedMatrix,
        x: torch.Tensor,
    ) -> torch.Tensor:
        """One product kernel's `x @ W^T`; its nonzero codes raised as `reasons` say (1 out
        of memory, 2 blocks it does not take, 3 a CPU without the instructions)."""
        view = matrix.native_view  # the descriptor's cached fast path: ~150 calls a step
        descriptor = view[1] if view else quant_descriptor(matrix)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, matrix.rows)
        code = kernel(descriptor, x.data_ptr(), out.data_ptr(), rows, matrix.rows, _threads())
        if code:
            raise _ROUNDED_ERRORS.get(code, RuntimeError)(
                f"{name} on {matrix.kind} blocks of {matrix.block}: "
                f"{reasons.get(code, f'error {code}')}"
            )
        return out

    def take_rows(self, matrix: QuantizedMatrix, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (1-D, each in `[0, rows)`) as float32 `[len(index), cols]`, bit-equal
        to `matrix.take_rows(index)` (one native call: a decode step's token embeddings of a
        tied head cost ~5 us instead of ~60 us of torch ops)."""
        if index.dim() != 1 or index.device.type != "cpu" or index.is_floating_point():
            raise ValueError(f"index is {index.dtype} {list(index.shape)}: allowed is 1-D integer")
        if index.numel():
            low, high = torch.aminmax(index)
            if int(low) < 0 or int(high) >= matrix.rows:
                raise ValueError(f"index holds rows outside [0, {matrix.rows})")
        index = index.to(torch.int64).contiguous()
        out = torch.empty(index.shape[0], matrix.cols)
        self._take(quant_descriptor(matrix), index.data_ptr(), index.shape[0], out.data_ptr())
        return out

    def dequantize_rows(
        self, matrix: QuantizedMatrix, start: int, stop: int, out: torch.Tensor
    ) -> None:
        """Rows `[start, stop)` of `matrix` as float32 into `out` (contiguous float32 with
        at least `(stop - start) * cols` elements, filled row-major), bit-equal to
        `matrix.dequantize(start, stop)`."""
        if not 0 <= start <= stop <= matrix.rows:
            raise ValueError(
                f"rows [{start}, {stop}): allowed is 0 <= start <= stop <= {matrix.rows}"
            )
        needed = (stop - start) * matrix.cols
        if (
            out.dtype != torch.float32
            or not out.is_contiguous()
            or out.device.type != "cpu"
            or out.numel() < needed
        ):
            raise ValueError(
                f"out is {out.dtype} {list(out.shape)} on {out.device}: allowed is a contiguous "
                f"float32 CPU tensor of at least {needed} elements"
            )
        self._dequantize(quant_descriptor(matrix), start, stop, out.data_ptr(), _threads())


@attrs.frozen
class DecodeStackGeometry:
    """What the fused decode stack needs to know about the model and its cache."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    block_size: int
    norm_eps: float


# Addresses per layer in the fused stack's table (see `fused_decode_layers.c`).
STACK_TABLE_WIDTH = 8
STACK_PHASES = (
    "norm and QKV",
    "rotary and KV writes",
    "attention",
    "O projection",
    "norm, gate/up and SwiGLU",
    "down projection",
    "final norm and head",
)
"""The fused stack's timed phases, in its order (`FusedDecodeLayers.timing`)."""
# The mixed stack's per-layer weight parts: 4 projections x 3 parts x 6 int64
# {kind, block, rows, weight/qs address, scales address, mins address}.
STACK_MAX_PARTS = 3
STACK_PART_FIELDS = 6
STACK_PARTS_WIDTH = 4 * STACK_MAX_PARTS * STACK_PART_FIELDS
STACK_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")

StackPart = torch.Tensor | QuantizedMatrix
"""One part of a fused-stack projection: a float32 weight (in the projection's layout) or blocks."""


ACTIVATIONS = ("float32", "int16", "int8")
"""How block weights meet their activations in the fused stack: float32, rounded to int16 per
block (the blocks `int16_takes`: `quant_blocks_i16.h`, `gemm_panels_i16.h`) or quantized to
int8 per block (`quant_blocks_i8.h`)."""


def part_kind_code(part: StackPart, layout: int, activations: str = "float32") -> int:
    """The mixed stack's kind code: 0/1 float32 `[out, in]` / `[in, out]`; 2/3 q4 with f16/f32
    scales; 4/5 q8 with f16/f32 scales; 6-9 those four with int8 activations ("int8", for
    blocks `int8_takes`); 10-13 the four with int16 activations ("int16", for blocks
    `int16_takes`)."""
    if isinstance(part, QuantizedMatrix):
        code = 2 + 2 * QUANT_KIND_CODES[part.kind] + int(part.scales.dtype == torch.float32)
        if activations == "int8" and int8_takes(part):
            return code + 4
        if activations == "int16" and int16_takes(part):
            return code + 8
        return code
    return layout


def int16_takes(matrix: QuantizedMatrix) -> bool:
    """Whether the int16-activation products compute over these blocks: q4, or q8 in blocks
    of 32 (Q8_0). q8 blocks stream at one row and run on int16 panels from two rows in
    `unchecked_int16`; the fused stack's int16 variant gives them float32 activations from
    two rows up to `QuantMatmul.int16_panel_from_rows`."""
    return matrix.kind == "q4" or matrix.block == 32


def int8_takes(matrix: QuantizedMatrix) -> bool:
    """Whether the int8-activation form computes over these blocks (q4, or q8 blocks of 16,
    32 or 64 values; `quant_blocks_i8.h`)."""
    return matrix.kind == "q4" or matrix.block in (16, 32, 64)


def _part_fields(
    part: StackPart, layout: int, n_in: int, where: str, activations: str
) -> tuple[int, list[int]]:
    """(output rows, the 6 fields) of one part, checked against the projection's input width."""
    if isinstance(part, QuantizedMatrix):
        if part.cols != n_in or part.device.type != "cpu":
            raise ValueError(
                f"{where}: blocks {list(part.shape)} on {part.device}: allowed is [rows, {n_in}] "
                "on the CPU"
            )
        mins = 0 if part.mins is None else part.mins.data_ptr()
        fields = [part.qs.data_ptr(), part.scales.data_ptr(), mins]
        code = part_kind_code(part, layout, activations)
        return part.rows, [code, part.block, part.rows, *fields]
    if layout not in (0, 1):
        raise ValueError(f"{where}: layout {layout}: allowed are 0 [out, in] and 1 [in, out]")
    rows = part.shape[0] if layout == 0 else part.shape[-1]
    shape = (rows, n_in) if layout == 0 else (n_in, rows)
    if (
        part.dtype != torch.float32
        or tuple(part.shape) != shape
        or not part.is_contiguous()
        or part.device.type != "cpu"
    ):
        raise ValueError(
            f"{where}: weight {part.dtype} {list(part.shape)}: allowed is a contiguous float32 "
            f"CPU tensor [{shape[0]}, {shape[1]}] (layout {layout})"
        )
    return rows, [layout, 0, rows, part.data_ptr(), 0, 0]


def stack_parts_table(
    geometry: DecodeStackGeometry,
    layers: Sequence[Sequence[Sequence[StackPart]]],
    layouts: Sequence[int] = (0, 0, 0, 0),
    *,
    activations: str = "float32",
) -> torch.Tensor:
    """The mixed stack's parts table, int64 `[n_layers, STACK_PARTS_WIDTH]`, checked.

    `layers[l][p]` lists projection p's parts (p in `STACK_PROJECTIONS` order, at most 3,
    stacked by output rows); float32 parts are in `layouts[p]` (0 `[out, in]`, 1
    `[in, out]`). `activations` (`ACTIVATIONS`): "int8" runs the block parts the int8 form
    takes with int8 activations, "int16" the parts `int16_takes` with int16 ones (each raises where
    this CPU cannot). The table holds addresses: the parts must outlive its use."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: allowed are {ACTIVATIONS}")
    if activations == "int8" and not quant_matmul().int8_available:
        raise NativeKernelsUnavailable(_INT8_REASONS[3])
    if activations == "int16" and not quant_matmul().int16_available:
        raise NativeKernelsUnavailable(_INT16_REASONS[3])
    g = geometry
    q_out, kv_out = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    shapes = (
        (g.dim, q_out + 2 * kv_out),
        (q_out, g.dim),
        (g.dim, 2 * g.ffn_dim),
        (g.ffn_dim, g.dim),
    )
    if len(layers) != g.n_layers:
        raise ValueError(f"layers has {len(layers)} entries: allowed is n_layers={g.n_layers}")
    rows = []
    for index, projections in enumerate(layers):
        if len(projections) != len(STACK_PROJECTIONS):
            raise ValueError(f"layer {index} has {len(projections)} projections: allowed is 4")
        row: list[int] = []
        for name, parts, layout, (n_in, n_out) in zip(
            STACK_PROJECTIONS, projections, layouts, shapes, strict=True
        ):
            where = f"layer {index} {name}"
            if not 1 <= len(parts) <= STACK_MAX_PARTS:
                raise ValueError(f"{where}: {len(parts)} parts: allowed are 1 to {STACK_MAX_PARTS}")
            total = 0
            for part in parts:
                part_rows, fields = _part_fields(part, layout, n_in, where, activations)
                total += part_rows
                row.extend(fields)
            if total != n_out:
                raise ValueError(f"{where}: parts hold {total} output rows: allowed is {n_out}")
            row.extend([-1, 0, 0, 0, 0, 0] * (STACK_MAX_PARTS - len(parts)))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).view(g.n_layers, STACK_PARTS_WIDTH)


def stack_head_parts(
    parts: Sequence[StackPart], layout: int, dim: int, vocab: int, *, activations: str
) -> torch.Tensor:
    """The head's entry for the fused stack (`StackHead.parts`), int64
    `[STACK_MAX_PARTS * STACK_PART_FIELDS]`, in a parts-table projection's layout: up to 3
    float32 (in `layout`) or quantized parts of `[rows, dim]` stacked to `vocab` rows, their
    activations as `stack_parts_table` sets them."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: allowed are {ACTIVATIONS}")
    if not 1 <= len(parts) <= STACK_MAX_PARTS:
        raise ValueError(f"head: {len(parts)} parts: allowed are 1 to {STACK_MAX_PARTS}")
    fields: list[int] = []
    total = 0
    for part in parts:
        part_rows, part_fields = _part_fields(part, layout, dim, "head", activations)
        total += part_rows
        fields.extend(part_fields)
    if total != vocab:
        raise ValueError(f"head: parts hold {total} output rows: allowed is {vocab}")
    fields.extend([-1, 0, 0, 0, 0, 0] * (STACK_MAX_PARTS - len(parts)))
    return torch.tensor(fields, dtype=torch.int64)


@attrs.frozen(eq=False)
class StackHead:
    """The head as the fused stack's last stage: its parts (`stack_head_parts`) and the
    float32 logits `[rows, vocab]` they are written to. Needs the final norm in the call."""

    parts: torch.Tensor
    logits: torch.Tensor


class FusedDecodeLayers:
    """Every decoder layer of a float32 decode step for a few rows, in one native call.

    The caller passes a layer table (`STACK_TABLE_WIDTH` addresses per layer: attention norm,
    QKV, O, MLP norm, gate/up, down, K cache, V cache) and the four projections' layouts
    (0 `[out, in]`, 1 `[in, out]`); `x` `[rows, dim]` (float32, contiguous) is the residual
    stream, updated in place. The tensors behind the table must outlive the call.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernel = library.fused_decode_layers
        self._kernel.argtypes = (
            [_PTR] * 11 + [_I64] * 10 + [ctypes.c_float] * 2 + [ctypes.c_int] * 2 + [_PTR]
        )
        self._kernel.restype = ctypes.c_int
        self._phases: torch.Tensor | None = None
        self._reads_only = False

    @contextlib.contextmanager
    def timing(self) -> Iterator[torch.Tensor]:
        """Within the block, every call adds each phase's seconds (`STACK_PHASES`, summed over
        the layers; a phase lasts until its slowest thread is done) to the yielded float64
        tensor: where a fused step's time goes, as it runs. For benchmarks: the kernels are
        one per process, so calls from other threads in the block (lanes run as threads)
        add to it too."""
        seconds = torch.zeros(len(STACK_PHASES), dtype=torch.float64)
        previous, self._phases = self._phases, seconds
        try:
            yield seconds
        finally:
            self._phases = previous

    @contextlib.contextmanager
    def attention_reads_only(self) -> Iterator[None]:
        """Within the block, every call's attention phase reads its pages as the attention
        does (order, read pass, prefetches) and skips the math, leaving its outputs at zero:
        for benchmarks, the page walk timed where the attention runs, in the stack's own
        thread team and between its other phases. The calls' results are meaningless, and as
        with `timing` the kernels are one per process: calls from other threads in the block
        (lanes run as threads) read only too. Never for serving."""
        previous, self._reads_only = self._reads_only, True
        try:
            yield
        finally:
            self._reads_only = previous

    def unchecked(
        self,
        geometry: DecodeStackGeometry,
        table: torch.Tensor,
        layouts: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pages: torch.Tensor,
        n_keys: torch.Tensor,
        final_norm: torch.Tensor | None = None,
        head: StackHead | None = None,
        *,
        spread: bool = False,
    ) -> None:
        """Run the stack on `x` in place. Inputs are the model's, validated once per step by
        its decode: `table` int64 `[n_layers, 8]`, `layouts` int64 `[4]`, `cos`/`sin` the
        model's rotary tables `[positions, head_dim]` (read at each row's position), `pages`
        int64 `[rows, W]`, `n_keys` int64 `[rows]` (position + 1), `final_norm` the model's
        final RMSNorm weight `[dim]` to apply to x at the end (None: x is left un-normed),
        `head` the head to run on the normed x (it needs `final_norm`); `spread` as in
        `PagedDecodeAttention`. A bad address, page id, position or key count here reads out
        of bounds."""
        self._call(
            geometry, table, layouts, None, x, cos, sin, pages, n_keys, final_norm, head, spread
        )

    def unchecked_mixed(
        self,
        geometry: DecodeStackGeometry,
        table: torch.Tensor,
        parts: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pages: torch.Tensor,
        n_keys: torch.Tensor,
        final_norm: torch.Tensor | None = None,
        head: StackHead | None = None,
        *,
        spread: bool = False,
    ) -> None:
        """`unchecked` with the projections taken from `parts` (`stack_parts_table`: each
        projection up to 3 float32 or quantized parts stacked by output rows) instead of the
        table's 4 projection columns (unused here) and `layouts`."""
        self._call(
            geometry, table, None, parts, x, cos, sin, pages, n_keys, final_norm, head, spread
        )

    def _call(
        self,
        g: DecodeStackGeometry,
        table: torch.Tensor,
        layouts: torch.Tensor | None,
        parts: torch.Tensor | None,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pages: torch.Tensor,
        n_keys: torch.Tensor,
        final_norm: torch.Tensor | None,
        head: StackHead | None,
        spread: bool,
    ) -> None:
        if head is not None and final_norm is None:
            raise ValueError("the stack's head reads the normed stream: pass final_norm too")
        failed = self._kernel(
            table.data_ptr(),
            0 if layouts is None else layouts.data_ptr(),
            0 if parts is None else parts.data_ptr(),
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            pages.data_ptr(),
            n_keys.data_ptr(),
            0 if final_norm is None else final_norm.data_ptr(),
            0 if head is None else head.parts.data_ptr(),
            0 if head is None else head.logits.data_ptr(),
            0 if head is None else head.logits.shape[1],
            x.shape[0],
            g.n_layers,
            g.dim,
            g.n_heads,
            g.n_kv_heads,
            g.head_dim,
            g.ffn_dim,
            g.block_size,
            pages.shape[1],
            g.norm_eps,
            g.head_dim**-0.5,
            _threads(),
            (_ATTENTION_SPREAD if spread else 0)
            | (_ATTENTION_READS_ONLY if self._reads_only else 0),
            0 if self._phases is None else self._phases.data_ptr(),
        )
        if failed:
            raise MemoryError("the fused decode stack could not allocate its buffers")


def _threads() -> int:
    return torch.get_num_threads()


@attrs.frozen
class NativeKernels:
    """The loaded library's kernels."""

    paged_decode_attention: PagedDecodeAttention
    small_rows_matmul: SmallRowsMatmul
    fused_decode_layers: FusedDecodeLayers
    quant_matmul: QuantMatmul
    argmax_rows: ArgmaxRows


@functools.cache
def _load() -> NativeKernels | str:
    try:
        library = ctypes.CDLL(str(_build(c_compiler())))
        return NativeKernels(
            PagedDecodeAttention(library),
            SmallRowsMatmul(library),
            FusedDecodeLayers(library),
            QuantMatmul(library),
            ArgmaxRows(library),
        )
    except (NativeKernelsUnavailable, OSError) as error:
        logger.warning("native CPU kernels unavailable: %s", error)
        return str(error)


def native_kernels() -> NativeKernels:
    """The native kernels (built on first call); raises when they cannot be used here."""
    loaded = _load()
    if isinstance(loaded, str):
        raise NativeKernelsUnavailable(loaded)
    return loaded


def paged_decode_attention() -> PagedDecodeAttention:
    """The in-place paged decode attention kernel."""
    return native_kernels().paged_decode_attention


def small_rows_matmul() -> SmallRowsMatmul:
    """The weight-streaming few-rows matrix product."""
    return native_kernels().small_rows_matmul


def fused_decode_layers() -> FusedDecodeLayers:
    """The one-call float32 decoder stack for a few rows."""
    return native_kernels().fused_decode_layers


def quant_matmul() -> QuantMatmul:
    """The product over quantized weight blocks (and their tile dequantization)."""
    return native_kernels().quant_matmul


def argmax_rows() -> ArgmaxRows:
    """Each row's first largest index (the greedy choice over a vocabulary)."""
    return native_kernels().argmax_rows


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here, or None when they can."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else None
