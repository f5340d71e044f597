"""Serving engine for the diffusion LM: batching, shared-prefix detection, depth policy, metrics.

Requests queue up (at most ``max_queue``; beyond that :class:`QueueFull`); the scheduler takes the
request with the least estimated work (denoising steps x sequence length; the oldest among equals)
and batches it with queued requests of the same prompt length and decode settings, preferring the
ones sharing its longest common token prefix. Shortest-work-first keeps a light request from
waiting behind a queue of heavy ones; a request overtaken by ``max_skips`` later arrivals goes
next, so heavy ones are not starved either. A radix-tree
:class:`~bicache.prefix_store.PrefixStore` keeps one :class:`~bicache.kvcache.PrefixEntry` per
shared prefix (filled by the first batch that brings it, from that batch's own first denoising
step) and the :class:`~bicache.depth.DepthPolicy` picks the reuse depth from the shared fraction of
the prompt.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from . import diffusion
from .depth import DepthPolicy
from .model import DiffusionLM
from .prefix_store import PrefixStore, Reservoir, common_prefix_len

log = logging.getLogger(__name__)

# every serving mode: the decode modes plus ``fixed`` (bicache at one depth for every request)
MODES = (*diffusion.DECODE_MODES, "fixed")


def keep_heap(top_pad: int = 64 << 20) -> bool:
    """Keep freed tensor memory in the process heap (glibc ``mallopt``); False where not applied.

    With glibc's default (dynamic) mmap and trim thresholds, the large activations of a
    full-sequence forward are handed back to the OS when freed and page-faulted in again on the next
    allocation: in the quick bench (profiled under load) the no-cache variant took ~136k minor
    page faults and ~0.25 s of system time per pass (over a third of its CPU time, and its noisiest
    part), more than the variants with smaller tensors. Raising the thresholds lets every variant reuse heap memory; a
    serving process wants the same. Process-wide, so the CLI (bench, serve) calls it, not the library.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = mallopt(m_mmap_threshold, 32 << 20) == 1
    ok = mallopt(m_trim_threshold, 1 << 30) == 1 and ok
    ok = mallopt(m_top_pad, top_pad) == 1 and ok
    return ok


class QueueFull(RuntimeError):
    """The engine already holds ``max_queue`` requests; ``retry_after_s`` estimates when to retry."""

    def __init__(self, queued: int, retry_after_s: int) -> None:
        super().__init__(f"the engine's queue is full ({queued} requests waiting); retry in {retry_after_s} s")
        self.queued = queued
        self.retry_after_s = retry_after_s


def estimated_work(prompt_len: int, cfg: diffusion.DecodeConfig) -> int:
    """A request's decoding cost in token positions processed: steps x (prompt + generated)."""
    return cfg.steps * (prompt_len + cfg.gen_length)


@dataclass(eq=False)
class _Queued:
    prompt: list[int]
    cfg: diffusion.DecodeConfig
    t0: float
    fut: Future
    seq: int  # arrival order
    work: int
    skips: int = 0  # times a later arrival was served before this request


@dataclass
class Completion:
    tokens: list[int]
    latency_s: float
    mode: str
    depth: int
    prefix_len: int
    fraction: float
    batch_size: int
    explain: dict | None = None


@dataclass
class EngineStats:
    requests: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0  # wall-clock seconds spent decoding
    cpu_s: float = 0.0  # CPU seconds of the decoding thread (robust on a loaded machine)
    latencies: Reservoir = field(default_factory=Reservoir)  # bounded: a server runs for long
    batches: int = 0
    forwards: int = 0
    tokens_computed: int = 0

    def summary(self) -> dict:
        return {
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "busy_s": round(self.busy_s, 4),
            "cpu_s": round(self.cpu_s, 4),
            "tokens_per_s": round(self.generated_tokens / self.busy_s, 2) if self.busy_s else 0.0,
            "tokens_per_cpu_s": round(self.generated_tokens / self.cpu_s, 2) if self.cpu_s else 0.0,
            "latency_p50_s": round(self.latencies.quantile(0.5), 4),
            "latency_p95_s": round(self.latencies.quantile(0.95), 4),
            "latency_max_s": round(self.latencies.max, 4),
            "batches": self.batches,
            "forwards": self.forwards,
            "token_layers_computed": self.tokens_computed,
        }


