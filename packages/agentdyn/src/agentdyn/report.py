"""Markdown tables and PNG plots for bench and characterization results (matplotlib: the [plot] extra)."""

from __future__ import annotations

import os

import hwtopo
from hwtopo import console

__all__ = ["bench_table", "characterize_markdown", "plot_bench", "plot_characterize"]

PARTS = ("llm_wait_s", "queue_s", "tool_cpu_s", "tool_cpu_contention_s", "tool_io_other_s", "other_s")


def _flat(out: dict) -> dict[str, dict]:
    """``{"load/variant": summary}`` from the bench's ``{load: {variant: summary}}`` results."""
    return {f"{load}/{v}": r for load, res in out["results"].items() for v, r in res.items()}


def bench_table(out: dict) -> str:
    """The headline comparison as a markdown table (mean latency per task type per load and variant)."""
    res = _flat(out)
    loads = out.get("loads") or {}
    types = sorted({t for r in res.values() for t in r["per_type"]})
    rows = [
        "| load (offered CPU) | variant | "
        + " | ".join(f"{t} mean s" for t in types)
        + " | all mean s | makespan s | failed |"
    ]
    rows.append("|" + "---|" * (len(types) + 5))
    for key, r in res.items():
        load, v = key.split("/", 1)
        offered = loads.get(load, {}).get("offered_cpu_load")
        label = f"{load} ({offered:.2f})" if offered is not None else load
        cells = [f"{r['per_type'][t]['mean_latency_s']:.2f}" for t in types]
        rows.append(
            f"| {label} | {v} | "
            + " | ".join(cells)
            + f" | {r['mean_latency_s']:.2f} | {r['makespan_s']:.1f} | {r['failed']} |"
        )
    return "\n".join(rows)


def plot_bench(out: dict, path: str) -> str | None:
    """Mean latency per task type and policy as a PNG; None when matplotlib is missing (logged)."""
    plt = console.pyplot("agentdyn")
    if plt is None:
        return None
    res = _flat(out)
    types = sorted({t for r in res.values() for t in r["per_type"]})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(res))
    for i, (v, r) in enumerate(res.items()):
        xs = [j + i * width for j in range(len(types))]
        ax.bar(xs, [r["per_type"][t]["mean_latency_s"] for t in types], width, label=v)
    ax.set_xticks([j + width * (len(res) - 1) / 2 for j in range(len(types))], types)
    ax.set_ylabel("mean request latency (s)")
    ax.set_title("agentdyn bench: mixed workload, emulated LLM")
    ax.legend()
    console.save_figure(fig, path, dpi=110)
    return path


def characterize_markdown(out: dict) -> str:
    lines = [
        "| cores | LLM TTFT s | scenario | conc | task | latency s | LLM s | queue s | tool CPU s | CPU contention s | tool I/O+other s | read MB | write MB | peak RSS MB | CPU PSI |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['cores']} | {r['llm_ttft_s']:g} | {r['scenario']} | {r['concurrency']} | {r['task_type']} | {r['latency_s']:.2f} | "
            f"{r['llm_wait_s']:.2f} | {r['queue_s']:.2f} | {r['tool_cpu_s']:.2f} | {r['tool_cpu_contention_s']:.2f} | {r['tool_io_other_s']:.2f} | "
            f"{r['read_bytes'] / 1e6:.2f} | {r['write_bytes'] / 1e6:.2f} | {r['peak_rss_bytes'] / 2**20:.0f} | {(r['cpu_pressure_mean'] or 0):.2f} |"
        )
    cls = out.get("classes", {})
    prof = ["| task class | CPU s / request | tool wall s (uncontended) | CPU intensity |", "|---|---|---|---|"]
    for t, c in sorted(cls.items()):
        prof.append(f"| {t} | {c['cpu_s']:.2f} | {c['wall_s']:.2f} | {c['cpu_intensity']:.2f} |")
    return "\n".join(prof) + "\n\n" + "\n".join(lines)


def plot_characterize(out: dict, outdir: str) -> list[str]:
    """One stacked-breakdown PNG per (cores, LLM TTFT) setting; x = scenario/task at concurrency."""
    plt = console.pyplot("agentdyn")
    if plt is None:
        return []
    paths = []
    settings = sorted({(r["cores"], r["llm_ttft_s"]) for r in out["rows"]})
    for cores, ttft in settings:
        rows = [r for r in out["rows"] if r["cores"] == cores and r["llm_ttft_s"] == ttft]
        labels = [f"{r['scenario'][:5]}/{r['task_type'][:5]} x{r['concurrency']}" for r in rows]
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows)), 4.5))
        bottom = [0.0] * len(rows)
        for part in PARTS:
            vals = [r[part] for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=part.replace("_s", ""))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
        ax.set_ylabel("seconds per request")
        ax.set_title(f"latency breakdown, {cores} core(s) (emulated), LLM TTFT {ttft:g}s (emulated)", fontsize=9)
        ax.legend(fontsize=7)
        p = os.path.join(outdir, f"breakdown-{cores}core-ttft{ttft:g}.png")
        console.save_figure(fig, p, dpi=110)
        paths.append(p)
    return paths


def write_report(path: str, title: str, body: str, plots: list[str]) -> None:
    """``report.md``: the title, the body, then each plot that was written."""
    lines = [f"# {title}", "", body, ""]
    lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    hwtopo.atomic_write_text(path, "\n".join(lines) + "\n")
