"""KV memory: which slots are free (`KVAllocator`), what they hold (`KVStorage`), and which slots
each live request uses (`ReqToTokenPool`). One token a slot (page size 1)."""

from lmnb.runtime.memory.allocator import KVAllocator, OutOfSlotsError
from lmnb.runtime.memory.kv_storage import KVStorage, kv_cache_dtype
from lmnb.runtime.memory.req_to_token import ReqToTokenPool
