"""The prefix cache's disk tier, worker side: KV blocks in files (kv/tier.py decides which).

One file per block, `<fingerprint[:32]>-<block key>.kvb` in the tier's directory: a header,
then the block's raw bytes as the cache stores them (every layer's K and V; an 8-bit format's
codes and scales). The header (JSON behind a fixed prefix with its CRC-32) names the block key,
the full fingerprint of the model (its files, dtype, KV format, block size, layout), the shape
and the payload's CRC-32; a read checks all of it and the file's length, so a truncated,
corrupt or foreign file is skipped (the block is computed again), never served. No pickle.

Off the step's critical path: a save copies the evicted blocks (one gather, before the step may
overwrite them) and a writer thread files them; reads run on two reader threads into host
buffers, and the step that finds them done copies them into their blocks. Several engines may
share a directory: a write goes to a temporary file renamed into place (a reader sees a whole
file or none), reads refresh a file's modification time, and each writer keeps the directory
under its size bound by deleting the oldest files (by modification time) before it writes. A
failed write (a full disk) turns saving off with one log line; serving goes on.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import uuid
import zlib
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from pagedserve.batch import TierReport
from pagedserve.kernels.threads import set_thread_count

logger = logging.getLogger(__name__)

MAGIC = b"PSKVTIER"
VERSION = 1
_PREFIX = struct.Struct("<8sIII")    # magic, version, header bytes, header CRC-32
_MAX_HEADER = 4096
SUFFIX = ".kvb"
RESERVE_BYTES = 256 * 2**20          # free disk space a write leaves alone
_RESCAN_WRITES = 64                  # writes between directory scans (other writers' files)
_LOW_WATER = 0.9                     # evicting frees the directory down to this share of its bound


class TierFileError(ValueError):
    """A file that is not a whole, intact block of this store."""


def model_identity(path: str) -> list:
    """What identifies a model's weights without reading them: each file's name, size and
    modification time (a preset with dummy weights: its name)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    if not files:
        return [str(path)]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def block_view(kv_cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The runner's [layers, 2, blocks, ...] cache as a view whose block b, `view[:, :, b]`, is
    one block in its storage's order (a head-major cache is read through its contiguous storage),
    and whether it is head-major."""
    head_major = not kv_cache.is_contiguous()
    blocks = kv_cache.transpose(3, 4) if head_major else kv_cache
    assert blocks.is_contiguous(), "the KV cache's storage is one contiguous tensor"
    return blocks, head_major


def fingerprint(fields: dict) -> str:
    """SHA-256 over what makes a block's bytes mean its tokens' keys and values."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


class KVTierStore:
    def __init__(self, root: str, max_bytes: int, model_fingerprint: str, kv_cache: torch.Tensor,
                 meta: dict) -> None:
        """kv_cache: the runner's [layers, 2, blocks, ...] cache (a head-major view is read
        through its contiguous storage); meta: the header's fixed fields (KV format, block size)."""
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.max_bytes = max_bytes
        self.prefix = model_fingerprint[:32] + "-"
        self.blocks, head_major = block_view(kv_cache)
        self.block_shape = (self.blocks.shape[0], self.blocks.shape[1], *self.blocks.shape[3:])
        self.dtype = self.blocks.dtype
        self.payload_bytes = self.blocks[:, :, 0].numel() * self.blocks.element_size()
        self.meta = dict(meta, fingerprint=model_fingerprint, dtype=str(self.dtype).removeprefix("torch."),
                         shape=list(self.block_shape), layout="head_major" if head_major else "token_major",
                         payload_bytes=self.payload_bytes)
        self.file_bytes = len(self._header(bytes(32), 0)) + self.payload_bytes
        self.capacity = max_bytes // self.file_bytes     # blocks the size bound holds (the engine's index)
        self.writable = True
        self.bytes_written = 0
        self.bytes_read = 0
        self.rejected = 0          # files found but refused (truncated, corrupt, foreign): never served
        self._lock = threading.Lock()
        self._pending: dict[bytes, torch.Tensor] = {}     # saved, not yet on disk: reads take these
        self._lost: list[bytes] = []                       # keys whose files went (writer thread)
        self._dir_bytes = 0                                # the directory's size at the last scan, plus ours since
        self._writes_since_scan = _RESCAN_WRITES
        self._inflight: list[tuple[bytes, int, Future]] = []
        self._jobs: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        # One OpenMP thread each for their copies into the pool: a team of their own would put more
        # OpenMP threads than CPUs, and libgomp then stops spinning at barriers (every later step slower).
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="kv-tier-reader", initializer=set_thread_count,
                                           initargs=(1,))

    # ---- files ---------------------------------------------------------------------------
    def path(self, key: bytes) -> str:
        return os.path.join(self.root, self.prefix + key.hex() + SUFFIX)

    def _header(self, key: bytes, crc: int) -> bytes:
        header = json.dumps(dict(self.meta, key=key.hex(), payload_crc32=f"{crc:08x}"), sort_keys=True).encode()
        return _PREFIX.pack(MAGIC, VERSION, len(header), zlib.crc32(header)) + header

    def scan(self) -> list[bytes]:
        """The keys of this model's blocks in the directory, oldest first (a restarted engine's
        index: the file names carry the keys, nothing is read)."""
        found = []
        with os.scandir(self.root) as entries:
            for e in entries:
                if e.name.startswith(self.prefix) and e.name.endswith(SUFFIX):
                    try:
                        key = bytes.fromhex(e.name[len(self.prefix):-len(SUFFIX)])
                        found.append((e.stat().st_mtime_ns, key))
                    except (ValueError, OSError):
                        continue
        return [k for _, k in sorted(found) if len(k) == 32]

    def parse(self, key: bytes, data: memoryview) -> torch.Tensor:
        """The block in `data` (a whole file's bytes), or TierFileError saying what is wrong."""
        if len(data) < _PREFIX.size:
            raise TierFileError("truncated header")
        magic, version, size, crc = _PREFIX.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise TierFileError(f"not a version-{VERSION} tier file")
        if size > _MAX_HEADER or len(data) < _PREFIX.size + size:
            raise TierFileError("truncated header")
        raw = bytes(data[_PREFIX.size:_PREFIX.size + size])
        if zlib.crc32(raw) != crc:
            raise TierFileError("header checksum mismatch")
        try:
            header = json.loads(raw)
        except ValueError:
            raise TierFileError("unreadable header") from None
        wanted = dict(self.meta, key=key.hex())
        for name, value in wanted.items():
            if header.get(name) != value:
                raise TierFileError(f"header {name} {header.get(name)!r} is not this store's {value!r}")
        payload = data[_PREFIX.size + size:]
        if len(payload) != self.payload_bytes:
            raise TierFileError(f"payload of {len(payload)} bytes, expected {self.payload_bytes}")
        if f"{zlib.crc32(payload):08x}" != header.get("payload_crc32"):
            raise TierFileError("payload checksum mismatch")
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(self.block_shape)

    # ---- the step's calls ----------------------------------------------------------------
    def save(self, items: list[tuple[int, bytes]]) -> None:
        """Copy these blocks now (the step may overwrite them) and file them in the background."""
        if not items:
            return
        if not self.writable:
            with self._lock:
                self._lost.extend(key for _, key in items)
            return
        copies = torch.stack([self.blocks[:, :, b] for b, _ in items]).cpu()   # one copy a block (on a CPU)
        with self._lock:
            for (_, key), block in zip(items, copies):
                self._pending[key] = block
        for (_, key), block in zip(items, copies):
            self._jobs.put(("save", key, block, None, None))

    def save_copies(self, items: list[tuple[bytes, torch.Tensor]], ready=None, done=None) -> None:
        """File blocks already copied off the device (the host tier's slots, worker/kv_host_tier.py):
        the writer thread waits for `ready` (a CUDA event: the copies landed) and calls done(key)
        after each file, so the host tier reuses no slot before its bytes are written."""
        with self._lock:
            for key, block in items:
                self._pending[key] = block
        for key, block in items:
            self._jobs.put(("save", key, block, ready, done))

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            self._jobs.put(("delete", key, None, None, None))

    def start_loads(self, items: list[tuple[bytes, int]]) -> None:
        """Read these blocks in the background; `collect` puts them in place."""
        for key, block_id in items:
            self._inflight.append((key, block_id, self._readers.submit(self._read, key, block_id)))

    def collect(self, wait: Collection[bytes] = ()) -> TierReport:
        """Reads that are done (those of the keys in `wait` waited for) copied into their blocks,
        and the news since the last call."""
        report = TierReport()
        pending = []
        wait = set(wait)
        for key, block_id, future in self._inflight:
            if not (key in wait or future.done()):
                pending.append((key, block_id, future))
                continue
            try:
                block = future.result()
                if block is not None:      # (a CPU cache's block was copied in by the reader thread)
                    self.blocks[:, :, block_id].copy_(block)
                report.loaded.append(key)
            except Exception as e:   # noqa: BLE001 - a bad file costs a recompute, never the engine
                self.rejected += isinstance(e, TierFileError)
                logger.warning("KV tier: skipped %s: %s", self.path(key), e)
                report.failed.append(key)
        self._inflight = pending
        with self._lock:
            report.lost, self._lost = self._lost, []
        report.bytes_written, report.bytes_read, report.writable = self.bytes_written, self.bytes_read, self.writable
        return report

    def cancel(self) -> None:
        """Drop the reads in flight (the KV bookkeeping started afresh: their blocks mean nothing)."""
        for _, _, future in self._inflight:
            future.exception()
        self._inflight = []

    def flush(self) -> None:
        """Wait until every save and deletion so far is on disk."""
        self._jobs.join()

    def close(self) -> None:
        if not self._writer.is_alive():
            return
        self.flush()
        self._jobs.put(None)
        self._writer.join()
        self._readers.shutdown()

    # ---- background threads ----------------------------------------------------------------
    def _read(self, key: bytes, block_id: int) -> torch.Tensor | None:
        """The block's bytes (checked), or None where this thread copied them into block_id
        already (a CPU cache: the block is the load's alone until it lands, and the copy stays
        off the engine thread; a device cache is written on the engine thread's stream)."""
        with self._lock:
            block = self._pending.get(key)
        if block is not None:          # saved a moment ago, still on its way to the disk
            return block
        path = self.path(key)
        buf = bytearray(self.file_bytes + 1)        # one byte more: a longer file is not ours
        with open(path, "rb") as f:
            n = f.readinto(buf)
        block = self.parse(key, memoryview(buf)[:n])
        try:
            os.utime(path)             # recently used: the size bound evicts by modification time
        except OSError:
            pass
        with self._lock:
            self.bytes_read += n
        if self.blocks.device.type == "cpu":
            self.blocks[:, :, block_id].copy_(block)
            return None
        return block

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, key, block, ready, done = job
            try:
                if kind == "save":
                    if ready is not None:
                        ready.synchronize()
                    self._write(key, block)
                else:
                    self._unlink(self.path(key))
            except Exception:   # noqa: BLE001 - the writer thread must outlive any one job
                logger.exception("KV tier: %s of %s failed", kind, key.hex())
            finally:
                if done is not None:
                    done(key)
                self._jobs.task_done()

    def _write(self, key: bytes, block: torch.Tensor) -> None:
        try:
            if self.writable:
                self._make_room()
                payload = block.view(torch.uint8).numpy()
                data = self._header(key, zlib.crc32(payload))
                tmp = os.path.join(self.root, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
                try:
                    self._write_file(tmp, data, payload)
                    os.replace(tmp, self.path(key))   # readers see the whole file or none
                except BaseException:
                    self._unlink(tmp)
                    raise
                self._dir_bytes += self.file_bytes
                with self._lock:
                    self.bytes_written += self.file_bytes
                return
        except OSError as e:
            self.writable = False
            logger.error("KV tier: writing to %s failed (%s); the disk tier saves nothing more, serving goes on",
                         self.root, e)
        finally:
            with self._lock:
                self._pending.pop(key, None)
        with self._lock:
            self._lost.append(key)

    @staticmethod
    def _write_file(path: str, header: bytes, payload) -> None:
        with open(path, "wb") as f:
            f.write(header)
            f.write(payload)

    def _make_room(self) -> None:
        """Keep the directory (every writer's files) under max_bytes and the disk's free space
        above RESERVE_BYTES; OSError where the disk is too full."""
        if shutil.disk_usage(self.root).free < self.file_bytes + RESERVE_BYTES:
            raise OSError(28, "no space left for the KV tier (its reserve of free disk space)")
        self._writes_since_scan += 1
        if self._dir_bytes + self.file_bytes <= _LOW_WATER * self.max_bytes and \
                self._writes_since_scan < _RESCAN_WRITES:
            return
        self._writes_since_scan = 0
        files = []
        with os.scandir(self.root) as entries:
            for e in entries:
                if e.name.endswith(SUFFIX):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    files.append((st.st_mtime_ns, st.st_size, e.name))
        total = sum(size for _, size, _ in files)
        if total + self.file_bytes > self.max_bytes:
            goal = _LOW_WATER * self.max_bytes - self.file_bytes
            for _, size, name in sorted(files):
                if total <= goal:
                    break
                total -= size
                if self._unlink(os.path.join(self.root, name)) and name.startswith(self.prefix):
                    with self._lock:
                        self._lost.append(bytes.fromhex(name[len(self.prefix):-len(SUFFIX)]))
        self._dir_bytes = total

    @staticmethod
    def _unlink(path: str) -> bool:
        """Remove a file; False if it was gone already (another writer removed it)."""
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False


def open_tier_store(config, model_path: str, args, dtype: torch.dtype, kv_cache: torch.Tensor):
    """The store of an engine's tiers below the prefix cache: the disk's (config.kv_offload_path)
    and, with kv_offload_cpu_gb, host memory's above it (worker/kv_host_tier.py)."""
    disk = None
    if config.kv_offload_path is not None:
        disk = open_disk_store(config, model_path, args, dtype, kv_cache)
        logger.info("KV disk tier %s: %d blocks of %d bytes found, room for %d", config.kv_offload_path,
                    len(disk.scan()), disk.file_bytes, disk.capacity)
    if config.kv_offload_cpu_gb is None:
        return disk
    from pagedserve.worker.kv_host_tier import HostTierStore
    block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    slots = int(config.kv_offload_cpu_gb * 1024**3) // block_bytes
    logger.info("KV host-memory tier: %d blocks of %d bytes%s", slots, block_bytes,
                " (pinned)" if kv_cache.device.type == "cuda" else "")
    return HostTierStore(kv_cache, slots, disk)


def open_disk_store(config, model_path: str, args, dtype: torch.dtype, kv_cache: torch.Tensor) -> KVTierStore:
    """The store of an engine's disk tier (config.kv_offload_path), under the fingerprint of
    what its blocks' bytes depend on: the model's files (a preset's name and seed with dummy
    weights), how they load, the dtype, the KV format and block size, the cache's shape."""
    fields = dict(model=model_identity(model_path), load_format=config.load_format,
                  seed=config.seed if config.load_format == "dummy" else None, quantization=config.quantization,
                  gguf_dequantize=config.gguf_dequantize, dtype=str(dtype), kv_cache_dtype=config.kv_cache_dtype,
                  block_size=config.block_size, layers=args.num_layers, kv_heads=args.num_kv_heads,
                  head_dim=args.head_dim, cache_shape=list(kv_cache.shape[3:]))
    meta = dict(kv_format=config.kv_cache_dtype, block_size=config.block_size)
    return KVTierStore(config.kv_offload_path, config.kv_offload_bytes, fingerprint(fields), kv_cache, meta)
