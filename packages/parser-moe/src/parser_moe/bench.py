"""Side-by-side comparison at equal expert memory, across independently trained models.

For each model (by default the shipped tiny MoEs, one per training seed): calibrate on the calib
split, decompose once, then at each keep ratio every variant with several candidate settings is
measured on the development split and keeps its best setting; every variant is then measured on the
held-out test split, whose files belong to no other split. The headline is PARSER's reference
configuration (:data:`parser_moe.scoring.REFERENCE`); the headline figures are medians over models of
per-model gap ratios, reported with their spread. Downstream-task accuracy is measured at keep 0.2.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch

from hwtopo import console

from .calibrate import calibrate
from .compressed import compressed_modules
from .data import split_files
from .evaluate import lm_scores
from .pipeline import base_only_model, compress_model, entry_ratio_for, prepare
from .scoring import VARIANTS
from .tasks import build_tasks, byte_encoder, run_tasks
from .verify import reference_matches_formula

log = logging.getLogger(__name__)

RATIOS = (0.1, 0.2)
TASK_RATIO = 0.2
# variants of PARSER's output view; the best on the development split is the "best named variant"
PARSER_FAMILY = ("reference", "parser", "output_wanda")
TASKED = (*PARSER_FAMILY, "wanda")
UNSTRUCTURED = ("reference", "magnitude")
SPLITS = ("calib", "dev", "test")
SIZES = {  # sequences of 128 tokens per split, and items per multiple-choice task
    True: {"calib": 48, "dev": 48, "test": 64, "items": 64},
    False: {"calib": 192, "dev": 128, "test": 256, "items": 160},
}


def load_model(model_path: str | Path | None, progress: bool = True, seed: int = 0):
    """A local MoE checkpoint directory (with its tokenizer when it has one), or the shipped tiny MoE
    trained with ``seed``. Returns (model, info); ``info["tokenizer"]`` is None for byte-level models."""
    if model_path is None:
        from .zoo import load_seed

        model, info = load_seed(seed)
        info["tokenizer"] = None
        return model, info
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


def split_ids(info: dict, vocab: int, split: str, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """``n`` random windows of ``split``; bytes folded into the vocabulary when there is no tokenizer."""
    from .data import sequences

    tok = info.get("tokenizer")
    ids = sequences(split, n, seq_len, seed=seed, tokenizer=tok)
    return ids % vocab if tok is None and vocab < 256 else ids


def text_ids(info: dict, vocab: int, n_cal: int, n_eval: int, seq_len: int, seed: int):
    """Calibration windows and held-out (test split) windows."""
    return (
        split_ids(info, vocab, "calib", n_cal, seq_len, seed),
        split_ids(info, vocab, "test", n_eval, seq_len, seed + 1000),
    )


def _encoder(info: dict, vocab: int):
    tok = info.get("tokenizer")
    if tok is None:
        return byte_encoder(vocab)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def _nbytes(model) -> int:
    return sum(m.nbytes() for m in compressed_modules(model).values())


class _Run:
    """One model's measurements: the full model, then every variant at every ratio."""

    def __init__(self, model, plan, ids: dict, tasks: dict, encode, progress: bool):
        self.model, self.plan, self.ids, self.tasks, self.encode = model, plan, ids, tasks, encode
        self.progress = progress
        self.original = plan.original_bytes()
        self.full = {s: lm_scores(model, ids[s]) for s in ("dev", "test")}
        self.out: dict = {}

    def gap(self, cm, split: str) -> tuple[float, float]:
        ppl, acc = lm_scores(cm, self.ids[split])
        return ppl - self.full[split][0], acc

    def record(self, name: str, cm, extra: dict, with_tasks: bool = False) -> None:
        ppl_gap, acc = self.gap(cm, "test")
        nb = _nbytes(cm)
        row = {
            **extra,
            "ppl": self.full["test"][0] + ppl_gap,
            "gap": ppl_gap,
            "next_token_acc": acc,
            "expert_bytes": nb,
            "memory_reduction": 1 - nb / self.original,
        }
        if with_tasks:
            row["tasks"] = run_tasks(cm, self.tasks, self.encode, acc)
        self.out[name] = row

    def variant(self, name: str, ratio: float) -> None:
        """Choose ``name``'s setting on the dev split (when it has several), measure it on test."""
        cands = VARIANTS[name]
        dev: dict = {}
        if len(cands) > 1 or name in PARSER_FAMILY:
            for c in cands:
                dev[c.label()] = self.gap(compress_model(self.model, self.plan, c, ratio), "dev")[0]
        best = min(cands, key=lambda c: dev[c.label()]) if dev else cands[0]
        cm = compress_model(self.model, self.plan, best, ratio)
        extra = {"method": name, "keep_ratio": ratio, "setting": best.label(), "dev_gaps": dev}
        self.record(f"{name}@{ratio}", cm, extra, with_tasks=ratio == TASK_RATIO and name in TASKED)

    def unstructured(self, name: str, ratio: float) -> None:
        keep = entry_ratio_for(ratio, self.plan.layers[0].hidden, 4)
        cm = compress_model(self.model, self.plan, name, keep, structured=False)
        extra = {"method": name, "keep_ratio": ratio, "setting": VARIANTS[name][0].label() + "/entries"}
        self.record(f"{name}_unstructured@{ratio}", cm, extra)

    def run(self, ratios, unstructured: bool) -> dict:
        ppl, acc = self.full["test"]
        self.out["uncompressed"] = {
            "ppl": ppl,
            "gap": 0.0,
            "next_token_acc": acc,
            "expert_bytes": self.original,
            "memory_reduction": 0.0,
            "tasks": run_tasks(self.model, self.tasks, self.encode, acc),
        }
        self.record("base_only", base_only_model(self.model, self.plan), {"keep_ratio": 0.0})
        jobs = [(self.variant, n, r) for r in ratios for n in VARIANTS]
        if unstructured:
            jobs += [(self.unstructured, n, r) for r in ratios for n in UNSTRUCTURED]
        for fn, name, ratio in console.progress(jobs, desc="compress+eval", quiet=not self.progress):
            fn(name, ratio)
        return self.out


