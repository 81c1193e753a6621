"""The tiered radix cache (radix/tiered.py over runtime/hicache/) against a reference: every
token position's KV is a function of its prefix, so any KV a match hands out — kept on the
device, brought back from the host pool, or read from disk pages after a "restart" — can be
checked row by row."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmnb.runtime.hicache.disk import DiskTier, page_hashes
from lmnb.runtime.hicache.host_pool import HostKVPool
from lmnb.runtime.memory import KVAllocator, KVStorage
from lmnb.runtime.radix.tiered import TieredRadixCache

CPU = torch.device("cpu")
DEVICE_SLOTS, HOST_SLOTS, PAGE = 24, 16, 4
keys = st.lists(st.integers(0, 2), min_size=2, max_size=14)


def expected_rows(key: list[int], start: int, end: int) -> torch.Tensor:
    """[2, layers, end - start, 1, 2]: the KV of positions start..end-1 of `key`."""
    codes = torch.tensor([float(hash(tuple(key[:i + 1])) % (1 << 20)) for i in range(start, end)])
    layers = [torch.stack((codes + layer, torch.full_like(codes, layer)), dim=-1)
              for layer in range(2)]
    k = torch.stack(layers)[:, :, None, :]
    return torch.stack((k, -k))


def device_rows(kv: KVStorage, slots: torch.Tensor) -> torch.Tensor:
    for layer in range(kv.num_layers):
        kv.ready(layer)  # as attention does: queued loads of the layer are copied now (CPU)
    return torch.stack([torch.stack([buf[slots] for buf in bufs])
                        for bufs in (kv.k_buffers, kv.v_buffers)])


class TieredCacheMachine(RuleBasedStateMachine):
    """Requests (insert after computing what was not matched), locks, evictions, restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="lmnb-hicache-"))
        self.write_through = False
        self.locks: list[object] = []
        self.seen: list[list[int]] = []
        self._build()

    def _build(self) -> None:
        self.kv = KVStorage(DEVICE_SLOTS, num_layers=2, kv_heads=1, head_dim=2,
                            dtype=torch.float32, device=CPU)
        self.allocator = KVAllocator(DEVICE_SLOTS, CPU)
        self.disk = DiskTier(self.dir, "model-key", self.kv, max_bytes=1 << 20, page_tokens=PAGE)
        self.cache = TieredRadixCache(self.allocator, HostKVPool(HOST_SLOTS, self.kv),
                                      write_through=self.write_through, disk=self.disk)

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @precondition(lambda self: self.seen)
    @rule(which=st.integers(0, 1 << 10), tail=st.lists(st.integers(0, 2), max_size=3))
    def again(self, which: int, tail: list[int]) -> None:
        """A prompt seen before, maybe with more after it (a multi-turn chat)."""
        self.request(self.seen[which % len(self.seen)] + tail)

    @rule(key=keys)
    def request(self, key: list[int]) -> None:
        self.seen.append(key)
        cache = self.cache
        cache.prefetch(key)  # as the scheduler does when the request arrives
        cache.wait_prefetch(key)
        room = self.allocator.available() + cache.evictable_size()
        cache.load_back(key, room=room)
        match = cache.match_prefix(key)
        got = len(match.indices)
        assert got <= len(key) - 1
        assert got + match.host_length == cache.cached_length(key[:-1])  # the rest is on the host
        assert torch.equal(device_rows(self.kv, match.indices), expected_rows(key, 0, got))
        cache.lock(match.handle)
        try:
            need = len(key) - got
            if self.allocator.available() < need:
                cache.evict(need - self.allocator.available())
            if self.allocator.available() < need:
                return
            slots = self.allocator.alloc(need)
            rows = expected_rows(key, got, len(key))
            for layer in range(2):
                self.kv.set_kv(layer, slots, rows[0, layer], rows[1, layer])
            value = torch.cat((match.indices, slots))
            already = cache.insert(key, value)
            cache.persist(key, value)  # computed: the request finished
            self.allocator.free(value[got:max(already, got)].clone())
        finally:
            cache.unlock(match.handle)

    @rule(key=keys)
    def load_unread(self, key: list[int]) -> None:
        """A load queued for a pass that never reads it (its request ended first): later
        evictions, saves and requests must still see the right KV."""
        self.cache.load_back(key, room=self.allocator.available() + self.cache.evictable_size())

    @rule(key=keys)
    def lock(self, key: list[int]) -> None:
        match = self.cache.match_prefix(key)
        self.cache.lock(match.handle)
        self.locks.append(match.handle)

    @precondition(lambda self: self.locks)
    @rule()
    def unlock(self) -> None:
        self.cache.unlock(self.locks.pop())

    @rule(n=st.integers(1, DEVICE_SLOTS))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @precondition(lambda self: not self.locks)
    @rule(write_through=st.booleans())
    def restart(self, write_through: bool) -> None:
        """A new process on the same model: only the disk pages are left."""
        self.disk.flush()
        self.cache.close()
        self.write_through = write_through
        self._build()

    @invariant()
    def consistent(self) -> None:
        self.cache.check()
        total = (self.allocator.available() + self.cache.evictable_size()
                 + self.cache.protected_size())
        assert total == DEVICE_SLOTS


