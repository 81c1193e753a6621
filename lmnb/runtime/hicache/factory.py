"""The cache `enable_hierarchical_cache` builds: the host pool's size from the options and the
available host memory, the disk tier when `hicache_storage_backend="file"`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from lmnb.runtime.config import EngineConfig
from lmnb.runtime.hicache.disk import DiskTier
from lmnb.runtime.hicache.host_pool import HostKVPool
from lmnb.runtime.memory import KVAllocator, KVStorage
from lmnb.runtime.radix.tiered import TieredRadixCache

GB = 1 << 30
HOST_SHARE = 0.5  # of the available host memory a ratio-sized host pool may take at most
logger = logging.getLogger(__name__)
DEFAULT_STORAGE_DIR = Path("~/.cache/lmnb/hicache")

def host_pool_tokens(config: EngineConfig, *, device_tokens: int, bytes_per_token: int,
                     available: int | None) -> int:
    """`hicache_size` GB of host memory (refused beyond the `available` bytes), else
    `hicache_ratio` times the device pool, capped at a share of what is available."""
    if config.hicache_size > 0:
        tokens = max(config.hicache_size * GB // bytes_per_token, 1)
        if available is not None and tokens * bytes_per_token > 0.9 * available:
            raise ValueError(f"hicache_size={config.hicache_size} GB does not fit in the "
                             f"{available / GB:.1f} GB of available host memory")
        return tokens
    tokens = max(int(config.hicache_ratio * device_tokens), 1)
    if available is not None and tokens * bytes_per_token > HOST_SHARE * available:
        capped = max(int(HOST_SHARE * available) // bytes_per_token, 1)
        logger.warning("hicache: hicache_ratio=%s asks for %.1f GB of host memory; %.1f GB "
                       "available: the host pool gets %.1f GB (set hicache_size to choose)",
                       config.hicache_ratio, tokens * bytes_per_token / GB, available / GB,
                       capped * bytes_per_token / GB)
        return capped
    return tokens


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def make_tiered_cache(config: EngineConfig, allocator: KVAllocator, kv: KVStorage, *,
                      model_key: Callable[[], str]) -> TieredRadixCache:
    """The cache `enable_hierarchical_cache` asks for; `model_key` is called only when a disk
    tier is configured."""
    tokens = host_pool_tokens(config, device_tokens=allocator.size,
                              bytes_per_token=HostKVPool.bytes_per_token(kv),
                              available=available_host_bytes())
    host = HostKVPool(tokens, kv)
    disk = None
    if config.hicache_storage_backend == "file":
        root = Path(config.hicache_storage_dir or DEFAULT_STORAGE_DIR).expanduser()
        disk = DiskTier(root, model_key(), kv, max_bytes=int(config.hicache_storage_size * GB))
    return TieredRadixCache(allocator, host,
                            write_through=config.hicache_write_policy == "write_through",
                            disk=disk)
