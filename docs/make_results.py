"""Write docs/results.md from bench-output/bench.json (run by `nox -s bench`).

Every headline figure is shown next to the paper's claim and the target its issue sets, with the
machine it was measured on and any emulation the bench reported.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path

# package -> headline key -> (paper's claim, target set by the package's issue)
CLAIMS: dict[str, dict[str, tuple[str, str]]] = {
    "xronos": {
        "idle_ratio_xronos": ("idle ~5.9x lower than TP", "<= 0.05"),
        "idle_ratio_tp": ("even TP idles fast workers up to 34%", ">= 0.2"),
        "step_time_ratio_vs_tp": ("-18% fine-tuning time vs TP", "<= 0.85"),
        "step_time_ratio_vs_pp": ("-56% vs PP", "<= 0.6"),
        "loss_rel_diff_vs_reference": ("same accuracy", "<= 1e-4"),
    },
    "geomesh": {
        "bytes_ratio_vs_fp32": ("~32x less traffic", "<= 1/30"),
        "ttt_ratio_vs_diloco": ("up to 70.2% faster to target perplexity", "<= 0.7"),
        "ttt_ratio_vs_ddp": ("", "<= 0.5"),
        "straggler_idle_geomesh": ("straggler idle 8.0x lower", "<= 0.05"),
        "straggler_idle_diloco": ("sync methods wait up to 20.9%", ">= 0.15"),
        "ppl_rel_diff_vs_diloco": ("no accuracy loss", "<= 0.03"),
    },
    "cona": {
        "ttp_ratio_vs_best_static": ("1.4-9.6x faster to target perplexity", "<= 0.7"),
        "gap_to_oracle": ("within 2.6% of the oracle", "<= 0.05"),
        "switches": ("several switches per run", ">= 1"),
        "switch_overhead_frac": ("", "<= 0.05"),
        "gns_overhead_frac": ("", "<= 0.05"),
    },
    "bicache": {
        "acc_nocache": ("", ">= 0.9"),
        "acc_naive_prefix": ("AR prefix caching: accuracy ~0", "<= 0.5 x acc_nocache"),
        "acc_drop_bicache": ("0-1.8% accuracy difference", "<= 0.02"),
        "throughput_ratio_vs_nocache": ("+36.3% to +98.3% throughput", ">= 1.36"),
        "throughput_ratio_vs_block_cache": ("", ">= 1.2"),
    },
    "kvpool": {
        "ttft_ratio_vs_serial": ("TTFT ~4.1x lower", "<= 0.5"),
        "ttft_ratio_vs_recompute": ("", "<= 0.3"),
        "retrieval_bw_ratio_vs_serial": ("", ">= 2.0"),
        "page_cache_bytes_passthrough": ("filesystem bypass", "<= 1% of bytes read"),
        "blocked_io_ratio_vs_serial": ("blocked I/O up to 23.2x lower", "<= 0.25"),
        "fs_time_frac_serial": ("84% of SSD time in the filesystem", "reported"),
    },
    "parser-moe": {
        "gap_ratio_vs_magnitude": ("gap narrowed 1.41x (Qwen), 1.44x (DeepSeek)", ">= 1.3"),
        "gap_ratio_vs_wanda": ("", ">= 1.1"),
        "memory_reduction": ("same peak memory across methods", ">= 0.4"),
        "ppl_full": ("", "reported"),
        "ppl_parser": ("", "reported"),
    },
    "sysprdict": {
        "time_mape": ("9.8% MAPE across precisions", "<= 0.10"),
        "time_mape_precision_blind": ("precision-unaware: 147.85% MAPE", ">= 3 x time_mape"),
        "mem_mape": ("~8.7% MAPE (multimodal)", "<= 0.09"),
        "mem_mape_accelerate_style": ("", "reported"),
        "oom_guard_violations": ("", "0"),
        "tps_smape": ("1.9% SMAPE (throughput)", "<= 0.02"),
        "success_smape": ("5.6% SMAPE (success rate)", "<= 0.06"),
        "data_source": ("", "caliper or simulated"),
    },
    "agentdyn": {
        "cpu_task_latency_ratio": ("~5.4x lower CPU-sensitive latency", ">= 3.0"),
        "mixed_avg_latency_reduction": ("~32% lower average latency", ">= 0.30"),
        "static_limit_avg_latency_reduction": ("", "reported"),
        "requests_failed": ("", "0"),
        "zombie_processes": ("", "0"),
    },
}


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _emulation(res: dict) -> str:
    emu = res.get("emulated")
    if not emu:
        return "none"
    if isinstance(emu, dict):
        return "; ".join(f"{k}={_fmt(v)}" for k, v in emu.items() if k != "emulated") or "yes"
    return str(emu)


def package_table(name: str, res: dict) -> list[str]:
    """One package's headline table with the machine, emulation and time it was measured."""
    machine = res.get("machine", {})
    m = (machine.get("machines") or [{}])[0] if isinstance(machine, dict) else {}
    lines = []
    when = res.get("measured_at")
    took = res.get("bench_wall_s")
    if when:
        lines += [f"Measured {when}" + (f" (`bench --quick`, {took:.0f} s)." if took else "."), ""]
    if m:
        lines += [f"Machine: {m.get('name', '?')}, {m.get('threads', '?')} threads. Emulation: {_emulation(res)}.", ""]
    lines += ["| headline | measured | target | paper |", "|---|---|---|---|"]
    claims = CLAIMS.get(name, {})
    for key, value in res.get("headline", {}).items():
        paper, target = claims.get(key, ("", ""))
        lines.append(f"| `{key}` | {_fmt(value)} | {target} | {paper} |")
    return lines