def test_tiered_cache_state_machine() -> None:
    machine = settings(max_examples=30, stateful_step_count=30, deadline=None,
                       suppress_health_check=list(HealthCheck))(TieredCacheMachine)
    machine.TestCase().runTest()


def _filled(size: int = 32) -> tuple[KVStorage, KVAllocator]:
    kv = KVStorage(size, num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, device=CPU)
    return kv, KVAllocator(size, CPU)


def _request(cache: TieredRadixCache, kv: KVStorage, key: list[int]) -> int:
    """Computes `key` past its match (writing the reference KV) and caches it (the disk tier
    too); returns the matched length after loading back."""
    cache.prefetch(key)
    cache.wait_prefetch(key)
    cache.load_back(key, room=cache.allocator.available() + cache.evictable_size())
    match = cache.match_prefix(key)
    got = len(match.indices)
    assert torch.equal(device_rows(kv, match.indices), expected_rows(key, 0, got))
    slots = cache.allocator.alloc(len(key) - got)
    rows = expected_rows(key, got, len(key))
    for layer in range(2):
        kv.set_kv(layer, slots, rows[0, layer], rows[1, layer])
    value = torch.cat((match.indices, slots))
    already = cache.insert(key, value)
    cache.persist(key, value)
    cache.allocator.free(value[got:max(already, got)].clone())
    return got


def test_host_tier_keeps_evicted_kv_and_loads_it_back() -> None:
    kv, allocator = _filled()
    cache = TieredRadixCache(allocator, HostKVPool(64, kv), write_through=False)
    key = list(range(20))
    assert _request(cache, kv, key) == 0
    assert cache.evict(32) == 20  # all of it goes to the host pool
    assert cache.evictable_size() == 0 and cache.host_size() == 20
    assert [row["tier"] for row in cache.snapshot()[1:]] == ["host"]
    assert _request(cache, kv, key + [99]) == 20  # loaded back, then one token computed
    assert cache.host_loaded_tokens == 20
    assert {row["tier"] for row in cache.snapshot()[1:]} == {"device+host", "device"}
    cache.check()


def test_host_pool_evicts_its_least_recently_used_leaves() -> None:
    kv, allocator = _filled()
    cache = TieredRadixCache(allocator, HostKVPool(24, kv), write_through=False)
    for first in (1, 2, 3):
        _request(cache, kv, [first] * 10)
        cache.evict(32)
        cache.check()
    assert cache.host_evicted_tokens == 10  # the oldest went when the third came
    assert cache.cached_length([1] * 10) == 0 and cache.cached_length([3] * 10) == 10
    cache.check()


