"""The disk tier: pages of KV in files that outlive the process (`hicache_storage_backend="file"`).

A page is `page_tokens` (64) consecutive tokens of a token-id prefix, aligned at 0. Its name chains
the model's identity and every token before it:

    h[-1] = model key        h[i] = sha256(h[i-1] + token ids of page i)       file: <dir>/<h[i]>.kv

so a page is found only by a runtime of the same model (weights, config, dtype, tokenizer, KV
layout) asking for the same tokens. A file is

    MAGIC | u32 header length | header (JSON: model, hash, tokens, shape, dtype) | payload | u32 crc

with the payload [2 (K, V), layers, page_tokens, kv_heads, head_dim]. Anything that does not
check out (crc, header, length) is a miss and the file is removed: never wrong KV. Files are
written to a temporary name and renamed (atomic: other processes sharing the directory see
whole files or none; a failed write removes its temporary file); a read refreshes the file's
mtime, and when the directory holds more than its bound, the files with the oldest mtimes go.
Writes run on a background thread.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lmnb.runtime.memory import KVStorage

logger = logging.getLogger(__name__)

PAGE_TOKENS = 64
MAGIC = b"LMNBKV01"
SUFFIX = ".kv"


def page_hashes(model_key: str, tokens: Sequence[int], pages: int,
                page_tokens: int = PAGE_TOKENS) -> list[str]:
    """The chained names of the first `pages` full pages of `tokens`."""
    hashes, previous = [], model_key
    for page in range(pages):
        chunk = array("q", tokens[page * page_tokens:(page + 1) * page_tokens]).tobytes()
        previous = hashlib.sha256(previous.encode() + chunk).hexdigest()
        hashes.append(previous)
    return hashes


COPY_CHUNK = 256  # tokens per device-side temporary of the copies below (pages divide it)


class PageCopies:
    """KV rows copied out of the device pool for the writer thread: on CUDA the rows are
    gathered on the compute stream (before anything can overwrite them) and copied to pinned
    host memory on a side stream that the compute stream never waits for; `ready()` (writer
    thread) waits for those copies."""

    def __init__(self, kv: KVStorage, stream: torch.cuda.Stream | None) -> None:
        self.kv = kv
        self.stream = stream
        self.chunks: list[torch.Tensor] = []  # [2, layers, <= COPY_CHUNK, kv_heads, head_dim]
        self.event: torch.cuda.Event | None = None

    def gather(self, slots: torch.Tensor) -> PageCopies:
        kv = self.kv
        for layer in range(kv.num_layers):
            kv.ready(layer)  # rows a load may still be writing
        for begin in range(0, len(slots), COPY_CHUNK):
            part = slots[begin:begin + COPY_CHUNK]
            rows = torch.stack([torch.stack([buf[part] for buf in bufs])
                                for bufs in (kv.k_buffers, kv.v_buffers)])
            if self.stream is None:
                self.chunks.append(rows)
                continue
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(kv.device))
            with torch.cuda.stream(self.stream):
                host.copy_(rows, non_blocking=True)
            rows.record_stream(self.stream)  # not reused before the copy read it
            self.chunks.append(host)
        if self.stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        return self

    def tokens(self, begin: int, end: int) -> torch.Tensor:
        """A view of rows begin..end (within one chunk)."""
        chunk = begin // COPY_CHUNK
        offset = chunk * COPY_CHUNK
        return self.chunks[chunk][:, :, begin - offset:end - offset]

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class DiskTier:
    def __init__(self, root: Path, model_key: str, kv: KVStorage, *, max_bytes: int,
                 page_tokens: int = PAGE_TOKENS, max_queued_bytes: int = 1 << 30) -> None:
        self.root = root
        self.model_key = model_key
        self.dir = root / model_key[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kv = kv
        self.max_bytes = max_bytes
        self.max_queued_bytes = max_queued_bytes  # pages copied out, waiting for the writer
        self._queued_bytes = 0
        if page_tokens < 1 or COPY_CHUNK % page_tokens:
            raise ValueError(f"page_tokens must divide {COPY_CHUNK}, got {page_tokens}")
        self.page_tokens = page_tokens
        self.page_shape = (2, kv.num_layers, page_tokens, kv.kv_heads, kv.head_dim)
        self.dtype_name = str(kv.dtype).removeprefix("torch.")
        self._page_bytes = (2 * kv.num_layers * page_tokens * kv.kv_heads * kv.head_dim
                            * torch.empty((), dtype=kv.dtype).element_size())
        self._known: set[str] = set()  # pages this process wrote or read (not written again)
        self._queue: queue.Queue[tuple[str, list[int], PageCopies, int] | None] = queue.Queue()
        self._stream = torch.cuda.Stream(kv.device) if kv.device.type == "cuda" else None
        self._lock = threading.Lock()  # the counters below, written by both threads
        self._bytes = self._scan_total()
        self._remove_stale_temps()
        self.written_pages = 0
        self.loaded_pages = 0
        self.missed_pages = 0
        self.corrupt_pages = 0
        self.removed_pages = 0
        self._readers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                           thread_name_prefix="lmnb-hicache-read")
        self._writer = threading.Thread(target=self._write_loop, name="lmnb-hicache-disk",
                                        daemon=True)
        self._writer.start()
        atexit.register(self.close)

    # ---- writing -------------------------------------------------------------------------------
    def offer(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        """Queues the full pages of `tokens` (KV in device rows `slots`) not written yet; the KV
        is read before later device work can overwrite it. Returns how many pages were queued."""
        size = self.page_tokens
        pages = len(tokens) // size
        if not pages:
            return 0
        hashes = page_hashes(self.model_key, tokens, pages, self.page_tokens)
        new = [i for i, h in enumerate(hashes) if h not in self._known]
        room = (self.max_queued_bytes - self._queued_bytes) // self.page_bytes()
        new = new[:max(room, 0)]  # the writer is behind: the rest may be offered again later
        if not new:
            return 0
        with self._lock:
            self._queued_bytes += len(new) * self.page_bytes()
        rows = torch.cat([slots[i * size:(i + 1) * size] for i in new])
        copies = PageCopies(self.kv, self._stream).gather(rows)
        for n, page in enumerate(new):
            self._known.add(hashes[page])
            self._queue.put((hashes[page], list(tokens[page * size:(page + 1) * size]), copies,
                             n * size))
        return len(new)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a full disk or a removed directory: the page is just not kept
                logger.exception("hicache: writing a KV page failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._queued_bytes -= self.page_bytes()
                self._queue.task_done()

    def _write(self, page_hash: str, tokens: list[int], copies: PageCopies, at: int) -> None:
        copies.ready()
        data = copies.tokens(at, at + self.page_tokens).contiguous()
        header = json.dumps({"model": self.model_key, "hash": page_hash, "tokens": tokens,
                             "shape": list(self.page_shape), "dtype": self.dtype_name}).encode()
        payload = data.view(torch.uint8).numpy().tobytes()
        body = MAGIC + struct.pack("<I", len(header)) + header + payload
        blob = body + struct.pack("<I", zlib.crc32(body))
        path = self.dir / f"{page_hash}{SUFFIX}"
        temp = self.dir / f".{page_hash}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            temp.write_bytes(blob)
            os.replace(temp, path)  # atomic: readers see the whole file or none
        except OSError:  # a full disk: no partial file stays, the page may be offered again
            temp.unlink(missing_ok=True)
            self._known.discard(page_hash)
            raise
        with self._lock:
            self.written_pages += 1
            self._bytes += len(blob)
            over = self._bytes > self.max_bytes
        if over:
            self._shrink()

    def _files(self) -> list[os.DirEntry[str]]:
        entries = []
        for model_dir in os.scandir(self.root):
            try:
                if model_dir.is_dir():
                    entries.extend(e for e in os.scandir(model_dir.path)
                                   if e.name.endswith(SUFFIX))
            except FileNotFoundError:  # another process removed it meanwhile
                continue
        return entries

    def _remove_stale_temps(self, age_s: float = 3600.0) -> None:
        """Temporary files a writer left behind when its process died mid-write."""
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                if entry.name.endswith(".tmp") and now - entry.stat().st_mtime > age_s:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass

    def _scan_total(self) -> int:
        total = 0
        for entry in self._files():
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def _shrink(self) -> None:
        """Removes the least recently used files (oldest mtime, any model) until the directory
        holds at most 90% of its bound."""
        files = []
        for entry in self._files():
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue  # another process removed it
            files.append((stat.st_mtime_ns, stat.st_size, entry.path, entry.name))
        files.sort()
        total = sum(size for _, size, _, _ in files)
        target = int(self.max_bytes * 0.9)
        removed = 0
        for _, size, path, name in files:
            if total <= target:
                break
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            total -= size
            self._known.discard(name.removesuffix(SUFFIX))
        with self._lock:
            self._bytes = total
            self.removed_pages += removed

    # ---- reading -------------------------------------------------------------------------------
    def has_page(self, tokens: Sequence[int], page: int) -> bool:
        """Whether page `page` of `tokens` has a file (one stat: no read, no check)."""
        name = page_hashes(self.model_key, tokens, page + 1, self.page_tokens)[page]
        return (self.dir / f"{name}{SUFFIX}").exists()

    def load(self, tokens: Sequence[int], start: int, max_tokens: int, *,
             pin: bool = False) -> torch.Tensor | None:
        """KV [2, layers, n, kv_heads, head_dim] (CPU; `pin`: in pinned memory) of
        tokens[start:start + n] from the pages on disk that continue the prefix
        `tokens[:start]`, n <= max_tokens; None if none. Runs on any thread."""
        size = self.page_tokens
        first = start // size
        pages = min(len(tokens), start + max_tokens) // size
        if pages <= first:
            return None
        hashes = page_hashes(self.model_key, tokens, pages, self.page_tokens)
        present = first
        while present < pages and (self.dir / f"{hashes[present]}{SUFFIX}").exists():
            present += 1
        if present == first:
            with self._lock:
                self.missed_pages += 1
            return None
        # Reads and checksums release the GIL: the pages are read side by side.
        reads = self._readers.map(lambda page: self._read(
            hashes[page], tokens[page * size:(page + 1) * size]), range(first, present))
        found = []
        for data in reads:
            if data is None:
                break
            found.append(data)
        skip = start - first * size
        n = len(found) * size - skip
        if n <= 0:
            return None
        shape = (*self.page_shape[:2], n, *self.page_shape[3:])
        data = torch.empty(shape, dtype=self.kv.dtype, pin_memory=pin)
        for i, page in enumerate(found):
            begin = i * size - skip
            data[:, :, max(begin, 0):begin + size] = page[:, :, max(-begin, 0):]
        return data

    def _read(self, page_hash: str, tokens: Sequence[int]) -> torch.Tensor | None:
        path = self.dir / f"{page_hash}{SUFFIX}"
        try:
            blob = bytearray(path.read_bytes())
        except FileNotFoundError:
            with self._lock:
                self.missed_pages += 1
            return None
        data = self._parse(blob, page_hash, tokens)
        if data is None:
            with self._lock:
                self.corrupt_pages += 1
            logger.warning("hicache: KV page %s failed its checks; removed", path.name)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            self._known.discard(page_hash)
            return None
        try:
            os.utime(path)  # least recently used goes first
        except FileNotFoundError:
            pass
        self._known.add(page_hash)
        with self._lock:
            self.loaded_pages += 1
        return data

    def _parse(self, blob: bytearray, page_hash: str,
               tokens: Sequence[int]) -> torch.Tensor | None:
        if len(blob) < len(MAGIC) + 8 or not blob.startswith(MAGIC):
            return None
        body, (crc,) = memoryview(blob)[:-4], struct.unpack("<I", blob[-4:])
        if zlib.crc32(body) != crc:
            return None
        (length,) = struct.unpack_from("<I", blob, len(MAGIC))
        start = len(MAGIC) + 4
        try:
            header = json.loads(bytes(blob[start:start + length]))
        except ValueError:
            return None
        if (header.get("model") != self.model_key or header.get("hash") != page_hash
                or header.get("tokens") != list(tokens) or header.get("dtype") != self.dtype_name
                or header.get("shape") != list(self.page_shape)):
            return None
        payload = body[start + length:]
        if len(payload) != self.page_bytes():
            return None
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.kv.dtype).view(
            self.page_shape).clone()

    def page_bytes(self) -> int:
        return self._page_bytes

    # ---- lifecycle -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Waits until every queued page is on disk."""
        self._queue.join()

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=60)
        atexit.unregister(self.close)

    def stats(self) -> dict[str, int]:
        """bytes (in the directory, every model), written/loaded/corrupt/removed pages."""
        with self._lock:
            return {"bytes": self._bytes, "written_pages": self.written_pages,
                    "loaded_pages": self.loaded_pages, "corrupt_pages": self.corrupt_pages,
                    "removed_pages": self.removed_pages}