def previous_sections(text: str) -> dict[str, str]:
    """The per-package sections (``## name version`` up to the next heading) of an earlier results page."""
    sections, name = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            name = line[3:].split()[0] if line[3:].split() else None
            if name is not None and name not in CLAIMS:
                name = None
            if name is not None:
                sections[name] = []
        if name is not None:
            sections[name].append(line)
    return {k: "\n".join(v).rstrip("\n") for k, v in sections.items()}


def render(bench: dict, when: str, previous: str = "") -> str:
    """The results page. A package this run did not measure keeps its section of ``previous`` (the page as
    it was: its own "Measured" line dates it), since bench-output/ is not kept between clones."""
    kept = previous_sections(previous)
    lines = [
        "# Results",
        "",
        f"Generated by `nox -s bench` (each package's `bench --quick`); written {when}. Figures are",
        "measured in one run per package, side by side with its baselines; emulated hardware is listed",
        "per package. The papers' claims are theirs, on their hardware.",
        "",
    ]
    for name in sorted(set(bench) | (set(kept) - set(bench))):
        if name in bench:
            lines += [f"## {name} {bench[name].get('version', '')}", "", *package_table(name, bench[name]), ""]
        else:
            lines += [kept[name], ""]
    missing = [p for p in CLAIMS if p not in bench and p not in kept]
    if missing:
        lines += ["## Not measured in this run", "", ", ".join(missing), ""]
    return "\n".join(lines)


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def update_guides(bench: dict, guides: Path) -> list[Path]:
    """Refresh the bench table between the markers of each docs/packages/<name>.md page."""
    done = []
    for name, res in bench.items():
        page = guides / f"{name}.md"
        if not page.exists():
            continue
        text = page.read_text()
        if BEGIN not in text or END not in text:
            continue
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        table = "\n".join(["", "_Written by `nox -s bench`; do not edit by hand._", "", *package_table(name, res), ""])
        tmp = page.with_suffix(".md.tmp")
        tmp.write_text(head + BEGIN + "\n" + table + "\n" + END + tail)
        os.replace(tmp, page)
        done.append(page)
    return done


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else Path("bench-output/bench.json")
    dst = Path(argv[2]) if len(argv) > 2 else Path(__file__).parent / "results.md"
    bench = json.loads(src.read_text())
    text = render(bench, dt.datetime.now().strftime("%Y-%m-%d %H:%M"), dst.read_text() if dst.exists() else "")
    tmp = dst.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, dst)
    print(f"wrote {dst}")
    for page in update_guides(bench, Path(__file__).parent / "packages"):
        print(f"updated {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