def test_loads_stay_within_room_and_never_move_locked_kv() -> None:
    kv, allocator = _filled(size=12)
    cache = TieredRadixCache(allocator, HostKVPool(32, kv), write_through=True)
    _request(cache, kv, [5] * 10)
    cache.evict(12)  # [5] * 10 now lives on the host only
    _request(cache, kv, [6] * 8)
    held = cache.match_prefix([6] * 9)
    cache.lock(held.handle)  # 8 of the 12 slots locked
    assert cache.load_back([5] * 11, room=3) == 3  # the part that fits the room
    assert cache.load_back([5] * 11, room=100) == 1  # the free slot; nothing locked moves
    assert len(cache.match_prefix([6] * 9).indices) == 8
    cache.check()
    cache.unlock(held.handle)
    assert cache.load_back([5] * 11, room=100) == 6  # the rest, evicting the unlocked path
    assert _request(cache, kv, [5] * 11) == 10
    cache.check()


def _page(root: Path, key: list[int], start: int) -> torch.Tensor | None:
    kv, _ = _filled()
    disk = DiskTier(root, "model-a", kv, max_bytes=1 << 20, page_tokens=PAGE)
    try:
        return disk.load(key, start, PAGE)
    finally:
        disk.close()


def test_corrupt_or_foreign_pages_are_misses(tmp_path: Path) -> None:
    kv, allocator = _filled()
    disk = DiskTier(tmp_path, "model-a", kv, max_bytes=1 << 20, page_tokens=PAGE)
    cache = TieredRadixCache(allocator, HostKVPool(32, kv), write_through=False, disk=disk)
    key = list(range(13))
    _request(cache, kv, key)
    disk.close()
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 3  # 12 tokens in full pages of 4
    names = page_hashes("model-a", key, 3, PAGE)
    first = tmp_path / "model-a" / f"{names[0]}.kv"
    second = tmp_path / "model-a" / f"{names[1]}.kv"
    blob = bytearray(second.read_bytes())
    blob[-40] ^= 0xFF  # a flipped bit in the payload
    second.write_bytes(bytes(blob))

    kv2, allocator2 = _filled()
    disk2 = DiskTier(tmp_path, "model-a", kv2, max_bytes=1 << 20, page_tokens=PAGE)
    cache2 = TieredRadixCache(allocator2, HostKVPool(32, kv2), write_through=False, disk=disk2)
    assert _request(cache2, kv2, key) == 4  # the first page only: the second fails its crc
    assert disk2.corrupt_pages == 1
    disk2.close()  # the bad page was removed, then written anew from the computed KV
    assert disk2.written_pages >= 1  # (and the pages after it when their reads were cut off)
    assert torch.equal(_page(tmp_path, key, 4),
                       expected_rows(key, 4, 8))
    first.write_bytes(first.read_bytes()[:-10])  # truncated

    kv3, allocator3 = _filled()
    disk3 = DiskTier(tmp_path, "model-b", kv3, max_bytes=1 << 20, page_tokens=PAGE)
    cache3 = TieredRadixCache(allocator3, HostKVPool(32, kv3), write_through=False, disk=disk3)
    assert _request(cache3, kv3, key) == 0  # another model's pages are not found
    disk3.close()
    kv4, allocator4 = _filled()
    disk4 = DiskTier(tmp_path, "model-a", kv4, max_bytes=1 << 20, page_tokens=PAGE)
    cache4 = TieredRadixCache(allocator4, HostKVPool(32, kv4), write_through=False, disk=disk4)
    assert _request(cache4, kv4, key) == 0 and disk4.corrupt_pages == 1
    disk4.close()


