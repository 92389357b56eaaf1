"""Hand-written CPU kernels (cpu_kernels.cpp), compiled per CPU family, called via ctypes:
paged attention (decode rows; prefill chunks in tiles of queries x keys on AVX2 and up, token
by token in the scalar build), writing K/V into their slots, bf16 and float32 GEMMs over weights
packed once at load, the fused element-wise layers (residual add + RMSNorm, RoPE in place,
SiLU-and-mul), greedy argmax, and the loop over all decoder layers as one call (DecoderLayers,
over packed float weights and quantized ones, through kernels/quant.py's kernels by address).

Variants (VARIANTS): the same source compiled with each family's target flags, which select
its code paths: `avx512bf16` (bf16 dot products in the GEMMs, decode and tiled prefill
attention; AMX-BF16 tiles for bf16 GEMMs of AMX_MIN_ROWS rows or more where the CPU and the
kernel allow them: amx_in_use, describe_amx), `avx512` (AVX-512 float32 FMAs, bf16 converted in registers), `avx2` (AVX2+FMA,
8-lane float32 FMAs, bf16 converted in registers as llama.cpp does), `scalar` (plain loops, the compiler's baseline target). The best one this
CPU's flags allow is loaded at first use; $PAGEDSERVE_CPU_KERNELS=<name> forces one (refused
if the CPU lacks its flags), and tests run every variant the CPU supports (using_variant).
Every variant packs weights alike and computes in float32 (bf16 storage: rounded where the
reference rounds). `auto` keeps a bf16 checkpoint in bf16 where the CPU has bf16 arithmetic
(avx512bf16) and stores float32 elsewhere, the faster for batches there (auto_keeps_bf16;
dtype="bfloat16" still runs bf16 weights through every variant).

Only the chosen variant is compiled, with the system C++ compiler, and cached under
~/.cache/pagedserve/kernels by the contents of the sources (csrc/: the entry file and every room
it includes) and the flags; no torch headers. `pagedserve kernels` (kernels/prebuild.py, run by
scripts/setup.sh) builds them ahead; a build at first use logs a warning with an estimate. Where it cannot be built, callers fall back to plain torch (with a warning).
KernelLibrary does the choosing, building, caching and switching for a source and its variants;
this module's functions (choose_variant, load, use_variant, using_variant, ...) front its
instance KERNELS, and kernels/quant.py holds another for quant_kernels.cpp.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.config import cache_dir
from pagedserve.quant_format import R8, R8_GEMM
from pagedserve.utils import cdiv

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")     # the C++ rooms; one entry file per library includes its own
SOURCE = CSRC / "cpu_kernels.cpp"
COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-semantic-interposition"]
PARTITION_SIZE = 256      # context tokens per decode-attention work item
ENV_VARIANT = "PAGEDSERVE_CPU_KERNELS"


@dataclass(frozen=True)
class Variant:
    """One build of cpu_kernels.cpp: the compiler's target flags (they select the source's
    code paths through __AVX512BF16__ / __AVX512F__ / __AVX2__) and the CPU flags (as
    /proc/cpuinfo names them) it needs."""
    name: str
    target_flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    default_needs: tuple[str, ...] = ()    # flags without which it is runnable but not the default choice


class KernelLibrary:
    """One C++ source compiled per CPU family and loaded through ctypes: its variants (best
    first; only `scalar` off x86), the environment variable that forces one, the C functions'
    signatures, and the active variant with its library. Picks the variant (the override, else
    the best the CPU's flags allow, else the next that builds), builds each on first use
    (_build: cached by source and flags) and switches between them. cpu.py and quant.py each
    hold one (KERNELS) behind their module-level functions."""

    def __init__(self, source: Path, variants: tuple[Variant, ...], env_var: str, signatures: dict,
                 variant_symbol: str, kind: str, log: logging.Logger, unavailable: str,
                 on_switch=None, build_seconds: dict[str, int] | None = None) -> None:
        if platform.machine() not in ("x86_64", "AMD64"):
            variants = tuple(v for v in variants if v.name == "scalar")
        self.source, self.variants, self.env_var, self.signatures = source, variants, env_var, signatures
        self.by_name = {v.name: v for v in variants}
        self.variant_symbol = variant_symbol     # the C function naming the build (restype char*)
        self.kind, self.log, self.unavailable = kind, log, unavailable    # messages: "<kind> variant ...", warning
        self.on_switch = on_switch               # called after every switch of the active variant
        self.build_seconds = build_seconds or {}  # per variant: a build's time on a quiet core (the log's estimate)
        self.libs: dict[str, ctypes.CDLL | None] = {}     # per variant; None: it failed to build or load
        self.active: str | None = None                    # the variant the module's wrappers call
        self.lib: ctypes.CDLL | None = None               # its library

    def supported(self) -> list[str]:
        """The variants this CPU can run, best first (always ends with `scalar`)."""
        return [v.name for v in self.variants if set(v.cpu_flags) <= cpu_flags()]

    def missing_flags(self, name: str) -> list[str]:
        """The CPU flags variant `name` needs that this CPU lacks."""
        return sorted(set(self.by_name[name].cpu_flags) - cpu_flags())

    def forced(self) -> str | None:
        """The variant the environment variable names (None where unset or `auto`)."""
        value = os.environ.get(self.env_var, "").strip().lower()
        return None if value in ("", "auto") else value

    def choose(self) -> str:
        """The environment variable's variant if set (refused if this CPU cannot run it), else
        the best the CPU supports that has its default_needs."""
        forced = self.forced()
        if forced is None:
            return next(v for v in self.supported() if set(self.by_name[v].default_needs) <= cpu_flags())
        if forced not in self.by_name:
            raise ValueError(f"{self.env_var}={forced!r}: expected one of auto, {', '.join(self.by_name)}")
        if self.missing_flags(forced):
            raise RuntimeError(f"{self.env_var}={forced}: this CPU lacks {', '.join(self.missing_flags(forced))}; "
                               f"it supports {', '.join(self.supported())}")
        return forced

    def load_variant(self, name: str) -> ctypes.CDLL | None:
        """Variant `name`'s library, compiled on first use; None (with a warning) if it cannot
        be built. Raises where this CPU cannot run it."""
        if name in self.libs:
            return self.libs[name]
        if self.missing_flags(name):
            raise RuntimeError(f"{self.kind} variant {name!r} needs {', '.join(self.missing_flags(name))}, "
                               "which this CPU lacks")
        lib = None
        try:
            lib = ctypes.CDLL(str(self.build(name)))
            for fn_name, argtypes in self.signatures.items():
                fn = getattr(lib, fn_name)
                fn.restype = ctypes.c_int
                fn.argtypes = argtypes
            getattr(lib, self.variant_symbol).restype = ctypes.c_char_p
        except (OSError, RuntimeError, AttributeError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            self.log.warning(self.unavailable, name, detail[-2000:])
            lib = None
        self.libs[name] = lib
        return lib

    def build(self, name: str) -> Path:
        """Variant `name`'s compiled library, built now where it is not cached yet (saying so
        first, with an estimate: the first run on a machine waits for it)."""
        variant = self.by_name[name]
        if not library_path(variant, self.source).exists():
            self.log.warning("compiling the %s library %s (variant %s) for this CPU, once: about %d s on a quiet "
                             "core (cached under %s; `pagedserve kernels` builds it ahead, as scripts/setup.sh does)",
                             self.kind, self.source.name, name, self.build_seconds.get(name, 30), cache_dir("kernels"))
        return _build(variant, self.source)

    def load(self) -> ctypes.CDLL | None:
        """The active variant's library (chosen by choose() on first call; where the best one
        fails to build, e.g. a compiler without its flags, the next one); None if none can be
        built."""
        if self.active is None:
            chosen = self.choose()
            candidates = self.supported()
            for name in [chosen] if self.forced() else candidates[candidates.index(chosen):]:
                if self.use(name) is not None:
                    break
        return self.lib

    def use(self, name: str) -> ctypes.CDLL | None:
        """Make variant `name` the active one."""
        self.active, self.lib = name, self.load_variant(name)
        if self.on_switch is not None:
            self.on_switch()
        return self.lib

    @contextlib.contextmanager
    def using(self, name: str):
        """Run a block with variant `name` active, then restore the previous one (the default where
        none was chosen yet: loaded first, so that the block's variant does not stay)."""
        self.load()
        previous = self.active
        self.use(name)
        try:
            yield self.lib
        finally:
            if previous is not None:
                self.use(previous)

    def variant(self) -> str | None:
        """The variant in use (after load()), or None where none could be loaded."""
        return self.active if self.load() is not None else None


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = _AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
VARIANTS = (     # best first
    Variant("avx512bf16", _AVX512 + ("-mavx512bf16",),
            ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")),
    Variant("avx512", _AVX512, ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")),
    Variant("avx2", _AVX2, ("avx2", "fma", "f16c")),
    Variant("scalar", (), ()),     # the compiler's baseline for this architecture (x86-64: SSE2)
)
TILED_PREFILL_VARIANTS = ("avx512bf16", "avx512", "avx2")    # scalar runs prefill tokens through the decode kernel

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_attention_f32": [_P, _I, _P, _P, _P, _I, _P] + [_I] * 7 + [_F, _I, _P],
    "paged_attention_bf16": [_P, _I, _P, _P, _P, _I, _P] + [_I] * 7 + [_F, _I, _P],
    "paged_attention_kv8_f32": [_P, _I, _P, _P, _P, _I, _P] + [_I] * 7 + [_F, _I, _I, _P],
    "paged_attention_kv8_bf16": [_P, _I, _P, _P, _P, _I, _P] + [_I] * 7 + [_F, _I, _I, _P],
    "decoder_layers_f32": [_P] * 14 + [_I],
    "decoder_layers_bf16": [_P] * 14 + [_I],
    "decoder_layers_kv8_f32": [_P] * 14 + [_I, _I],
    "decoder_layers_kv8_bf16": [_P] * 14 + [_I, _I],
    "lora_delta_f32": [_P, _I, _I, _P, _I, _P, _I, _I],
    "lora_delta_bf16": [_P, _I, _I, _P, _I, _P, _I, _I],
    "lora_handover_config": [_I],
    "lora_handovers": [],
    "write_kv8": [_P] * 2 + [_I] * 4 + [_P] * 3 + [_I] * 9,
    "linear_packed_bf16": [_P] * 4 + [_I] * 3,
    "linear_packed_f32": [_P] * 4 + [_I] * 3,
    "linear_packed_ld_bf16": [_P] * 4 + [_I] * 4,     # x, w, bias, y, ldy, M, N, K
    "linear_packed_ld_f32": [_P] * 4 + [_I] * 4,
    "write_kv": [_P, _P] + [_I] * 4 + [_P] * 3 + [_I] * 8,
    "add_rms_norm_f32": [_P] * 4 + [_I] * 2 + [_F],
    "add_rms_norm_bf16": [_P] * 4 + [_I] * 2 + [_F],
    "rope_inplace_f32": [_P] + [_I] * 4 + [_P] * 2 + [_I],
    "rope_inplace_bf16": [_P] + [_I] * 4 + [_P] * 2 + [_I],
    "silu_and_mul_f32": [_P] * 2 + [_I] * 2,
    "silu_and_mul_bf16": [_P] * 2 + [_I] * 2,
    "argmax_rows_f32": [_P] + [_I] * 2 + [_P],
    "gemm_amx_config": [_I, _I],
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

KERNELS = KernelLibrary(SOURCE, VARIANTS, ENV_VARIANT, _SIGNATURES, "kernel_variant", "CPU kernel", logger,
                        "CPU kernels (%s) unavailable, using slower torch paths: %s",
                        on_switch=lambda: _on_switch(),     # wrappers resolve functions per variant
                        # measured on a 2-core Zen 3 (AVX-512 ones estimated: their builds are 2-3x avx2's)
                        build_seconds={"avx512bf16": 45, "avx512": 40, "avx2": 15, "scalar": 7})
VARIANTS = KERNELS.variants      # as this machine has them (off x86: scalar only)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read:
    then torch's own view of the CPU stands in)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        return frozenset(line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        capability = torch.backends.cpu.get_cpu_capability()      # "AVX512", "AVX2", "DEFAULT", ...
        return frozenset(VARIANTS[1].cpu_flags if capability == "AVX512" else
                         VARIANTS[2].cpu_flags if capability == "AVX2" else ())


def supported_variants() -> list[str]:
    """The variants this CPU can run, best first (always ends with `scalar`)."""
    return KERNELS.supported()


def missing_flags(name: str) -> list[str]:
    """The CPU flags variant `name` needs that this CPU lacks."""
    return KERNELS.missing_flags(name)


def choose_variant() -> str:
    """$PAGEDSERVE_CPU_KERNELS if set (refused if this CPU cannot run it), else the best the
    CPU supports."""
    return KERNELS.choose()


def describe() -> dict:
    """What benchmarks record beside their numbers: the variant in use, the ones this CPU
    supports, its model name and its vector feature flags."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return dict(cpu_kernels=variant(), cpu_kernels_supported=supported_variants(), cpu_amx=describe_amx(),
                cpu_model=model,
                cpu_flags=sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))))


def variant() -> str | None:
    """The kernel variant in use (after load()), or None where none could be loaded."""
    return KERNELS.variant()


# ---- AMX: the bf16 GEMM's path for many rows ----------------------------------------------------
# The avx512bf16 build multiplies bf16 GEMMs of at least AMX_MIN_ROWS rows of x with AMX tiles
# (tdpbf16ps on the packed weights as they are) where the CPU has AMX-BF16 and the kernel grants
# the process tile data (arch_prctl); fewer rows keep the vdpbf16ps tiles. Measured interleaved
# in one process (2 threads, Sapphire Rapids): at 1-2 rows both stream the weights at the same
# bandwidth (vdpbf16ps up to 15% faster at 1 row); AMX is 1.3-1.5x faster from 3-4 rows at the
# 135M shapes, even at 4 and 1.4x from 6 at the 1.7B ones, 2x at 8, 4-7x at 16, ~9x at 128-512
# (benchmarks/gemm.py). $PAGEDSERVE_AMX=0 turns it off (A/B runs); set_amx / using_amx switch it
# at run time (tests, benchmarks).
AMX_MIN_ROWS = 4
ENV_AMX = "PAGEDSERVE_AMX"
_amx_wanted: bool | None = None       # set_amx's choice; None: the environment's
_amx_min_rows: int | None = None      # set_amx's threshold; None: AMX_MIN_ROWS
_amx_active = False                   # whether the active library uses AMX now


def _on_switch() -> None:
    _compiled.cache_clear()
    _configure_amx()


def _configure_amx() -> None:
    global _amx_active
    wanted = _amx_wanted if _amx_wanted is not None else os.environ.get(ENV_AMX, "1").strip() not in ("0", "off")
    lib = KERNELS.lib
    _amx_active = bool(lib is not None and lib.gemm_amx_config(int(wanted), _amx_min_rows or AMX_MIN_ROWS))


def amx_in_use() -> bool:
    """Whether the active variant's bf16 GEMM runs large batches on AMX now."""
    load()
    return _amx_active


def amx_min_rows() -> int:
    """The rows of x from which the bf16 GEMM takes AMX (where amx_in_use())."""
    return _amx_min_rows or AMX_MIN_ROWS


def set_amx(enabled: bool | None, min_rows: int | None = None) -> bool:
    """Turn the AMX path on or off (None: as $PAGEDSERVE_AMX says) and set its threshold (None:
    AMX_MIN_ROWS), for the active variant and any loaded later; returns amx_in_use()."""
    global _amx_wanted, _amx_min_rows
    _amx_wanted, _amx_min_rows = enabled, min_rows
    load()
    _configure_amx()
    return _amx_active


@contextlib.contextmanager
def using_amx(enabled: bool, min_rows: int | None = None):
    """Run a block with AMX on or off (and a threshold), then restore the previous setting;
    yields amx_in_use()."""
    previous = (_amx_wanted, _amx_min_rows)
    try:
        yield set_amx(enabled, min_rows)
    finally:
        set_amx(*previous)


def describe_amx() -> str:
    """The AMX path's state in words (the log line and benchmarks' records)."""
    if amx_in_use():
        return f"AMX-BF16 GEMM from {amx_min_rows()} rows"
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        return "no AMX (the CPU lacks amx_bf16)"
    if KERNELS.active != "avx512bf16":
        return f"no AMX (variant {KERNELS.active})"
    if _amx_wanted is False or (_amx_wanted is None and os.environ.get(ENV_AMX, "1").strip() in ("0", "off")):
        return f"AMX off ({ENV_AMX}=0)" if _amx_wanted is None else "AMX off (set_amx)"
    return "no AMX (the kernel refused tile data: arch_prctl)"


# CPUs without bf16 arithmetic (AVX2, AVX-512 without BF16): True keeps bf16 weights (half the
# bytes to stream per token) with float32 arithmetic in our kernels; False stores float32.
# Measured on the avx2 build (benchmarks/RESULTS.md, AVX2): float32 storage gives 1.17x (ShareGPT-
# like) and 1.46x (Alpaca-like) the batched throughput of bf16 storage, whose in-register
# conversions cost more than its halved bytes save once a step is compute-bound; bf16 decodes a
# single stream 1.3x faster. Serving is batched, so float32.
BF16_STORAGE_WITHOUT_BF16_ARITHMETIC = False


def auto_keeps_bf16() -> bool:
    """Whether dtype `auto` keeps a bf16 (or fp16) checkpoint in bf16 on this CPU: where our
    kernels run (every variant has a bf16 GEMM; float32 arithmetic but for avx512bf16), per
    BF16_STORAGE_WITHOUT_BF16_ARITHMETIC; without them only with native bf16, since torch's
    own bf16 matmul elsewhere runs at ~1.5% of its float32 rate."""
    if load() is None:
        return "avx512_bf16" in cpu_flags()
    return KERNELS.active == "avx512bf16" or BF16_STORAGE_WITHOUT_BF16_ARITHMETIC


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def included_sources(source: Path) -> list[Path]:
    """`source` and every file it includes with #include "..." (transitively; resolved against
    the including file's folder, as the compiler does), each once, in the order first met: what
    the build's cache key hashes, so editing any room or header rebuilds the library."""
    seen: dict[Path, None] = {}
    todo = [source.resolve()]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen[path] = None
        todo += [(path.parent / name).resolve() for name in _INCLUDE.findall(path.read_text())]
    return list(seen)


def _flags(v: Variant) -> list[str]:
    return [*COMMON_FLAGS, *v.target_flags, f"-DPAGEDSERVE_VARIANT=\"{v.name}\""]


def library_path(v: Variant, source: Path = SOURCE) -> Path:
    """Where variant v of `source` is cached: keyed by the contents of the source and every file
    it includes, and the flags."""
    key = hashlib.sha256()
    for path in included_sources(source):
        key.update(os.path.relpath(path, source.parent.resolve()).encode() + b"\0" + path.read_bytes() + b"\0")
    key.update(" ".join(_flags(v)).encode() + platform.machine().encode())
    return cache_dir("kernels") / f"{source.stem}-{v.name}-{key.hexdigest()[:16]}.so"


def _build(v: Variant, source: Path = SOURCE) -> Path:
    """Compile variant v of `source` once (cached at library_path; processes may race: atomic
    rename). kernels/quant.py builds quant_kernels.cpp through it too."""
    flags = _flags(v)
    path = library_path(v, source)
    if path.exists():
        return path
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) found")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tmp_so = Path(tmp) / path.name
        subprocess.run([compiler, *flags, str(source), "-o", str(tmp_so)], check=True, capture_output=True,
                       text=True)
        os.replace(tmp_so, path)
    return path


def load_variant(name: str) -> ctypes.CDLL | None:
    """Variant `name`'s library, compiled on first use; None (with a warning) if it cannot be
    built. Raises where this CPU cannot run it."""
    return KERNELS.load_variant(name)


def load() -> ctypes.CDLL | None:
    """The active variant's library (chosen by choose_variant on first call; where the best
    one fails to build, e.g. a compiler without -mavx512bf16, the next one); None if none can
    be built."""
    return KERNELS.load()


def use_variant(name: str) -> ctypes.CDLL | None:
    """Make variant `name` the one every wrapper below calls (tests and benchmarks run each
    variant the CPU supports). Weights packed before stay valid: every variant packs alike."""
    return KERNELS.use(name)


def using_variant(name: str):
    """Run a block with variant `name` active, then restore the previous one (a context manager
    yielding its library)."""
    return KERNELS.using(name)


class AttentionRows(ctypes.Structure):
    """One step's query rows for the attention kernel (`AttentionRows` in cpu_kernels.cpp):
    each sequence's block table, context length and first query row (decodes, one query
    each, first); with prefills also the per-token view (AttentionMetadata.per_token), which
    the kernel uses where its tiled prefill path does not apply. Holds the tensors it points
    into."""
    _fields_ = [("tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
                ("query_start", ctypes.c_void_p), ("num_seqs", ctypes.c_int64), ("num_decodes", ctypes.c_int64),
                ("token_tables", ctypes.c_void_p), ("token_table_stride", ctypes.c_int64),
                ("token_lens", ctypes.c_void_p), ("window", ctypes.c_int64), ("num_verify", ctypes.c_int64)]

    @classmethod
    def of(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor, num_decodes: int,
           per_token: tuple[torch.Tensor, torch.Tensor] | None, window: int | None = None,
           num_verify: int = 0) -> "AttentionRows":
        """block_tables [S, width], seq_lens [S], query_start [S + 1]: int64, contiguous;
        per_token: (tables, lens) per query token, needed only with prefills; window: a sliding
        window (each query reads its last `window` positions only; the table's -1 entries before
        them are never read); num_verify: verification chunks after the decodes, whose rows take the
        decode kernel one by one (per_token), as decode rows would."""
        tok_tables, tok_lens = per_token or (None, None)
        rows = cls(block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), query_start.data_ptr(),
                   seq_lens.shape[0], num_decodes, None if tok_tables is None else tok_tables.data_ptr(),
                   0 if tok_tables is None else tok_tables.stride(0), None if tok_lens is None else tok_lens.data_ptr(),
                   window or 0, num_verify)
        rows._keep = (block_tables, seq_lens, query_start, per_token)
        return rows


class ScoreMods(ctypes.Structure):
    """A layer's changes to its attention scores (`ScoreMods` in cpu_kernels.cpp): logit
    soft-capping (0: none) and the float32 sink logit per query head (None: none). Holds the
    tensor it points into."""
    _fields_ = [("softcap", ctypes.c_float), ("sinks", ctypes.c_void_p)]

    @classmethod
    def of(cls, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> "ScoreMods | None":
        """None where there is nothing to change (the kernels take a null pointer)."""
        if not softcap and sinks is None:
            return None
        sinks32 = None if sinks is None else sinks.detach().float().contiguous()
        mods = cls(softcap, None if sinks32 is None else sinks32.data_ptr())
        mods._keep = sinks32
        mods.heads = 0 if sinks32 is None else sinks32.numel()
        return mods


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, rows: AttentionRows, scale: float,
                    kv_code: int = 0, mods: ScoreMods | None = None) -> torch.Tensor | None:
    """q: [T, Hq, D] (rows may be strided); kv_cache: [2, blocks, block_size, Hkv, D] (any
    strides but the last) in q's dtype, or (kv_code: an 8-bit format, attention/kv_format.py)
    uint8 rows [..., D (+ 2 scale bytes)]; mods: the layer's soft-capping and sinks (sinks
    [Hq]). None where the kernel does not apply."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    fn = _kernel("paged_attention_kv8" if kv_code else "paged_attention", q)
    if fn is None or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or \
            (kv_code != 0) != (kv_cache.dtype == torch.uint8) or (not kv_code and kv_cache.dtype != q.dtype):
        return None
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if mods is not None and mods.heads not in (0, num_heads):     # the kernel reads one sink per query head
        raise ValueError(f"attention sinks: {mods.heads} logits for {num_heads} query heads")
    if q.stride(2) != 1 or q.stride(1) != head_dim:      # heads of a token side by side
        q = q.contiguous()
    out = torch.empty(n, num_heads, head_dim, dtype=q.dtype)
    extra = (kv_code,) if kv_code else ()
    status = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), ctypes.addressof(rows), n,
                out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size, *k_cache.stride()[:3], scale,
                PARTITION_SIZE, *extra, None if mods is None else ctypes.addressof(mods))
    return out if status == 0 else None


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, kv_code: int = 0) -> torch.Tensor | None:
    """Decode-only batches: q [N, Hq, D], one query per sequence of block_tables [N, width],
    seq_lens [N] (int64)."""
    starts = torch.arange(q.shape[0] + 1)
    return paged_attention(q, kv_cache, AttentionRows.of(block_tables, seq_lens, starts, q.shape[0], None), scale,
                           kv_code)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_code: int = 0) -> bool:
    """Copy k, v [T, Hkv, D] into their slots of kv_cache [2, blocks, block_size, Hkv, D] (any
    strides but the last); with kv_code (an 8-bit format), quantize each row into the uint8
    cache's rows [..., D (+ 2)]. False where the kernel does not apply."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if load() is None or not kv_cache.is_cpu or k.dtype != v.dtype or \
            k.stride(-1) != 1 or v.stride(-1) != 1 or slot_mapping.dtype != torch.int64 or \
            k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        return False
    lib, (num_tokens, num_kv_heads, head_dim) = KERNELS.lib, k.shape
    slots = slot_mapping.contiguous()
    if kv_code:
        if kv_cache.dtype != torch.uint8 or k.dtype not in (torch.float32, torch.bfloat16):
            return False
        status = lib.write_kv8(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), num_tokens, num_kv_heads,
                               head_dim, k_cache.shape[1], *k_cache.stride()[:3], int(k.dtype == torch.bfloat16),
                               kv_code)
        return status == 0
    if k.dtype != kv_cache.dtype:
        return False
    lib.write_kv(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), num_tokens, num_kv_heads, head_dim,
                 k_cache.shape[1], *k_cache.stride()[:3], k.element_size())
    return True


