"""kvpool: one KV-cache pool across host-memory modules and SSDs, with filesystem bypass.

Chunks of N tokens keyed by a chained prefix hash (``keys``), striped over every device in
proportion to its bandwidth (``placement``, the core), stored on SSDs in one O_DIRECT slab each
(``passthrough``), read back by one thread per device layer by layer (``retrieval``), and plugged
into transformers as a Cache (``hf``).
"""

from .devices import DeviceSet, build_devices, from_machine, measure_read_bandwidth
from .keys import DEFAULT_CHUNK_TOKENS, ChunkKey, KVLayout, chunk_keys, longest_prefix, unit_name
from .passthrough import AlignedBuffer, DeviceUnavailable, PassthroughStore
from .placement import ChunkRecord, DeviceInfo, Move, Placement, PlacementPlan
from .pool import ChunkConflict, KVPool
from .retrieval import KVBuffers, LayerwiseLoad
from .stores import ExtentAllocator, MemoryStore, StoreStats, Throttle

__version__ = "0.1.0"

__all__ = [
    "AlignedBuffer",
    "ChunkConflict",
    "ChunkKey",
    "ChunkRecord",
    "DEFAULT_CHUNK_TOKENS",
    "DeviceInfo",
    "DeviceSet",
    "DeviceUnavailable",
    "ExtentAllocator",
    "KVBuffers",
    "KVLayout",
    "KVPool",
    "LayerwiseLoad",
    "MemoryStore",
    "Move",
    "PassthroughStore",
    "Placement",
    "PlacementPlan",
    "StoreStats",
    "Throttle",
    "build_devices",
    "chunk_keys",
    "from_machine",
    "longest_prefix",
    "measure_read_bandwidth",
    "unit_name",
    "__version__",
]