def test_disk_tier_stays_within_its_bound(tmp_path: Path) -> None:
    kv, allocator = _filled()
    page_bytes = DiskTier(tmp_path, "probe", kv, max_bytes=1 << 20, page_tokens=PAGE)
    page_bytes.close()
    disk = DiskTier(tmp_path, "model", kv, max_bytes=6 * 600, page_tokens=PAGE)
    cache = TieredRadixCache(allocator, HostKVPool(32, kv), write_through=False, disk=disk)
    for first in range(8):
        _request(cache, kv, [first] * 9)  # two pages each
        disk.flush()
        cache.evict(32)
    sizes = [p.stat().st_size for p in tmp_path.rglob("*.kv")]
    assert sum(sizes) <= 6 * 600 and disk.removed_pages > 0
    assert min(sizes) > 300  # pages are a few hundred bytes: the bound is what limits them
    disk.close()


@pytest.mark.parametrize("option, value", [
    ("hicache_write_policy", "sometimes"), ("hicache_ratio", 0), ("hicache_size", -1),
    ("hicache_storage_backend", "s3"), ("hicache_storage_size", 0)])
def test_bad_hicache_options_are_refused(option: str, value: object) -> None:
    from lmnb.runtime.config import EngineConfig

    with pytest.raises(ValueError, match=option):
        EngineConfig(enable_hierarchical_cache=True, **{option: value})


def test_hicache_option_combinations() -> None:
    from lmnb.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="enable_hierarchical_cache"):
        EngineConfig(hicache_storage_backend="file")
    with pytest.raises(ValueError, match="mutually exclusive"):
        EngineConfig(enable_hierarchical_cache=True, disable_radix_cache=True)


def test_model_identity_tells_weights_dtype_and_layout_apart() -> None:
    from lmnb.runtime.hicache.identity import model_key, parameter_fingerprint

    kv, _ = _filled()

    def key(seed: int, dtype: torch.dtype = torch.float32, kv_storage: KVStorage = kv) -> str:
        torch.manual_seed(seed)
        layer = torch.nn.Linear(4, 4)
        return model_key(model_dir=None, model_config={"layers": 2}, dtype=dtype,
                         load_format="auto", tokenizer_vocab={"a": 0}, kv=kv_storage,
                         parameters=parameter_fingerprint(layer.named_parameters()))

    other_layout = KVStorage(4, num_layers=2, kv_heads=2, head_dim=1, dtype=torch.float32,
                             device=CPU)
    assert key(0) == key(0)
    assert len({key(0), key(1), key(0, torch.bfloat16), key(0, kv_storage=other_layout)}) == 4


def test_model_identity_follows_the_media_preprocessing(tmp_path: Path) -> None:
    """A span's pad ids hash the raw pixels, its KV depends on the preprocessed ones: another
    preprocessing (an edited preprocessor_config.json, or a second folder with the same
    weights) is another model key."""
    from lmnb.runtime.hicache.identity import model_key

    kv, _ = _filled()
    folder = tmp_path / "llava"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")

    def key() -> str:
        return model_key(model_dir=folder, model_config={"layers": 2}, dtype=torch.float32,
                         load_format="auto", tokenizer_vocab={"a": 0}, kv=kv, parameters="p")

    keys = [key()]
    for name in ("preprocessor_config.json", "processor_config.json",
                 "video_preprocessor_config.json"):
        (folder / name).write_text('{"image_mean": [0.5, 0.5, 0.5]}')
        keys.append(key())
        (folder / name).write_text('{"image_mean": [0.4, 0.5, 0.5]}')
        keys.append(key())
    assert len(set(keys)) == len(keys) and key() == keys[-1]


def test_host_pool_size_from_options_and_available_memory() -> None:
    from lmnb.runtime.config import EngineConfig
    from lmnb.runtime.hicache.factory import GB, host_pool_tokens

    def tokens(available: int | None, **options: float) -> int:
        config = EngineConfig(enable_hierarchical_cache=True, **options)
        return host_pool_tokens(config, device_tokens=1000, bytes_per_token=1024,
                                available=available)

    assert tokens(None) == 2000 and tokens(None, hicache_ratio=0.5) == 500
    assert tokens(100 * GB, hicache_size=1) == GB // 1024
    with pytest.raises(ValueError, match="hicache_size"):
        tokens(GB, hicache_size=1)  # one GB asked, one available: refused
    assert tokens(1024 * 100, hicache_ratio=4.0) == 50  # half of what is available


