"""The doctor's report: console (rich), JSON (versioned), and a self-contained HTML page
with the plots inlined as PNG."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from brisk.doctor.checks import Finding
from brisk.fileio import write_output
from brisk.plotting import integer_ticks, legend_below, png_base64, pyplot

SCHEMA_VERSION = 1
_STYLE = {"ok": "green", "warning": "yellow", "problem": "bold red", "unknown": "dim"}
_TITLES = {"network": "Network", "cold_start": "Cold start", "kv_batching": "KV cache / batching",
           "context": "Context length"}


def console_report(url: str, model: str, findings: list[Finding]):
    from rich.table import Table

    table = Table(title=f"brisk doctor — {url} ({model})", show_lines=True, header_style="bold")
    table.add_column("area")
    table.add_column("status")
    table.add_column("what we measured")
    table.add_column("what to do")
    for f in findings:
        notes = f.summary + ("".join(f"\n[dim]not measured: {m}[/]" for m in f.not_measured))
        table.add_row(_TITLES[f.area], f"[{_STYLE[f.status]}]{f.status}[/]", notes,
                      "\n".join(f"• {fix}" for fix in f.fixes) or "–")
    return table


def to_json(url: str, model: str, started: str, duration_s: float, findings: list[Finding],
            measurements: dict[str, Any]) -> dict[str, Any]:
    return {"brisk_doctor_schema": SCHEMA_VERSION, "url": url, "model": model, "started": started,
            "duration_s": duration_s, "overall": _overall(findings),
            "findings": {f.area: f.to_dict() for f in findings}, "measurements": measurements}


def _overall(findings: list[Finding]) -> str:
    from brisk.doctor.checks import worst

    return worst(f.status for f in findings)


def plots(measurements: dict[str, Any]) -> dict[str, str]:
    """Name -> base64 PNG, for what was measured."""
    plt = pyplot()

    out = {}
    sweep = [r for r in (measurements.get("context") or {}).get("sweep", []) if r.get("ttft_s") and r.get("client_tokens")]
    if sweep:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        xs = [r["client_tokens"] for r in sweep]
        ax.plot(xs, [r["ttft_s"] * 1e3 for r in sweep], "o-", label="TTFT (1 output token)")
        slope = measurements["context"].get("prefill_ms_per_1k_tokens")
        if slope is not None:
            b = measurements["context"]["ttft_intercept_s"] * 1e3
            ax.plot(xs, [b + slope * x / 1e3 for x in xs], "--", label=f"fit: {slope:.0f} ms / 1k tokens")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms")
        ax.set_title("TTFT vs prompt length")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        legend_below(fig, [ax])
        out["ttft_vs_prompt"] = png_base64(fig)
    levels = (measurements.get("concurrency") or {}).get("levels", [])
    levels = [r for r in levels if r.get("ttft_p50_s") is not None]
    if levels:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        cs = [r["concurrency"] for r in levels]
        ax.plot(cs, [r["ttft_p50_s"] * 1e3 for r in levels], "o-", label="TTFT p50 (ms)")
        ax.plot(cs, [(r["itl_p50_s"] or 0) * 1e3 for r in levels], "s-", label="ITL p50 (ms)")
        integer_ticks(ax, cs)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        ax2.plot(cs, [r["throughput_tok_s"] for r in levels], "^--", color="C2", label="output tokens/s (right)")
        ax2.set_ylabel("tokens/s")
        ax2.set_ylim(bottom=0)
        ax.set_title("latency and throughput vs concurrency")
        ax.grid(alpha=0.3)
        legend_below(fig, [ax, ax2], ncol=3)
        out["latency_vs_concurrency"] = png_base64(fig)
    phases = _phase_breakdown(measurements)
    if phases:
        fig, ax = plt.subplots(figsize=(6.4, 2.6))
        left = 0.0
        for name, ms in phases.items():
            ax.barh(["one request"], [ms], left=left, label=f"{name} {ms:.0f} ms")
            left += ms
        ax.set_xlabel("ms")
        ax.set_title("where a request's time goes")
        legend_below(fig, [ax])
        out["phase_breakdown"] = png_base64(fig)
    return out


def _phase_breakdown(measurements: dict[str, Any]) -> dict[str, float]:
    """Network (trivial request round trip), then the server's own queue/prefill/decode when it
    reports them (brisk's usage.brisk), else the client's TTFT and the rest of the request."""
    net = measurements.get("network") or {}
    cold = measurements.get("cold_start") or {}
    rows = [r for r in cold.get("first_requests", [])[1:] if r.get("ttft_s")]
    if not rows:
        return {}
    row = rows[-1]
    network_ms = (net.get("trivial_ttfb_s") or 0) * 1e3
    server = row.get("server_timings")
    if server and server.get("ttft_ms") is not None:
        return {"network": network_ms, "queue": server.get("queue_ms") or 0, "prefill": server.get("prefill_ms") or 0,
                "decode": server.get("decode_ms") or 0}
    return {"network": network_ms, "until first token": max(row["ttft_s"] * 1e3 - network_ms, 0),
            "rest of response": max((row["e2e_s"] - row["ttft_s"]) * 1e3, 0)}


def human(key: str, value: Any) -> str:
    """A measured value with its unit and a sensible precision, from the key's naming convention
    (`_s` seconds, `_ms`, `_tok_s`, ratios and shares as %, counts as integers)."""
    if value is None:
        return "none" if key in _NONE_MEANS_NONE else "not measured"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        if {"n", "min", "median", "max"} <= set(value):
            return (f"{human(key, value['median'])} median, {human(key, value['min'])}–{human(key, value['max'])} "
                    f"over {value['n']} samples")
        return "; ".join(f"{_label(k)}: {human(k, v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(human(key, v) for v in value)
    if not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_ms") or key.endswith("_ms_per_1k_tokens"):
        return f"{value:,.0f} ms" if abs(value) >= 10 else f"{value:.2f} ms"
    if key.endswith("_s") and not key.endswith("tok_s"):
        return f"{value * 1e3:,.0f} ms" if abs(value) < 1 else f"{value:,.2f} s"
    if key.endswith("tok_s"):
        return f"{value:,.1f} tokens/s"
    if any(word in key for word in ("usage", "share", "ratio", "efficiency")):
        return f"{value:.1%}"
    if key.endswith("scaling"):
        return f"×{value:.2f}"
    if isinstance(value, float) and value != int(value):
        return f"{value:,.3g}"
    return f"{int(value):,}"


_NONE_MEANS_NONE = {"knee_concurrency"}  # None here is a finding (no knee), not a gap


def _label(key: str) -> str:
    """`steady_ttft_spread_s` -> `steady ttft spread` (the unit goes with the value)."""
    for suffix in ("_tok_s", "_ms", "_s"):
        if key.endswith(suffix):
            key = key[: -len(suffix)]
            break
    return key.replace("_", " ")


def _evidence_table(evidence: dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{html.escape(_label(k))}</th><td>{html.escape(human(k, v))}</td></tr>"
                   for k, v in evidence.items())
    return f"<table>{rows}</table>"


def write_html(path: Path, report: dict[str, Any]) -> None:
    images = plots(report["measurements"])
    cards = []
    for area, f in report["findings"].items():
        fixes = "".join(f"<li>{html.escape(x)}</li>" for x in f["fixes"])
        missing = "".join(f"<li>{html.escape(x)}</li>" for x in f["not_measured"])
        evidence = _evidence_table(f["evidence"])
        cards.append(f"""<section class="card {f['status']}"><h2>{_TITLES[area]} <span>{f['status']}</span></h2>
<p>{html.escape(f['summary'])}</p>{f'<h3>What to do</h3><ul>{fixes}</ul>' if fixes else ''}
{f'<h3>Not measured</h3><ul>{missing}</ul>' if missing else ''}
<details open><summary>evidence</summary>{evidence}</details></section>""")
    skipped = "".join(f"<li>{html.escape(x)}</li>" for x in report.get("skipped", []))
    skipped = f"<h2>Skipped (time budget)</h2><ul>{skipped}</ul>" if skipped else ""
    figures = "".join(f'<figure><img alt="{name}" src="data:image/png;base64,{data}"><figcaption>'
                      f'{name.replace("_", " ")}</figcaption></figure>' for name, data in images.items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>brisk doctor — {html.escape(report['url'])}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}} .card{{border-left:6px solid #888;
padding:.2em 1em;margin:1em 0;background:#fafafa}} .ok{{border-color:#2a2}} .warning{{border-color:#d90}}
.problem{{border-color:#c22}} .unknown{{border-color:#999}} h2 span{{font-size:.7em;text-transform:uppercase}}
figure{{display:inline-block;margin:.5em}} img{{max-width:520px}} pre{{white-space:pre-wrap}}
table{{border-collapse:collapse;font-size:.9em}} th{{text-align:left;font-weight:normal;color:#555;padding-right:1em}}
td,th{{padding:.15em .4em;border-bottom:1px solid #eee;vertical-align:top}}</style></head><body>
<h1>brisk doctor</h1><p>{html.escape(report['url'])} · model <b>{html.escape(report['model'])}</b> ·
{html.escape(report['started'])} · {report['duration_s']:.1f} s · overall <b>{report['overall']}</b></p>
{''.join(cards)}{skipped}<h2>Plots</h2>{figures or '<p>nothing to plot</p>'}</body></html>"""
    write_output(path, page, "--html")