class Engine:
    """Batches requests and decodes them with one cache mode.

    ``mode``: ``none`` | ``naive`` | ``bicache`` | ``block`` | ``bicache+block`` | ``fixed`` (bicache at
    ``fixed_depth`` for every request). bicache modes need a ``policy``. ``max_queue`` bounds the
    waiting requests (``submit`` raises :class:`QueueFull` beyond it); ``max_skips`` bounds how
    often shortest-work-first may serve a later arrival before a waiting request.
    """

    def __init__(
        self,
        dlm: DiffusionLM,
        mode: str = "bicache",
        policy: DepthPolicy | None = None,
        max_batch: int = 8,
        min_prefix: int = 4,
        fixed_depth: int = 0,
        cfg: diffusion.DecodeConfig | None = None,
        store: PrefixStore | None = None,
        max_queue: int = 256,
        max_skips: int = 8,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode in ("bicache", "bicache+block") and policy is None:
            raise ValueError(f"mode {mode!r} needs a DepthPolicy (see bicache.depth.calibrate)")
        if policy is not None and policy.calibration.num_layers != dlm.num_layers:
            raise ValueError(
                f"the depth policy was calibrated on {policy.calibration.num_layers} layers but the model has "
                f"{dlm.num_layers}; mismatched cache and model"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 1 or max_skips < 0:
            raise ValueError(f"max_queue must be >= 1 and max_skips >= 0, got {max_queue} and {max_skips}")
        self.dlm, self.mode, self.policy = dlm, mode, policy
        self.max_batch, self.min_prefix, self.fixed_depth = max_batch, min_prefix, fixed_depth
        self.cfg = cfg or diffusion.DecodeConfig(gen_length=dlm.spec.gen_length)
        self.store = store if store is not None else PrefixStore()
        self.stats = EngineStats()
        self.max_queue, self.max_skips = max_queue, max_skips
        self._queue: list[_Queued] = []
        self._arrivals = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---------------------------------------------------------------- validation
    def check_prompt(self, prompt: list[int], cfg: diffusion.DecodeConfig | None = None) -> None:
        cfg = cfg or self.cfg
        cfg.validate()
        if not prompt:
            raise ValueError("prompt is empty; give at least one token")
        # the length first: it is O(1), and an over-long prompt need not have its ids scanned
        if len(prompt) + cfg.gen_length > self.dlm.max_length:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + gen_length {cfg.gen_length} is longer than the model's "
                f"{self.dlm.max_length} positions"
            )
        if any((not isinstance(t, int)) or t < 0 or t >= self.dlm.config.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.dlm.config.vocab_size})")

    # ---------------------------------------------------------------- scheduling
    def _pick_batch(self) -> list[_Queued]:
        starved = [r for r in self._queue if r.skips >= self.max_skips]
        head = starved[0] if starved else min(self._queue, key=lambda r: (r.work, r.seq))
        same = [r for r in self._queue if r is not head and len(r.prompt) == len(head.prompt) and r.cfg == head.cfg]
        same.sort(key=lambda r: (-common_prefix_len(r.prompt, head.prompt), r.seq))
        batch = [head, *same[: self.max_batch - 1]]
        last = max(r.seq for r in batch)
        taken = {id(r) for r in batch}
        self._queue = [r for r in self._queue if id(r) not in taken]
        for r in self._queue:
            r.skips += r.seq < last
        return batch

    def _depth(self, fraction: float) -> tuple[int, dict | None]:
        if self.mode == "fixed":
            return self.fixed_depth, None
        if self.mode in ("bicache", "bicache+block"):
            assert self.policy is not None  # __init__ requires one for these modes
            return self.policy.depth(fraction), self.policy.explain(fraction)
        if self.mode == "naive":
            return self.dlm.num_layers, None
        return 0, None

    def run_batch(self, prompts: list[list[int]], cfg: diffusion.DecodeConfig | None = None) -> list[Completion]:
        """Decode one batch of equal-length prompts now (synchronously)."""
        cfg = cfg or self.cfg
        for p in prompts:
            self.check_prompt(p, cfg)
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("a batch needs prompts of equal length")
        t0, c0 = time.perf_counter(), time.thread_time()
        dlm = self.dlm
        ids = torch.tensor(prompts, dtype=torch.long)
        stats = diffusion.DecodeStats()
        mode = self.mode
        entry, depth, explain, prefix_len, fill = None, 0, None, 0, 0
        if mode != "none" and mode != "block":
            entry = self.store.lookup(prompts)
            lcp = min(common_prefix_len(prompts[0], p) for p in prompts)
            if entry is None and len(prompts) > 1 and lcp >= self.min_prefix:
                fill = min(lcp, len(prompts[0]) - 1)  # this batch's first step fills the entry
            prefix_len = entry.length if entry is not None else fill
            if prefix_len:
                depth, explain = self._depth(prefix_len / len(prompts[0]))
        dmode = {"fixed": "bicache"}.get(mode, mode)
        if not prefix_len and dmode in ("naive", "bicache"):
            dmode, depth = "none", 0
        elif not prefix_len and dmode == "bicache+block":
            dmode, depth = "block", 0
        out = diffusion.generate(dlm, ids, cfg, mode=dmode, depth=depth, entry=entry, stats=stats, fill_prefix=fill)
        if stats.entry is not None:
            self.store.add(stats.entry)
        dt = time.perf_counter() - t0
        self.stats.cpu_s += time.thread_time() - c0
        self.stats.busy_s += dt
        self.stats.batches += 1
        self.stats.requests += len(prompts)
        self.stats.generated_tokens += out.numel()
        self.stats.forwards += stats.forwards
        self.stats.tokens_computed += stats.tokens_computed
        frac = prefix_len / len(prompts[0])
        return [
            Completion(row, dt, mode, depth, prefix_len, round(frac, 4), len(prompts), explain) for row in out.tolist()
        ]

    def run(self, prompts: list[list[int]]) -> list[Completion]:
        """Serve a whole list of requests offline through the scheduler; results in input order."""
        futures = []
        for p in prompts:
            while len(self._queue) >= self.max_queue:
                self.step()
            futures.append(self.submit(p))
        self.drain()
        return [f.result() for f in futures]

    # ---------------------------------------------------------------- online
    def _retry_after_s(self) -> int:
        """Seconds until the queue has likely moved on: its batches at the mean batch time so far."""
        per_batch = self.stats.busy_s / self.stats.batches if self.stats.batches else 1.0
        return max(1, math.ceil(per_batch * math.ceil(len(self._queue) / self.max_batch)))

    def submit(self, prompt: list[int], cfg: diffusion.DecodeConfig | None = None) -> Future:
        """Queue one request; its Future holds the :class:`Completion`. :class:`QueueFull` when full."""
        cfg = cfg or self.cfg
        self.check_prompt(prompt, cfg)
        fut: Future = Future()
        with self._wake:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(len(self._queue), self._retry_after_s())
            work = estimated_work(len(prompt), cfg)
            self._queue.append(_Queued(list(prompt), cfg, time.perf_counter(), fut, next(self._arrivals), work))
            self._wake.notify()
        return fut

    def step(self) -> bool:
        """Schedule and run one batch from the queue; False when the queue is empty."""
        with self._lock:
            if not self._queue:
                return False
            batch = self._pick_batch()
        try:
            done = self.run_batch([r.prompt for r in batch], batch[0].cfg)
        except Exception as exc:  # a failed batch fails its requests, not the engine
            for r in batch:
                r.fut.set_exception(exc)
            return True
        now = time.perf_counter()
        for r, c in zip(batch, done):
            c.latency_s = now - r.t0
            self.stats.latencies.add(c.latency_s)
            r.fut.set_result(c)
        return True

    def drain(self) -> None:
        while self.step():
            pass

    def start(self, batch_window_s: float = 0.005) -> None:
        """Serve the queue from a background thread (waits ``batch_window_s`` to gather a batch)."""
        if self._thread is not None:
            return
        self._stop = False

        def loop() -> None:
            while True:
                with self._wake:
                    while not self._queue and not self._stop:
                        self._wake.wait(0.1)
                    if self._stop:
                        return
                time.sleep(batch_window_s)
                self.step()

        self._thread = threading.Thread(target=loop, name="bicache-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
