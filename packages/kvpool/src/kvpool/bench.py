"""The headline comparison, side by side in one run: recompute, serialized tiers, kvpool.

A long-context request (real text: Python stdlib sources, byte tokens) goes through a tiny Llama
built locally whose KV is large (many layers, no GQA). The recompute (cold) pass's KV is stored in
both kvpool and the LMCache-style serialized tiers; warm passes then measure TTFT, retrieval
bandwidth, time the caller is blocked on I/O, page-cache footprint and the filesystem's share of
the serialized disk tier. Run twice: with per-device bandwidth caps emulating several SSDs on the
one disk of this machine (labelled emulated), and raw (no caps; all "SSDs" share one disk).
A fault-injection run (``faults.safety_counts``) adds the ``safety`` block: wrong bytes returned
and acknowledged writes lost under concurrent same-key PUT/GET and kill -9, each of which must be 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hwtopo

from . import __version__
from .baselines import SerialTiers
from .devices import build_devices
from .faults import safety_counts
from .hf import PoolCache, _run, cache_kv, layout_for, prefill
from .iobench import chunk_read_bandwidth
from .pagecache import meminfo_cached_bytes
from .pool import KVPool
from .retrieval import KVBuffers
from .stores import Throttle

__all__ = ["BenchConfig", "run_bench", "build_model", "stdlib_tokens"]

log = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    tokens: int = 2048 + 32  # cached prefix (full chunks) + a short new turn
    layers: int = 16
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 8
    intermediate: int = 1024
    chunk_tokens: int = 128  # quick: 2k tokens in 16 chunks so striping has something to balance
    reps: int = 5
    memory_modules: int = 2
    memory_share: float = 0.25  # fraction of the prefix's KV the memory modules hold together
    # the device mix of hwtopo's bundled ``storage-server`` example (2 NUMA nodes, 4 NVMe SSDs),
    # emulated on this machine's one disk; the minimum (2 SSDs) runs too (``compare_ssds``)
    ssds: int = 4
    compare_ssds: int | None = 2
    # emulated per-SSD read bandwidth, bytes/s. Chosen so that retrieval, not the suffix's compute,
    # dominates TTFT as in the paper (16 GB of KV at ~3.5 GB/s vs a GPU prefill of a short turn);
    # here 100+ MB of KV against ~0.3 s of CPU compute for the suffix.
    ssd_read_cap: float = 200e6
    ssd_write_cap: float | None = None
    recompute_reps: int = 2
    read_chunks: int = 8  # chunks of the get_chunk-vs-torch.load measurement (0 skips it)
    io_backend: str = "preadv"  # SSD reads: "preadv", "io_uring" or "auto"
    seed: int = 0
    # the ``safety`` block (``faults.safety_counts``): concurrent same-key PUT/GET pairs against
    # kvpool serve per device kind, and kill -9 loops during 4-thread puts; 0 and 0 skip it
    safety_pairs: int = 2000
    safety_kills: int = 20

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls()

    @classmethod
    def full(cls) -> BenchConfig:
        return cls(tokens=8192 + 32, chunk_tokens=256, reps=5, recompute_reps=3)

    def validate(self) -> None:
        if self.tokens <= self.chunk_tokens:
            raise ValueError(f"tokens must exceed chunk_tokens ({self.chunk_tokens}), not {self.tokens}")
        if self.ssds < 1:
            raise ValueError(f"ssds must be >= 1, not {self.ssds}")
        if self.compare_ssds is not None and self.compare_ssds < 1:
            raise ValueError(f"compare_ssds must be >= 1 or None, not {self.compare_ssds}")
        if self.safety_pairs < 0 or self.safety_kills < 0:
            raise ValueError(
                f"safety_pairs and safety_kills must be >= 0, not {self.safety_pairs}, {self.safety_kills}"
            )
        if not 0 < self.memory_share < 1:
            raise ValueError(f"memory_share must be in (0, 1), not {self.memory_share}")


def build_model(cfg: BenchConfig) -> LlamaForCausalLM:
    torch.manual_seed(cfg.seed)
    conf = LlamaConfig(
        vocab_size=256,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(4096, cfg.tokens + 64),
    )
    return LlamaForCausalLM(conf).eval()


def stdlib_tokens(n: int) -> torch.Tensor:
    """``n`` byte tokens of real text: the Python standard library's own sources."""
    base = Path(os.path.dirname(os.__file__))
    data = bytearray()
    for name in ("os.py", "functools.py", "collections/__init__.py", "typing.py", "argparse.py"):
        p = base / name
        if p.exists():
            data += p.read_bytes()
        if len(data) >= n:
            break
    while len(data) < n:
        data += data or b"x"
    return torch.tensor(list(data[:n]), dtype=torch.long).unsqueeze(0)