@dataclass
class PackedWeight:
    """A linear layer's weight [N, K], packed once at load into the tiles of our GEMM: 16
    output columns at a time, bf16 as [N/16, K/2, 16, 2] (pairs along K, the operand of the
    AVX512-BF16 dot product; other variants split each pair into even and odd K in registers),
    float32 as [N/16, K, 16]; N padded to a multiple of 32. The same for every variant."""
    data: torch.Tensor
    out_features: int
    in_features: int


def pack_weight(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """`weight` [N, K] packed for repeated products (torch's GEMM repacks weights on every
    call: 1.2-2x slower over a model's weights at 1-1024 rows). The plain weight where our GEMM
    does not run (another device or dtype, odd K in bf16, no compiled kernels)."""
    n, k = weight.shape
    if not weight.is_cpu or _kernel("linear_packed", weight) is None or (weight.dtype == torch.bfloat16 and k % 2):
        return weight
    padded = torch.zeros(cdiv(n, 32) * 32, k, dtype=weight.dtype)
    padded[:n] = weight
    if weight.dtype == torch.bfloat16:
        tiles = padded.view(-1, 16, k // 2, 2).transpose(1, 2)
    else:
        tiles = padded.view(-1, 16, k).transpose(1, 2)
    return PackedWeight(tiles.contiguous(), n, k)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a plain or a packed (pack_weight) weight."""
    if not isinstance(weight, PackedWeight):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    bias32 = None if bias is None else bias.float()
    _kernel("linear_packed", x)(x.data_ptr(), weight.data.data_ptr(), None if bias32 is None else bias32.data_ptr(),
                                out.data_ptr(), x.shape[0], weight.out_features, weight.in_features)
    return out


class _ModelDims(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + \
               [(n, ctypes.c_int64) for n in ("quant_small", "quant_tiles", "small_rows", "decode_rows",
                                              "quant_handover", "rope_dim")] + \
               [("residual_scale", ctypes.c_float)] + \
               [(n, ctypes.c_int64) for n in ("quant_moe", "experts", "top_k", "moe_intermediate", "norm_topk_prob",
                                              "qk_norm_full")] + \
               [("clip_qkv", ctypes.c_float), ("softcap", ctypes.c_float), ("activation", ctypes.c_int64)] + \
               [("moe_scoring", ctypes.c_int64), ("moe_glu", ctypes.c_int64), ("swiglu_alpha", ctypes.c_float),
                ("swiglu_limit", ctypes.c_float), ("quant_invariant", ctypes.c_int64)]


class _CacheRefs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("layer", "kv", "block", "token", "head", "block_size", "partition_size")]


class _LoraProj(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("a", "bt", "ldb", "nparts")] + \
               [("offset", ctypes.c_int64 * 3), ("size", ctypes.c_int64 * 3), ("btp", ctypes.c_int64)]


def lora_pack_bt(BT: torch.Tensor) -> torch.Tensor:
    """BT [..., rows, out] (rows even) in rank pairs, [..., rows / 2, out, 2]: the AMX tiles'
    layout of the expand's weights (lora_delta's bf16 AMX path reads it where given; made at
    adapter load, lora/weights.py)."""
    *lead, rows, out = BT.shape
    return BT.reshape(*lead, rows // 2, 2, out).transpose(-1, -2).contiguous()


class _LoraRefs(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_void_p), ("row_block", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("slot_info", ctypes.c_void_p), ("span", ctypes.c_int64)]


_PROJECTIONS = ("qkv", "o", "gate_up", "down")
_MOE_BUILDS = ("avx512vnni", "avx2", "avxvnni", "vnni256", "scalar")      # the quant variants whose quant_moe_experts runs (kernels/moe.py)
_TILE_COLUMNS = (2, 6, 9, 12)     # where each projection's tile_rows lies in a LayerPtrs row
_GROUP_COLUMN, _SLOT_COLUMN = 23, 24    # a layer's KV group and cache slot in a LayerPtrs row
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def _quant_parts(weight) -> list | None:
    """A projection's quantized weights (kernels/quant.py): [w] for one QuantizedWeight, the
    parts of a fused projection stored apart (a tuple of them); None for anything else (a
    packed float weight, or a tuple with a float part: the compiled loop does not run those)."""
    from pagedserve.kernels import quant      # quant imports this module
    if isinstance(weight, quant.QuantizedWeight):
        return [weight]
    if isinstance(weight, tuple) and weight and all(isinstance(p, quant.QuantizedWeight) for p in weight):
        return list(weight)
    return None


def _projection_shape(weight) -> tuple[int, int]:
    """(output rows, input columns) of a packed float weight, a quantized one or its parts."""
    parts = _quant_parts(weight)
    if parts is not None:
        return sum(p.shape[0] for p in parts), parts[0].shape[1]
    if isinstance(weight, PackedWeight):
        return weight.out_features, weight.in_features
    return tuple(weight.shape)


def _check_projection_shapes(model) -> None:
    """The compiled loop sizes every buffer from the model's args and each kernel writes one
    output per weight row and reads one input per weight column: a weight of another shape than
    the args imply would make them write past a buffer, so it is refused here, before any call."""
    a = model.args
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    want = {"qkv": (q + 2 * kv, a.hidden_size), "o": (a.hidden_size, q),
            "gate_up": (2 * a.intermediate_size, a.hidden_size), "down": (a.hidden_size, a.intermediate_size)}
    for i, layer in enumerate(model.layers):
        for name in _PROJECTIONS:
            if layer.moe is not None and name in ("gate_up", "down"):      # (its experts: the MoE table's checks)
                continue
            have = _projection_shape(getattr(layer, name))
            if have != want[name]:
                raise ValueError(f"layer {i} {name}: a weight of {have[0]} rows x {have[1]} columns, but the "
                                 f"model's config implies {want[name][0]} x {want[name][1]}: the compiled layer "
                                 f"loop's buffers would not fit it")


class DecoderLayers:
    """Every decoder layer of a Llama-family model as one compiled call per step
    (`decoder_layers_*` in cpu_kernels.cpp: the loop of LlamaModel.forward over the same
    kernels). Built once from the layers' weights; holds a table of their addresses. Each
    projection is a packed float weight or quantized (a quant.QuantizedWeight, or a tuple of
    them for a fused projection stored in parts): the table says which, and quantized ones run
    through kernels/quant.py's kernels by address (quant_linear_small up to its thresholds,
    quant_linear_tiles over this library's GEMM above), as quant.linear does. kv_code: the
    8-bit KV format (attention/kv_format.py; 0: the model's dtype)."""

    def __init__(self, model, kv_code: int = 0) -> None:
        a = model.args
        _check_projection_shapes(model)
        self.dtype = model.dtype
        self.kv_code = kv_code
        # float32 biases for the GEMM, kept alive here: the table holds their addresses.
        self._biases = [None if w.qkv_bias is None else w.qkv_bias.float().contiguous() for w in model.layers]
        self._norms = [t.contiguous() for w in model.layers for t in (w.input_norm, w.post_norm)] + \
                      [model.norm.contiguous()]
        # q/k norms (Qwen3), which layers rotate (SmolLM3's NoPE layers) and with which tables
        # (Gemma 3's window layers: the local ones), sandwich norms (Gemma), sinks (gpt-oss), and
        # each layer's KV group and cache slot (set_groups): LayerPtrs' last columns
        self._qk_norms = [tuple(None if t is None else t.contiguous() for t in (w.q_norm, w.k_norm))
                          for w in model.layers]
        self._out_norms = [tuple(None if t is None else t.contiguous() for t in (w.attn_out_norm, w.mlp_out_norm))
                           for w in model.layers]
        self._sinks = [None if w.sinks is None else w.sinks.float().contiguous() for w in model.layers]
        self._o_biases = [None if w.o_bias is None else w.o_bias.float().contiguous() for w in model.layers]
        no_rope = set(a.no_rope_layers)
        windows = a.windows()
        local = bool(a.local_rope_theta)
        self._parts = []          # the QuantPart arrays the table points to
        self._tiles: list[tuple[int, int, int]] = []    # (layer, column of tile_rows in the table, weight columns)
        # mixture-of-experts layers: each one's router and kernels/moe.py's table of its experts
        from pagedserve.kernels import moe as moe_kernels        # (it imports quant, which imports this module)
        self._moe = [moe_kernels.layer_table(w) for w in model.layers]
        rows = []
        for i, (w, bias) in enumerate(zip(model.layers, self._biases)):
            qkv, o, gate_up, down = (self._projection(getattr(w, name)) for name in _PROJECTIONS)
            moe = self._moe[i]
            rows.append([*qkv, 0 if bias is None else bias.data_ptr(), *o, *gate_up, *down,
                         self._norms[2 * i].data_ptr(), self._norms[2 * i + 1].data_ptr(),
                         *(0 if t is None else t.data_ptr() for t in self._qk_norms[i]),
                         0 if i in no_rope else 2 if local and windows[i] is not None else 1,
                         *((0, 0) if moe is None else (moe.router.data_ptr(), ctypes.addressof(moe.table.array))),
                         *(0 if t is None else t.data_ptr() for t in (*self._out_norms[i], self._sinks[i])),
                         0, i,
                         *(0 if t is None else t.data_ptr() for t in (self._o_biases[i], moe and moe.router_bias))])
            for column, proj in zip(_TILE_COLUMNS, (qkv, o, gate_up, down)):
                if proj[1]:
                    self._tiles.append((i, column, proj[2]))
        self._table = torch.tensor(rows, dtype=torch.int64)
        self._threads = 0         # the thread count tile_rows was computed for (0: not yet)
        self._quant_lib = None    # the quant library _dims has the addresses of
        self._weights = [tuple(getattr(w, n) for n in _PROJECTIONS) for w in model.layers]    # the table points into them
        # every quantized projection in an r8 layout: decode batches keep its integer dots up to more rows
        parts = [p for w in self._weights for proj in w for p in (_quant_parts(proj) or [])]
        self._all_r8 = bool(parts) and all(p.qtype in R8 for p in parts)
        self._all_gemm = self._all_r8 and all(p.qtype in R8_GEMM for p in parts)    # prefill chunks too (quant.batch_rows)
        self.quantized = bool(self._parts) or any(m is not None for m in self._moe)     # (quant's kernels)
        self._dims = _ModelDims(a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
                                a.intermediate_size, a.rms_norm_eps, model.scale,    # quant_*: _quant_calls
                                rope_dim=a.rope_dim, residual_scale=a.residual_multiplier,
                                qk_norm_full=int(a.qk_norm_full), clip_qkv=a.clip_qkv,
                                softcap=a.attn_logit_softcapping, activation=_ACTIVATIONS[a.mlp_activation])
        tables = [m for m in self._moe if m is not None]
        if tables:
            d = self._dims
            d.experts, d.top_k, d.norm_topk_prob = a.moe.num_experts, a.moe.top_k, int(a.moe.norm_topk_prob)
            d.moe_intermediate = tables[0].table.intermediate
            d.moe_scoring = moe_kernels.SCORINGS[a.moe.scoring]
            d.moe_glu, d.swiglu_alpha, d.swiglu_limit = moe_kernels.glu_of(a.moe)
        # (layer_group, layer_slot) as the table has them: one group, layer l in cache slot l, until set_groups
        self.groups = ((0,) * a.num_layers, tuple(range(a.num_layers)))
        self._fn = _compiled("decoder_layers_kv8" if kv_code else "decoder_layers", self.dtype)

    def _projection(self, weight) -> tuple[int, int, int]:
        """A projection's (w, nparts, its weight columns) for its table row (Proj in
        cpu_kernels.cpp; the columns become tile_rows in _quant_calls); (0, 0, 0) for none (an
        MoE layer's MLP)."""
        from pagedserve.kernels import quant
        if weight is None:
            return 0, 0, 0
        parts = _quant_parts(weight)
        if parts is None:
            return weight.data.data_ptr(), 0, 0
        array = (quant.QuantPart * len(parts))(*[quant.c_part(p) for p in parts])
        self._parts.append(array)
        return ctypes.addressof(array), len(parts), parts[0].shape[1]

    def set_groups(self, layer_group: tuple[int, ...], layer_slot: tuple[int, ...]) -> None:
        """A hybrid model's KV groups (kv/groups.py, set by the worker after the load): layer l
        attends with group layer_group[l]'s rows over cache slot layer_slot[l]."""
        if (layer_group, layer_slot) != self.groups:
            self._table[:, _GROUP_COLUMN] = torch.tensor(layer_group)
            self._table[:, _SLOT_COLUMN] = torch.tensor(layer_slot)
            self.groups = (layer_group, layer_slot)

    @staticmethod
    def supports(model, kv_code: int = 0) -> bool:
        """Whether the compiled loop runs this model: its kernels are built, its MLP's activation
        is one the loop has, and every projection is a packed float weight or quantized with
        kernels/quant.py's kernels built."""
        from pagedserve.kernels import quant
        if _compiled("decoder_layers_kv8" if kv_code else "decoder_layers", model.dtype) is None or \
                model.args.mlp_activation not in _ACTIVATIONS:
            return False
        from pagedserve.kernels import moe as moe_kernels
        spec = getattr(model.args, "moe", None)
        if spec is not None and (spec.scoring not in moe_kernels.SCORINGS or any(
                w.moe is not None and moe_kernels.layer_table(w) is None for w in model.layers)):
            return False
        weights = [getattr(w, n) for w in model.layers for n in _PROJECTIONS if getattr(w, n) is not None]
        quantized = [t for t in weights if not isinstance(t, PackedWeight)]
        return all(_quant_parts(t) is not None for t in quantized) and (
            not quantized or quant.kernel_address("quant_linear_small") is not None)

    def _quant_calls(self, invariant: bool = False) -> bool:
        """The quant kernels' addresses and thresholds as kernels/quant.py has them now (it may
        have switched variants since the table was built; `invariant`: a batch-invariant step's); False where none is built."""
        from pagedserve.kernels import quant
        lib = quant.load()
        if lib is None:
            return False
        d = self._dims
        if lib is not self._quant_lib:        # the addresses once per library (ctypes casts cost, per step)
            d.quant_small = quant.kernel_address("quant_linear_small")
            d.quant_tiles = quant.kernel_address("quant_linear_tiles")
            d.quant_handover = quant.kernel_address("quant_handover_next")
            d.quant_moe = quant.kernel_address("quant_moe_experts") if d.experts else 0
            self._quant_lib = lib
        if d.experts and quant.variant() not in _MOE_BUILDS:
            return False
        bf16 = self.dtype == torch.bfloat16
        d.small_rows = quant.batch_rows(False, bf16, self._all_r8, invariant, self._all_gemm)
        d.decode_rows = quant.batch_rows(True, bf16, self._all_r8, invariant)
        d.quant_invariant = int(invariant)
        if self._threads != torch.get_num_threads():     # tile_rows as quant.linear computes it now
            self._threads = torch.get_num_threads()
            for layer, column, cols in self._tiles:
                self._table[layer, column] = quant.tile_rows(cols)
        return True

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: torch.Tensor, slot_mapping: torch.Tensor | list[torch.Tensor],
                rows: AttentionRows | list[AttentionRows],
                lora: "tuple[LoraTable, torch.Tensor] | None" = None,
                local: tuple[torch.Tensor, torch.Tensor] | None = None, invariant: bool = False) -> bool:
        """x (residual) and h (first layer's normalised input) [T, H], updated in place to the
        final residual and normalised hidden state; cos, sin [T, D] (local: the window layers'
        own, Gemma 3); kv_caches [slots, 2, blocks, block_size, Hkv, D] (any strides but the
        last); slot_mapping, rows: the step's slots and query rows, one of each per KV group
        (set_groups); lora: the step's LoRA weights and each row's slot block (int64 [T];
        negative: none); invariant: a batch-invariant step. False (nothing done to x and h) where it does not apply."""
        num_tokens = x.shape[0]
        cache_dtype = torch.uint8 if self.kv_code else self.dtype
        cos_l, sin_l = local or (cos, sin)
        rows = [rows] if isinstance(rows, AttentionRows) else rows
        slots = [m.contiguous() for m in ([slot_mapping] if isinstance(slot_mapping, torch.Tensor) else slot_mapping)]
        layer_group, layer_slot = self.groups
        if kv_caches.dtype != cache_dtype or kv_caches.stride(-1) != 1 or \
                len(rows) != 1 + max(layer_group) or len(slots) != len(rows) or \
                max(layer_slot) >= kv_caches.shape[0] or not all(
                t.is_contiguous() for t in (x, h, cos, sin, cos_l, sin_l)):
            return False
        if self.quantized and not self._quant_calls(invariant):
            return False
        st = kv_caches.stride()
        refs = _CacheRefs(st[0], st[1], st[2], st[3], st[4], kv_caches.shape[3], PARTITION_SIZE)
        slot_array = (ctypes.c_void_p * len(slots))(*[m.data_ptr() for m in slots])
        lora_refs = None
        if lora is not None:
            table, row_block = lora
            lora_refs = table.refs(row_block)
        row_array = (AttentionRows * len(rows))(*rows)       # copies; `rows` keeps their tensors alive
        status = self._fn(self._table.data_ptr(), self._norms[-1].data_ptr(), ctypes.addressof(self._dims),
                          x.data_ptr(), h.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos_l.data_ptr(),
                          sin_l.data_ptr(), kv_caches.data_ptr(), ctypes.addressof(refs), ctypes.addressof(slot_array),
                          ctypes.addressof(row_array),
                          None if lora_refs is None else ctypes.addressof(lora_refs), num_tokens,
                          *((self.kv_code,) if self.kv_code else ()))
        if status == 2:
            raise RuntimeError("decoder_layers: a kernel failed after the first layer ran")
        return status == 0


class LoraTable:
    """A LoRA slot range's weights for the compiled loop's deltas (LoraProj in cpu_kernels.cpp):
    per layer and projection the addresses of A [span * K, in] and BT [span * K, out] (views of
    lora/weights.py's slot tensors, not copies: nothing to pack when the range changes) and the
    parts' output columns. modules: per projection name None (no delta) or (A [layers, span *
    K, in], BT [layers, span * K, out], the parts' output sizes[, BT in rank pairs (lora_pack_bt)
    or None: bf16 AMX tiles read it, else they pair BT's rows per call]); info: per slot of the range and
    projection, the adapter's rank | its parts' bits << 16; as lora/weights.py
    LoRAStep.compiled_weights gives them; key: its compiled_key, to tell when they change. `ok` is False
    where the kernel does not take them (then the step takes the Python loop)."""

    def __init__(self, num_layers: int, key: tuple, modules: dict, rank: int, info: list[int]) -> None:
        self.key, self.rank, self.ok = key, rank, True
        self.rows = (_LoraProj * (num_layers * 4))()
        self.span = len(info) // 4
        self.info = torch.tensor(info, dtype=torch.int64)
        self._views = []          # the table points into them
        for j, name in enumerate(_PROJECTIONS):
            if modules.get(name) is None:
                continue
            A, BT, sizes, *packed = modules[name]
            btp = packed[0] if packed else None
            # Each layer's pairs contiguous (a range of the slots is a view: layers lie apart).
            if btp is not None and not (btp.stride()[-3:] == (BT.shape[-1] * 2, 2, 1)
                                        and btp.shape[-3:] == (BT.shape[-2] // 2, BT.shape[-1], 2)
                                        and btp.dtype == BT.dtype):
                btp = None
            if not (A.is_cpu and A.stride(-1) == 1 and BT.stride(-1) == 1 and A.stride(-2) == A.shape[-1]
                    and A.dtype == BT.dtype):
                self.ok = False
                return
            self._views += [A, BT, btp]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            for layer in range(num_layers):
                row = self.rows[layer * 4 + j]
                row.a, row.bt, row.ldb, row.nparts = A[layer].data_ptr(), BT[layer].data_ptr(), BT.stride(-2), len(sizes)
                row.btp = 0 if btp is None or BT.stride(-2) != BT.shape[-1] else btp[layer].data_ptr()
                for i, (offset, size) in enumerate(zip(offsets, sizes)):
                    row.offset[i], row.size[i] = offset, size

    def refs(self, row_block: torch.Tensor) -> _LoraRefs:
        """The kernel's view of this table for a step's rows (row_block: int64 [T], kept alive by the caller)."""
        return _LoraRefs(ctypes.addressof(self.rows), row_block.data_ptr(), self.rank, self.info.data_ptr(), self.span)


def set_lora_handover(enabled: bool) -> bool:
    """Whether the compiled loop hands each LoRA delta to the quantized base product before it
    (cpu_kernels.cpp project_lora): the product fetches the delta's adapter weights ahead into
    the caches of the threads that read them next and runs the delta at its end, in the same
    OpenMP meeting. On by default; benchmarks/lora.py measures both. Returns the setting
    (False where no kernels are built)."""
    return load() is not None and bool(KERNELS.lib.lora_handover_config(int(enabled)))


def lora_handovers() -> int:
    """How many LoRA deltas the compiled loop has handed to a base product so far (wraps;
    tests check that it runs). 0 where no kernels are built."""
    return 0 if load() is None else KERNELS.lib.lora_handovers()


def lora_delta(table: LoraTable, layer: int, projection: int, x: torch.Tensor, y: torch.Tensor,
               row_block: torch.Tensor) -> bool:
    """y [T, out] += projection `projection` (0 qkv, 1 o, 2 gate_up, 3 down) of `layer`'s LoRA
    delta for x [T, in], in place (the compiled loop's kernel on its own; tests). False where
    the kernel does not apply."""
    fn = _kernel("lora_delta", x)
    if fn is None or not (x.is_contiguous() and y.stride(-1) == 1 and row_block.dtype == torch.int64):
        return False
    refs = table.refs(row_block.contiguous())
    return fn(ctypes.addressof(refs), layer, projection, x.data_ptr(), x.shape[1], y.data_ptr(), y.stride(0),
              x.shape[0]) == 0


def _kernel(name: str, x: torch.Tensor):
    """The compiled `name` for x's dtype (`name_f32`, `name_bf16`), or None (another device or
    dtype, no kernels)."""
    return _compiled(name, x.dtype) if x.is_cpu else None


@functools.cache       # looked up on every layer call: resolve each (name, dtype) once
def _compiled(name: str, dtype: torch.dtype):
    suffix = _SUFFIX.get(dtype)
    if suffix is None or load() is None:
        return None
    return getattr(KERNELS.lib, f"{name}_{suffix}")


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """x += y in place (y may be None), then returns weight * rms_norm(x): one pass. x, y:
    [M, H] contiguous. None where the kernel does not apply (the caller uses torch)."""
    fn = _kernel("add_rms_norm", x)
    if fn is None or not x.is_contiguous() or (y is not None and not y.is_contiguous()):
        return None
    out = torch.empty_like(x)
    fn(x.data_ptr(), None if y is None else y.data_ptr(), weight.data_ptr(), out.data_ptr(),
       x.shape[0], x.shape[1], eps)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up = [gate | up] of shape [M, 2I]: one pass. None where the
    kernel does not apply."""
    fn = _kernel("silu_and_mul", gate_up)
    if fn is None or not gate_up.is_contiguous():
        return None
    m, width = gate_up.shape
    out = torch.empty(m, width // 2, dtype=gate_up.dtype)
    fn(gate_up.data_ptr(), out.data_ptr(), m, width // 2)
    return out


def rope_inplace(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate the first num_heads heads of each row of x [T, >= num_heads * head_dim] (rows may
    be strided) in place; cos, sin: [T, R] contiguous, R <= head_dim (less: partial rotary, each
    head's first R values turn). False where the kernel does not apply."""
    fn = _kernel("rope_inplace", x)
    if fn is None or x.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()) or cos.dtype != x.dtype:
        return False
    fn(x.data_ptr(), x.stride(0), x.shape[0], num_heads, head_dim, cos.data_ptr(), sin.data_ptr(), cos.shape[-1])
    return True


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum (a NaN counts as the maximum), as torch's
    x.max(dim=-1).indices; x: [N, V] float32."""
    fn = _kernel("argmax_rows", x) if x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() else None
    if fn is None:
        return x.max(dim=-1).indices
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out