def _one_model(model, info, sizes: dict, ratios, base: str, seq_len: int, seed: int, quick: bool, progress: bool):
    vocab = model.config.vocab_size
    ids = {s: split_ids(info, vocab, s, sizes[s], seq_len, seed + k * 1000) for k, s in enumerate(SPLITS)}
    calib = calibrate(model, ids["calib"].split(8), seed=seed, require_all_experts=False)
    plan = prepare(model, calib, base)
    tasks = build_tasks("test", sizes["items"], seed)
    run = _Run(model, plan, ids, tasks, _encoder(info, vocab), progress)
    results = run.run(ratios, unstructured=not quick)
    routing = {
        name: {"min_share": min(lc.routed) / max(sum(lc.routed), 1), "unrouted_experts": lc.routed.count(0)}
        for name, lc in calib.layers.items()
    }
    about = {
        "seed": info.get("seed"),
        "path": info.get("path"),
        "final_train_loss": info.get("final_loss"),
        "formula_check": reference_matches_formula(model, plan),
        "calibration_routing": routing,
        "tokens": {s: int(t.numel()) for s, t in ids.items()},
        "task_items": {k: len(v) for k, v in tasks.items()},
    }
    return results, about, plan


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _aggregate(runs: list[dict]) -> dict:
    """Per variant: medians over models of ppl and gap, and each model's row."""
    out = {}
    for name in runs[0]:
        rows = [r[name] for r in runs]
        agg = {k: v for k, v in rows[0].items() if k not in ("ppl", "gap", "next_token_acc", "tasks", "dev_gaps")}
        agg.pop("setting", None)
        for k in ("ppl", "gap", "next_token_acc"):
            agg[k] = _median([row[k] for row in rows])
        if "tasks" in rows[0]:
            agg["tasks"] = {t: _median([row["tasks"][t] for row in rows]) for t in rows[0]["tasks"]}
        agg["per_model"] = rows
        out[name] = agg
    return out


def _ratio(run: dict, other: str, variant: str, r: float) -> float | None:
    """other gap / variant gap on one model; None when the variant has no gap to divide by."""
    g = run[f"{variant}@{r}"]["gap"]
    return run[f"{other}@{r}"]["gap"] / g if g > 0 else None


def _best_variant(runs: list[dict], ratios) -> str:
    """The PARSER-family variant with the lowest dev gap relative to the reference (median over
    models of the mean over ratios): chosen on the development split only."""

    def rel(name: str) -> float:
        per = []
        for run in runs:
            vals = []
            for r in ratios:
                row, ref = run[f"{name}@{r}"], run[f"reference@{r}"]
                ref_dev = min(ref["dev_gaps"].values())
                vals.append(min(row["dev_gaps"].values()) / ref_dev if ref_dev > 0 else 1.0)
            per.append(sum(vals) / len(vals))
        return statistics.median(per)

    return min(PARSER_FAMILY, key=rel)