def test_processes_sharing_the_directory_see_whole_pages(tmp_path: Path) -> None:
    """Two writers (as two processes would) write the same pages at once, a reader reads
    meanwhile: every page read checks out, no temporary file is left."""
    import threading

    key = [3, 1, 4, 1, 5, 9, 2, 6] * 8
    writers = []
    for _ in range(2):
        kv, allocator = _filled(size=80)
        disk = DiskTier(tmp_path, "model-a", kv, max_bytes=1 << 20, page_tokens=PAGE)
        writers.append((TieredRadixCache(allocator, HostKVPool(8, kv), write_through=False,
                                         disk=disk), kv, disk))
    threads = [threading.Thread(target=_request, args=(cache, kv, key))
               for cache, kv, _ in writers]
    for thread in threads:
        thread.start()
    reader_kv, _ = _filled()
    reader = DiskTier(tmp_path, "model-a", reader_kv, max_bytes=1 << 20, page_tokens=PAGE)
    for _ in range(20):
        data = reader.load(key, 0, len(key))
        if data is not None:
            assert torch.equal(data, expected_rows(key, 0, data.shape[2]))
    for thread in threads:
        thread.join()
    for _, _, disk in writers:
        disk.close()
    assert reader.corrupt_pages == 0
    assert torch.equal(reader.load(key, 0, len(key) - 1), expected_rows(key, 0, len(key) - 4))
    assert not list(tmp_path.rglob("*.tmp"))
    reader.close()


def test_pages_wait_for_a_writer_that_is_behind(tmp_path: Path) -> None:
    """Past `max_queued_bytes` of pages waiting for the writer, pages are not queued (nor
    remembered): a later persist offers them again."""
    kv, allocator = _filled()
    disk = DiskTier(tmp_path, "model-a", kv, max_bytes=1 << 20, page_tokens=PAGE,
                    max_queued_bytes=0)
    cache = TieredRadixCache(allocator, HostKVPool(32, kv), write_through=False, disk=disk)
    key = list(range(9))
    _request(cache, kv, key)
    disk.flush()
    assert disk.written_pages == 0
    disk.max_queued_bytes = 1 << 20
    assert disk.offer(key, cache.match_all(key).indices) == 2
    disk.close()
    assert disk.written_pages == 2


def test_evicting_a_loaded_node_after_a_save_drained_the_loads() -> None:
    """Hypothesis found it: a save inside an eviction completes the queued loads, then a node of
    that load is evicted; it must leave the pending set with its device rows."""
    machine = TieredCacheMachine()
    try:
        for step in (lambda: machine.evict(1), lambda: machine.request([1, 0]),
                     lambda: machine.evict(1), lambda: machine.request([0, 0]),
                     lambda: machine.load_unread([1, 0]), lambda: machine.evict(3)):
            step()
            machine.consistent()
    finally:
        machine.teardown()


def test_a_write_that_fills_the_disk_leaves_no_partial_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page write that fails with ENOSPC removes its partial temporary file and forgets the
    page: a later offer queues it again."""
    import errno

    kv, _ = _filled()
    disk = DiskTier(tmp_path, "model-a", kv, max_bytes=1 << 20, page_tokens=PAGE)
    real_write_bytes = Path.write_bytes

    def full_disk(self: Path, data: bytes) -> int:
        if self.suffix != ".tmp":
            return real_write_bytes(self, data)
        with open(self, "wb") as f:  # what a write into a full file system leaves: a part
            f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    key = list(range(2 * PAGE))
    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_bytes", full_disk)
        assert disk.offer(key, torch.arange(2 * PAGE)) == 2
        disk.flush()
    assert not list(disk.dir.glob("*.tmp")) and disk.written_pages == 0
    assert disk.offer(key, torch.arange(2 * PAGE)) == 2
    disk.close()
    assert disk.written_pages == 2
