"""Side-by-side comparison: PARSER against the baselines at equal expert memory, on held-out text."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from hwtopo import console

from .calibrate import calibrate
from .compressed import compressed_modules
from .data import sequences
from .evaluate import perplexity
from .pipeline import METHODS, base_only_model, compress_model, entry_ratio_for, prepare

log = logging.getLogger(__name__)

RATIOS = (0.1, 0.2, 0.3)
HEADLINE_RATIO = 0.2
UNSTRUCTURED = ("parser", "magnitude")


def load_model(model_path: str | Path | None, progress: bool = True):
    """A local MoE checkpoint directory (with its tokenizer when it has one), or the cached tiny MoE.

    Returns (model, info); ``info["tokenizer"]`` is None for byte-level models.
    """
    if model_path is not None:
        from transformers import AutoModelForCausalLM

        p = Path(model_path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"--model {p}: no config.json there; pass a transformers checkpoint directory")
        model = AutoModelForCausalLM.from_pretrained(str(p))
        model.eval()
        info = {"path": str(p), "cached": True, "tokenizer": None}
        if any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            from transformers import AutoTokenizer

            info["tokenizer"] = AutoTokenizer.from_pretrained(str(p))
        return model, info
    from .tinymoe import load_or_train

    return load_or_train(progress=progress)


def text_ids(info: dict, vocab: int, n_cal: int, n_eval: int, seq_len: int, seed: int):
    """Calibration and held-out token ids; bytes folded into the vocabulary when there is no tokenizer."""
    tok = info.get("tokenizer")
    cal = sequences("calib", n_cal, seq_len, seed=seed, tokenizer=tok)
    ev = sequences("eval", n_eval, seq_len, seed=seed + 1000, tokenizer=tok)
    if tok is None and vocab < 256:
        cal, ev = cal % vocab, ev % vocab
    return cal, ev


def _compare(model, plan, eval_ids, ppl_full: float, ratios, progress: bool) -> dict:
    """Every method at every keep ratio (structured units and unstructured entries) on ``eval_ids``."""
    original = plan.original_bytes()
    results: dict = {
        "uncompressed": {"ppl": ppl_full, "gap": 0.0, "expert_bytes": original, "memory_reduction": 0.0},
    }
    base_only = base_only_model(model, plan)
    nb = sum(m.nbytes() for m in compressed_modules(base_only).values())
    results["base_only"] = {
        "ppl": perplexity(base_only, eval_ids),
        "expert_bytes": nb,
        "memory_reduction": 1 - nb / original,
        "keep_ratio": 0.0,
    }
    results["base_only"]["gap"] = results["base_only"]["ppl"] - ppl_full
    del base_only
    jobs = [(m, r, True) for r in ratios for m in (*METHODS, "parser_plain")]
    jobs += [(m, r, False) for r in ratios for m in UNSTRUCTURED]
    for method, ratio, structured in console.progress(jobs, desc="compress+eval", quiet=not progress):
        keep = ratio if structured else entry_ratio_for(ratio, plan.layers[0].hidden, 4)
        cm = compress_model(model, plan, method, keep, structured=structured)
        nbytes = sum(m.nbytes() for m in compressed_modules(cm).values())
        ppl = perplexity(cm, eval_ids)
        name = f"{method}{'' if structured else '_unstructured'}@{ratio}"
        results[name] = {
            "method": method,
            "structured": structured,
            "keep_ratio": ratio,
            "ppl": ppl,
            "gap": ppl - ppl_full,
            "expert_bytes": nbytes,
            "memory_reduction": 1 - nbytes / original,
        }
        del cm
    return results


def _headline(results: dict, ratios) -> dict:
    """The headline keys at keep ratio 0.2 (or the middle ratio given)."""
    h = HEADLINE_RATIO if HEADLINE_RATIO in ratios else ratios[len(ratios) // 2]
    par = results[f"parser@{h}"]

    def gap_ratio(method: str) -> float | None:
        """other gap / PARSER gap; None (JSON null) when PARSER has no gap left to divide by."""
        other = results[f"{method}@{h}"]
        return other["gap"] / par["gap"] if par["gap"] > 0 else None

    mem = {results[f"{m}@{h}"]["expert_bytes"] for m in METHODS}
    return {
        "gap_ratio_vs_magnitude": gap_ratio("magnitude"),
        "gap_ratio_vs_wanda": gap_ratio("wanda"),
        "gap_ratio_vs_reconstruction": gap_ratio("reconstruction"),
        "memory_reduction": par["memory_reduction"],
        "memory_equal_across_methods": len(mem) == 1,
        "ppl_full": results["uncompressed"]["ppl"],
        "ppl_parser": par["ppl"],
        "ppl_magnitude": results[f"magnitude@{h}"]["ppl"],
        "ppl_wanda": results[f"wanda@{h}"]["ppl"],
        "keep_ratio": h,
    }


def run_bench(
    quick: bool = True,
    model_path: str | Path | None = None,
    ratios: tuple[float, ...] = RATIOS,
    base: str = "aligned",
    seq_len: int = 128,
    calib_seqs: int | None = None,
    eval_seqs: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Compress with every method and ratio, measure perplexity and expert bytes side by side."""
    t0 = time.perf_counter()
    model, info = load_model(model_path, progress)
    t_model = time.perf_counter() - t0
    vocab = model.config.vocab_size
    n_cal = calib_seqs or (48 if quick else 192)
    n_eval = eval_seqs or (48 if quick else 256)
    cal_ids, eval_ids = text_ids(info, vocab, n_cal, n_eval, seq_len, seed)
    t1 = time.perf_counter()
    calib = calibrate(model, cal_ids.split(8), seed=seed)
    plan = prepare(model, calib, base)
    t_prep = time.perf_counter() - t1
    results = _compare(model, plan, eval_ids, perplexity(model, eval_ids), ratios, progress)
    layers = plan.layers
    config = {
        "quick": quick,
        "model": info.get("path"),
        "model_cached": info.get("cached"),
        "tokens": "bytes" if info.get("tokenizer") is None else "tokenizer",
        "moe_layers": len(layers),
        "experts": layers[0].num_experts,
        "top_k": getattr(model.config, "num_experts_per_tok", None),
        "hidden": layers[0].hidden,
        "expert_intermediate": layers[0].intermediate,
        "base": base,
        "ratios": list(ratios),
        "seq_len": seq_len,
        "calib_tokens": int(cal_ids.numel()),
        "eval_tokens": int(eval_ids.numel()),
        "calib_text": "stdlib sources, calib split (files i % 10 == 5)",
        "eval_text": "stdlib sources, eval split (files i % 10 == 0), held out",
        "seed": seed,
        "seconds": {"model": t_model, "calibrate_and_decompose": t_prep, "total": time.perf_counter() - t0},
        "torch_threads": torch.get_num_threads(),
    }
    return {"config": config, "results": results, "headline": _headline(results, ratios)}