def _median(xs):
    return statistics.median(xs) if xs else None


def _serial_ttft(model, ids, serial: SerialTiers, T: int, out: KVBuffers):
    t0 = time.perf_counter()
    load = serial.retrieve(ids[0].tolist(), max_tokens=T - 1, extra_tokens=None, out=out)
    cache: DynamicCache
    if load.tokens:
        cache = PoolCache(load, model.config)  # same compute path as kvpool's; only retrieval differs
        logits = _run(model, ids[:, load.tokens :], cache)
    else:
        cache = DynamicCache(config=model.config)
        logits = _run(model, ids, cache)
    return time.perf_counter() - t0, logits, load


_SERIES = ("pool_ttft", "pool_blocked", "pool_ret", "ser_ttft", "ser_ret", "fs_frac", "kern_frac")


@dataclass
class _WarmReps:
    """What the warm reps of one ``_mode`` run measured: per-rep series, maxima and the last rep's."""

    series: dict = field(default_factory=lambda: {k: [] for k in _SERIES})
    diffs: list = field(default_factory=list)
    cached_delta: list = field(default_factory=list)
    pool_bytes: int = 0
    ser_bytes: int = 0
    pc_pool_max: int = 0
    pc_ser_max: int = 0
    last_pool_ret: dict | None = None
    last_ser: dict | None = None
    cached_tokens: int | None = None


