"""bicache: shared-prefix KV caching for diffusion language models.

Bidirectional attention makes a shared prefix's K/V depend on each request, so autoregressive-style
prefix caching corrupts them; they stay reusable in shallow layers, to a depth that depends on the
shared fraction of the request. :mod:`bicache.depth` measures that drift and picks a safe depth per
request; :mod:`bicache.kvcache` reuses the prefix K/V of the layers above it through the transformers
Cache API; :mod:`bicache.engine` and :mod:`bicache.server` serve requests with it.
"""

from .depth import Calibration, DepthPolicy, calibrate, choose_bound, kv_drift
from .diffusion import DECODE_MODES, DecodeConfig, DecodeStats, generate
from .engine import MODES, Completion, Engine, keep_heap
from .kvcache import PassLayer, PrefixEntry, RecordingLayer, SpliceLayer, block_cache, fill_entry, prefix_cache
from .model import DiffusionLM, decoder_layers, load_local_dlm, tiny_config
from .prefix_store import PrefixStore, Reservoir, common_prefix_len
from .task import Request, TableTask, TaskSpec, Vocab
from .train import Recipe, cache_dir, load_or_train, train

__version__ = "0.1.0"

__all__ = [
    "DECODE_MODES",
    "MODES",
    "Calibration",
    "Completion",
    "DecodeConfig",
    "DecodeStats",
    "DepthPolicy",
    "DiffusionLM",
    "Engine",
    "PassLayer",
    "PrefixEntry",
    "PrefixStore",
    "Recipe",
    "RecordingLayer",
    "Reservoir",
    "Request",
    "SpliceLayer",
    "TableTask",
    "TaskSpec",
    "Vocab",
    "block_cache",
    "cache_dir",
    "calibrate",
    "choose_bound",
    "common_prefix_len",
    "decoder_layers",
    "fill_entry",
    "generate",
    "keep_heap",
    "kv_drift",
    "load_local_dlm",
    "load_or_train",
    "prefix_cache",
    "tiny_config",
    "train",
    "__version__",
]