def _headline(runs: list[dict], about: list[dict], ratios) -> tuple[dict, dict]:
    """Headline keys (medians over models) and their per-model values with min and max."""
    best = _best_variant(runs, ratios)
    per: dict = {}
    for r in ratios:
        per[f"gap_ratio_vs_magnitude_reference@{r}"] = [_ratio(x, "magnitude", "reference", r) for x in runs]
        per[f"gap_ratio_vs_wanda_reference@{r}"] = [_ratio(x, "wanda", "reference", r) for x in runs]
        per[f"gap_ratio_vs_wanda_best@{r}"] = [_ratio(x, "wanda", best, r) for x in runs]
        per[f"gap_ratio_vs_wanda_routed_best@{r}"] = [_ratio(x, "wanda_routed", best, r) for x in runs]
    if TASK_RATIO in ratios:
        for tag, name in (("reference", "reference"), ("wanda", "wanda"), ("best", best)):
            per[f"task_acc_drop_{tag}@{TASK_RATIO}"] = [
                x["uncompressed"]["tasks"]["mean"] - x[f"{name}@{TASK_RATIO}"]["tasks"]["mean"] for x in runs
            ]
    head: dict = {k: _median(v) for k, v in per.items()}
    best_vs_wanda = [head[f"gap_ratio_vs_wanda_best@{r}"] for r in ratios]
    head["gap_ratio_vs_wanda"] = min(best_vs_wanda) if None not in best_vs_wanda else None
    head["best_variant"] = best
    for r in ratios:
        ratios_r = per[f"gap_ratio_vs_wanda_reference@{r}"]
        losses = sum(1 for v in ratios_r if v is not None and v < 1)
        head[f"reference_beats_wanda@{r}"] = (head[f"gap_ratio_vs_wanda_reference@{r}"] or 0) > 1
        head[f"reference_loses_to_wanda_on_models@{r}"] = f"{losses} of {len(runs)}"
        head[f"memory_reduction@{r}"] = runs[0][f"reference@{r}"]["memory_reduction"]
    head["memory_equal_across_methods"] = all(
        len({x[f"{n}@{r}"]["expert_bytes"] for n in VARIANTS}) == 1 for x in runs for r in ratios
    )
    head["reference_matches_formula"] = all(a["formula_check"]["matches"] for a in about)
    head["formula_max_rel_error"] = max(a["formula_check"]["max_rel_error"] for a in about)
    head["ppl_full"] = _median([x["uncompressed"]["ppl"] for x in runs])
    head["models"] = len(runs)
    spread = {}
    for k, v in per.items():
        vals = [x for x in v if x is not None]
        spread[k] = {"per_model": v, "min": min(vals, default=None), "max": max(vals, default=None)}
    return head, spread


def _models(model_path, seeds, progress: bool):
    """(model, info) for each model the bench compares: one local checkpoint, or the shipped seeds."""
    if model_path is not None:
        yield load_model(model_path, progress)
        return
    from .zoo import available_seeds

    have = available_seeds()
    for s in seeds if seeds is not None else have:
        yield load_model(None, progress, seed=s)


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
    seeds: tuple[int, ...] | None = None,
) -> dict:
    """Every variant at every keep ratio on every model; returns config, results, headline, spread."""
    t0 = time.perf_counter()
    ratios = tuple(sorted(ratios))
    sizes = dict(SIZES[quick])
    sizes["calib"] = calib_seqs or sizes["calib"]
    sizes["test"] = eval_seqs or sizes["test"]
    runs, about, plan, model = [], [], None, None
    for model, info in _models(model_path, seeds, progress):
        res, info_out, plan = _one_model(model, info, sizes, ratios, base, seq_len, seed, quick, progress)
        runs.append(res)
        about.append(info_out)
    if not runs:
        raise FileNotFoundError("no model to compare: no shipped checkpoints found; run `parser-moe train`")
    head, spread = _headline(runs, about, ratios)
    assert plan is not None and model is not None  # set by the loop, which ran at least once
    layers = plan.layers
    config = {
        "quick": quick,
        "models": about,
        "tokens": "bytes" if model_path is None else "model's tokenizer or bytes",
        "moe_layers": len(layers),
        "experts": layers[0].num_experts,
        "top_k": getattr(model.config, "num_experts_per_tok", None),
        "hidden": layers[0].hidden,
        "expert_intermediate": layers[0].intermediate,
        "base": base,
        "ratios": list(ratios),
        "seq_len": seq_len,
        "sequences": sizes,
        "calib_tokens": sizes["calib"] * seq_len,
        "eval_tokens": sizes["test"] * seq_len,
        "splits": {s: [f.name for f in split_files(s)] for s in SPLITS},
        "split_rule": "stdlib *.py sorted; i % 20 == 0 dev, == 10 test, i % 10 == 5 calib, rest train",
        "selection": "settings of multi-candidate variants and the best named variant chosen on dev; "
        "every reported ppl, gap and accuracy is on test",
        "variants": {n: [c.as_dict() for c in cands] for n, cands in VARIANTS.items()},
        "seed": seed,
        "seconds_total": time.perf_counter() - t0,
        "torch_threads": torch.get_num_threads(),
    }
    return {"config": config, "results": _aggregate(runs), "headline": head, "spread": spread}