def _build_caches(model, cfg: BenchConfig, workdir: Path, emulated: bool, ssds: int, prefix_chunks: int):
    """kvpool on ``ssds`` slabs and the serialized tiers, equal memory and caps so only reads differ."""
    layout = layout_for(model, cfg.chunk_tokens)
    mem_total = int(prefix_chunks * layout.chunk_bytes * cfg.memory_share)
    mem_each = max(layout.chunk_bytes, mem_total // max(1, cfg.memory_modules))
    ssd_each = int(prefix_chunks * layout.chunk_bytes * 1.2 / max(1, ssds)) + (8 << 20)
    paths = []
    for i in range(ssds):
        p = workdir / f"ssd{i}"
        p.mkdir(parents=True, exist_ok=True)
        paths.append(p)
    cap = cfg.ssd_read_cap if emulated else None
    devs = build_devices(
        paths,
        memory_modules=cfg.memory_modules,
        memory_bytes=mem_each,
        ssd_bytes=ssd_each,
        ssd_read_cap=cap,
        ssd_write_cap=cfg.ssd_write_cap if emulated else None,
        io_backend=cfg.io_backend,
    )
    pool = KVPool(devs.stores, layout, "bench-llama", devs.bandwidths, promote=False)
    serial = SerialTiers(
        layout,
        "bench-llama",
        memory_bytes=cfg.memory_modules * mem_each,
        disk_dir=workdir / "serial",
        throttle=Throttle(cap) if cap else None,
    )
    return layout, devs, pool, serial


def _timed_put(cache, tokens: list, kv) -> tuple:
    """``cache.put(tokens, kv)`` and its seconds, so each cache's store cost is reported apart."""
    t0 = time.perf_counter()
    stored = cache.put(tokens, kv)
    return stored, time.perf_counter() - t0


def _pool_rep(model, ids, pool: KVPool, bufs: KVBuffers, ref, acc: _WarmReps) -> None:
    """One warm kvpool rep: TTFT through ``prefill``, then a bare retrieval to isolate its bandwidth."""
    T = ids.shape[1]
    c0 = meminfo_cached_bytes()
    r = prefill(model, ids, pool, store=False, out=bufs)
    c1 = meminfo_cached_bytes()
    if c0 is not None and c1 is not None:
        acc.cached_delta.append(c1 - c0)
    acc.series["pool_ttft"].append(r.ttft_s)
    acc.series["pool_blocked"].append(r.blocked_s)
    acc.diffs.append(float((r.logits - ref).abs().max()))
    acc.cached_tokens = r.cached_tokens
    acc.pc_pool_max = max(acc.pc_pool_max, pool.page_cache_bytes())
    load = pool.retrieve(ids[0].tolist(), max_tokens=T - 1, out=bufs).join()
    acc.series["pool_ret"].append(load.elapsed_s)
    acc.pool_bytes = load.bytes_read
    acc.last_pool_ret = load.describe()


def _serial_rep(model, ids, serial: SerialTiers, bufs: KVBuffers, ref, acc: _WarmReps) -> None:
    """One warm serialized-tiers rep: TTFT, then a bare retrieval, each from a dropped page cache."""
    T = ids.shape[1]
    serial.drop_page_cache()
    t, logits, _ = _serial_ttft(model, ids, serial, T, bufs)
    acc.series["ser_ttft"].append(t)
    acc.diffs.append(float((logits - ref).abs().max()))
    acc.pc_ser_max = max(acc.pc_ser_max, serial.page_cache_bytes())
    serial.drop_page_cache()
    sload = serial.retrieve(ids[0].tolist(), max_tokens=T - 1, out=bufs)
    acc.series["ser_ret"].append(sload.elapsed_s)
    acc.series["fs_frac"].append(sload.fs_time_frac)
    acc.series["kern_frac"].append(sload.kernel_time_frac)
    acc.ser_bytes = sload.bytes["memory"] + sload.bytes["disk"]
    acc.last_ser = sload.describe()


def _mode(model, ids, cfg: BenchConfig, workdir: Path, emulated: bool, progress, cold, ssds: int | None = None) -> dict:
    """One run (emulated caps or raw). ``cold``: (logits, per-layer KV) of the full recompute.

    ``ssds``: how many SSD slabs kvpool stripes over (default ``cfg.ssds``); the serialized tiers
    always have one disk tier, as LMCache's local-disk backend (one path per process).
    """
    ssds = cfg.ssds if ssds is None else ssds
    T = ids.shape[1]
    prefix_chunks = (T - 1) // cfg.chunk_tokens
    layout, devs, pool, serial = _build_caches(model, cfg, workdir, emulated, ssds, prefix_chunks)
    try:
        # the cold request: its KV (from the recompute) goes into both caches
        ref, kv = cold
        stored, pool_store_s = _timed_put(pool, ids[0].tolist(), kv)
        _, serial_store_s = _timed_put(serial, ids[0].tolist(), kv)
        # one set of pre-touched destination buffers, reused by both methods (same memory, no page faults)
        bufs = KVBuffers(layout, T)
        progress(
            f"{'emulated' if emulated else 'raw'} ({ssds} SSDs): stored {stored} chunks in {pool_store_s:.2f}s "
            f"(serialized tiers: {serial_store_s:.2f}s)"
        )
        acc = _WarmReps()
        for _ in range(cfg.reps):
            serial.drop_page_cache()
            _pool_rep(model, ids, pool, bufs, ref, acc)
            _serial_rep(model, ids, serial, bufs, ref, acc)
        m = {k: _median([x for x in v if x is not None]) for k, v in acc.series.items()}
        kv_bytes = prefix_chunks * layout.chunk_bytes
        return {
            "emulated": emulated,
            "ssds": ssds,
            "cached_tokens": acc.cached_tokens,
            "kv_bytes": kv_bytes,
            "kvpool": {
                "store_s": pool_store_s,
                "ttft_s": m["pool_ttft"],
                "blocked_io_s": m["pool_blocked"],
                "retrieval_s": m["pool_ret"],
                "retrieval_bytes_per_s": kv_bytes / m["pool_ret"],
                "bytes_read": acc.pool_bytes,
                "page_cache_bytes": acc.pc_pool_max,
                "meminfo_cached_delta_bytes": _median(acc.cached_delta),
                "retrieval": acc.last_pool_ret,
                "devices": {s.name: s.describe() for s in devs.stores},
                "bandwidths_measured": devs.bandwidths,
                "placement": pool.placement.snapshot(),
            },
            "serial": {
                "store_s": serial_store_s,
                "ttft_s": m["ser_ttft"],
                "blocked_io_s": m["ser_ret"],
                "retrieval_s": m["ser_ret"],
                "retrieval_bytes_per_s": kv_bytes / m["ser_ret"],
                "bytes_read": acc.ser_bytes,
                "page_cache_bytes": acc.pc_ser_max,
                "fs_time_frac": m["fs_frac"],
                "kernel_time_frac": m["kern_frac"],
                "retrieval": acc.last_ser,
                "files": len(serial.files()),
            },
            "max_abs_logit_diff_vs_recompute": max(acc.diffs),
            "emulation": devs.emulated if emulated else False,
        }
    finally:
        pool.close()
        devs.close()


def run_bench(cfg: BenchConfig, workdir: str | os.PathLike | None = None, progress=None) -> dict:
    """Recompute, serialized tiers and kvpool on one request; emulated and raw. Returns the JSON dict."""
    cfg.validate()
    progress = progress or (lambda msg: None)
    torch.set_num_threads(1)
    model = build_model(cfg)
    ids = stdlib_tokens(cfg.tokens)
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="kvpool-bench-") if workdir is None else workdir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad():
            rec = []
            for _ in range(max(1, min(cfg.reps, cfg.recompute_reps))):
                t0 = time.perf_counter()
                cache = DynamicCache(config=model.config)
                logits = _run(model, ids, cache)
                rec.append(time.perf_counter() - t0)
            progress(f"recompute: {statistics.median(rec):.2f}s")
            cold = (logits, cache_kv(cache))
            emu = _mode(model, ids, cfg, root / "emulated", True, progress, cold)
            few = None
            if cfg.compare_ssds and cfg.compare_ssds != cfg.ssds:
                few = _mode(model, ids, cfg, root / "emulated_few", True, progress, cold, ssds=cfg.compare_ssds)
            raw = _mode(model, ids, cfg, root / "raw", False, progress, cold)
        chunk_read = None
        if cfg.read_chunks:
            progress("chunk reads: get_chunk / read_chunk / HTTP GET vs torch.load (real disk, cold)")
            chunk_read = chunk_read_bandwidth(
                layout_for(model, cfg.chunk_tokens), root / "chunks", cfg.read_chunks, cfg.reps, cfg.seed
            )
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
        else:
            for sub in ("emulated", "emulated_few", "raw", "chunks"):
                shutil.rmtree(root / sub, ignore_errors=True)
    recompute = statistics.median(rec)
    safety = None
    if cfg.safety_pairs or cfg.safety_kills:
        progress("safety: same-key PUT/GET race over kvpool serve, kill -9 during puts")
        safety = safety_counts(cfg.safety_pairs, cfg.safety_kills, directory=workdir)
    h_emu, h_raw = _ratios(emu, recompute), _ratios(raw, recompute)
    headline = dict(h_emu)
    headline["fs_time_frac_serial"] = h_raw["fs_time_frac_serial"]  # measured without emulated waits
    headline["kernel_time_frac_serial"] = h_raw["kernel_time_frac_serial"]
    headline["ttft_ratio_vs_serial_raw"] = h_raw["ttft_ratio_vs_serial"]
    headline["retrieval_bw_ratio_vs_serial_raw"] = h_raw["retrieval_bw_ratio_vs_serial"]
    headline["blocked_io_ratio_vs_serial_raw"] = h_raw["blocked_io_ratio_vs_serial"]
    results = {"recompute": {"ttft_s": recompute, "runs_s": rec}, "emulated": emu}
    if few is not None:
        # with memory holding the same share in both and n equal SSDs, n x is the ceiling of the
        # bandwidth ratio (the serialized tiers read their one disk tier at one SSD's rate)
        h_few = _ratios(few, recompute)
        tag = f"{cfg.compare_ssds}ssd"
        for k in ("ttft_ratio_vs_serial", "retrieval_bw_ratio_vs_serial", "blocked_io_ratio_vs_serial"):
            headline[f"{k}_{tag}"] = h_few[k]
        results[f"emulated_{tag}"] = few
        results[f"ratios_emulated_{tag}"] = h_few
    results.update({"raw": raw, "ratios_emulated": h_emu, "ratios_raw": h_raw})
    if chunk_read is not None:
        results["chunk_read"] = chunk_read
        headline["get_chunk_bw_ratio_vs_torch_load"] = chunk_read["get_chunk_bw_ratio_vs_torch_load"]
    return {
        "package": "kvpool",
        "version": __version__,
        "config": asdict(cfg),
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": results,
        "headline": headline,
        "headline_conditions": (
            f"ratios from the emulated run ({cfg.ssds} SSDs with per-SSD read caps on one disk, "
            f"{cfg.memory_modules} memory modules) except fs_time_frac_serial and kernel_time_frac_serial "
            f"(raw run), *_raw keys (raw run, no caps) and *_{cfg.compare_ssds}ssd keys (emulated, "
            f"{cfg.compare_ssds} SSDs); the serialized tiers always read one disk tier"
        ),
        "emulated": emu["emulation"],
        "safety": safety,
    }


def _ratios(r: dict, recompute_s: float) -> dict:
    """kvpool against the serialized tiers (and recompute) in one run of ``_mode``."""
    kp, se = r["kvpool"], r["serial"]
    return {
        "ttft_ratio_vs_serial": kp["ttft_s"] / se["ttft_s"],
        "ttft_ratio_vs_recompute": kp["ttft_s"] / recompute_s,
        "retrieval_bw_ratio_vs_serial": kp["retrieval_bytes_per_s"] / se["retrieval_bytes_per_s"],
        "page_cache_bytes_passthrough": kp["page_cache_bytes"],
        "page_cache_frac_passthrough": kp["page_cache_bytes"] / max(1, kp["bytes_read"]),
        "blocked_io_ratio_vs_serial": kp["blocked_io_s"] / se["blocked_io_s"],
        "fs_time_frac_serial": se["fs_time_frac"],
        "kernel_time_frac_serial": se["kernel_time_frac"],
    }
