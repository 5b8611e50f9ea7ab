"""`brisk kv-plan` tables and plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from brisk.kvplan.fit import LengthFit
from brisk.kvplan.simulate import SimResult
from brisk.trace import TraceRequest
from brisk.fileio import output_dir
from brisk.plotting import legend_below, pyplot, save_png


def fit_table(fits: dict[str, LengthFit]):
    from rich.table import Table

    table = Table(title="request lengths: truncated lognormal fit vs empirical", header_style="bold")
    for col in ("", "mu", "sigma", "range", "mean fit/emp", "p50 fit/emp", "p90 fit/emp", "p99 fit/emp",
                "KS D (p)"):
        table.add_column(col, justify="right")
    for name, f in fits.items():
        e = f.empirical
        table.add_row(name, f"{f.mu:.3f}", f"{f.sigma:.3f}", f"{f.low:.0f}–{f.high:.0f}",
                      f"{f.mean():.0f}/{e['mean']:.0f}", f"{f.quantile(0.5):.0f}/{e['p50']:.0f}",
                      f"{f.quantile(0.9):.0f}/{e['p90']:.0f}", f"{f.quantile(0.99):.0f}/{e['p99']:.0f}",
                      f"{f.ks_statistic:.3f} ({f.ks_pvalue:.2g})")
    return table


def strategy_table(results: list[SimResult]):
    from rich.table import Table

    table = Table(title="KV allocation strategies over the trace (means over all steps, % of budget)",
                  header_style="bold")
    for col in ("strategy", "peak mem", "mean mem", "mean used", "internal frag", "reservation", "external frag",
                "seqs mean/peak", "delay p50/p99 s", "preempt", "rejected"):
        table.add_column(col, justify="right")
    for r in results:
        d = r.to_dict()
        w = d["waste"]
        cap = r.capacity_tokens
        table.add_row(r.strategy, f"{r.peak_allocated / cap:.0%}", f"{r.mean_allocated / cap:.0%}",
                      f"{r.mean_used / cap:.0%}", f"{w['internal_fragmentation']:.1%}", f"{w['reservation']:.1%}",
                      f"{w['external_fragmentation']:.1%}", f"{r.mean_running:.1f}/{r.peak_running}",
                      f"{d['admission_delay_s']['p50']:.2f}/{d['admission_delay_s']['p99']:.2f}",
                      str(r.num_preemptions), str(r.num_rejected))
    return table


def write_plots(directory: Path, trace: list[TraceRequest], fits: dict[str, LengthFit],
                results: list[SimResult]) -> list[Path]:
    plt = pyplot()

    directory = output_dir(directory, "--plot")
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, (name, fit), attr in zip(axes, fits.items(), ("prompt_tokens", "output_tokens")):
        values = np.array([getattr(r, attr) for r in trace], dtype=float)
        ax.hist(values, bins=min(60, max(10, len(values) // 20)), density=True, alpha=0.5, label="trace")
        xs = np.linspace(fit.low, fit.high, 400)
        ax.plot(xs, fit.pdf(xs), "C3", label=f"truncated lognormal μ={fit.mu:.2f} σ={fit.sigma:.2f}")
        ax.set_title(f"{name} (KS D={fit.ks_statistic:.3f})")
        ax.set_xlabel("tokens")
        ax.set_ylabel("density")
        ax.legend(fontsize=8, loc="upper right")
    written.append(save_png(fig, directory / "length_fit.png"))

    fig, ax = plt.subplots(figsize=(12, 5.2))
    brisk_runs = [r for r in results if r.serve_flags] or results
    horizon = 1.1 * max(r.timeline["t"][-1] for r in brisk_runs if r.timeline["t"])  # where brisk's runs end
    for r in results:
        t = np.asarray(r.timeline["t"])
        label = r.strategy
        if len(t) and t[-1] > horizon:
            label += f" (runs on to {t[-1]:,.0f} s)"
        ax.plot(t, np.array(r.timeline["allocated"]) / r.capacity_tokens, label=label, lw=1,
                ls="-" if r.serve_flags else "--")
    ax.set_xlim(0, horizon)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("KV memory held / budget")
    ax.set_xlabel("seconds since the first request")
    ax.set_title("KV memory held over the trace (to the end of brisk's runs)")
    ax.grid(alpha=0.3)
    legend_below(fig, [ax], ncol=3)
    written.append(save_png(fig, directory / "memory_over_time.png"))

    fig, ax = plt.subplots(figsize=(12, 4.5))
    labels = [r.strategy for r in results]
    parts = {"used": [r.mean_used for r in results], "internal": [r.mean_internal for r in results],
             "reservation": [r.mean_reserved_unused for r in results],
             "external": [r.mean_external for r in results]}
    bottom = np.zeros(len(results))
    for name, values in parts.items():
        v = np.array(values) / results[0].capacity_tokens
        ax.barh(labels, v, left=bottom, label=name)
        bottom += v
    ax.set_xlabel("share of the memory budget (mean over all steps)")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()  # the first strategy on top, as in the table
    ax.set_title("where the memory goes")
    legend_below(fig, [ax])
    written.append(save_png(fig, directory / "waste_breakdown.png"))
    return written
