"""The report of `lnfree analyze`: `index.html` (one page: headline tables, then every figure inline)
and `index.md` (the same tables, with links).

The page loads the one `plotly.min.js` the figures share, so it opens offline, and is laid out for
a laptop screen (figures take the page's width; a wide one scrolls inside its own box). Each
figure is read back from the standalone HTML file `write_figure` made, which stays beside it.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

#: What each analysis is read for, in one line (shown under its heading).
ABOUT = {
    "dla": "Direct logit attribution (DLA) against the direct effect (DE) of each head and MLP on the next "
           "token's logit. NMAE = Σ|DLA − DE| / Σ|DE|: 0 when DLA is exact (every norm on the path to the logits fixed).",
    "patching": "Attribution patching (one backward pass) against activation patching on IOI prompts, each "
                "normalised by the clean − corrupted logit-difference gap; NMAE 0 and Pearson r 1 are perfect agreement.",
    "entropy-neurons": "Final-layer neurons that change the output entropy through the unembedding's null space "
                       "(ranked by ‖w_out‖ / LogitVar), mean-ablated together: the relative change of the entropy.",
    "residual": "The residual stream's L2 norm at position 0 against the rest, and the share of attention heads "
                "that sink onto position 0 (Gu et al. 2024).",
}
CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:1.5em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left}
th{background:#f3f3f3}td.num{font-variant-numeric:tabular-nums}.about{color:#555}
.figure{width:100%;overflow-x:auto;margin:.5em 0 1.5em}.files{font-size:.9em;color:#555}"""


def _ci(value: float, low: float | None, high: float | None) -> str:
    if low is None or high is None:
        return f"{value:.3g}"
    return f"{value:.3g} [{low:.3g}, {high:.3g}]"


def headline_numbers(name: str, summary: dict) -> dict[str, dict[str, str]]:
    """The few numbers per model that an analysis is read for (metric → model → formatted value)."""
    rows: dict[str, dict[str, str]] = {}
    if name == "dla":
        for label, entry in summary["models"].items():
            heads = entry["heads"]
            rows.setdefault("DLA vs DE: global NMAE, heads [95% CI]", {})[label] = _ci(heads["nmae"], heads["ci_low"], heads["ci_high"])
    elif name == "patching":
        for label, entry in summary["models"].items():
            for kind, agreement in entry["agreement"].items():
                for metric, what in (("nmae_per_prompt", "mean per-prompt NMAE"), ("pearson_r", "mean per-prompt Pearson r")):
                    stat = agreement[metric]
                    key = f"attribution vs activation patching ({kind}): {what} [95% CI]"
                    rows.setdefault(key, {})[label] = _ci(stat["value"], stat.get("ci_low"), stat.get("ci_high"))
    elif name == "entropy-neurons":
        last = list(summary["ablations"])[-1]
        neurons = ", ".join(summary["ablations"][last])
        for label, entry in summary["per_model"].items():
            stats = entry["ablations"][last]
            key = f"mean-ablating {last}, neurons (layer.neuron) {neurons}: entropy change % [95% CI]"
            rows.setdefault(key, {})[label] = _ci(stats["relative_entropy_change_percent"],
                                                  stats.get("relative_entropy_change_percent_lo"),
                                                  stats.get("relative_entropy_change_percent_hi"))
            rows.setdefault(f"median |Δ entropy| per token, nats ({last})", {})[label] = f"{stats['median_abs_delta_entropy']:.3g}"
    elif name == "residual":
        for label, entry in summary["models"].items():
            for definition, rate in entry["sink_rate"].items():
                rows.setdefault(f"attention sink rate ({definition}, τ={summary['threshold']})", {})[label] = f"{rate:.3f}"
            rows.setdefault("max residual norm ratio, position 0 / rest", {})[label] = f"{entry['max_norm_ratio_position_0']:.3g}"
    return rows


def _figure_body(path: Path) -> str:
    """The figure's element and script from a standalone plotly HTML file (its plotly.js script tags dropped)."""
    text = path.read_text()
    body = re.search(r"<body>(.*)</body>", text, re.S)
    body = body.group(1) if body else ""
    body = re.sub(r"<script[^>]*src=[^>]*></script>", "", body)
    body = body.replace("height:100%; width:100%;", "width:100%;")  # the figure's own height (or plotly's 450 px)
    return re.sub(r"<script>window\.PlotlyConfig[^<]*</script>", "", body).strip()


def _rel(path: str | Path, out: Path) -> str:
    return Path(path).resolve().relative_to(out.resolve()).as_posix()


def _html_table(labels: list[str], rows: dict[str, dict[str, str]]) -> list[str]:
    head = "<tr><th>metric</th>" + "".join(f"<th>{html.escape(l)}</th>" for l in labels) + "</tr>"
    return ["<table>", head, *("<tr><td>" + html.escape(metric) + "</td>" + "".join(
        f"<td class='num'>{html.escape(values.get(l, ''))}</td>" for l in labels) + "</tr>"
        for metric, values in rows.items()), "</table>"]


def _md_table(labels: list[str], rows: dict[str, dict[str, str]]) -> list[str]:
    return ["| metric | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|",
            *(f"| {metric} | " + " | ".join(values.get(l, "") for l in labels) + " |" for metric, values in rows.items())]


def headline_tables(index: dict) -> str:
    """The headline numbers of every analysis in `index` as markdown tables (what `lnfree analyze` prints)."""
    labels, lines = list(index["models"]), []
    for name, summary in index["analyses"].items():
        headlines = headline_numbers(name, summary)
        if headlines:
            lines += [f"## {name}", "", *_md_table(labels, headlines), ""]
    return "\n".join(lines)


def write_index_pages(index: dict, out: Path) -> None:
    """`index.html` (headline tables first, then every figure inline) and `index.md`, relative to `out`."""
    labels = list(index["models"])
    plotly_js = out / "plotly.min.js"
    md = ["# lnfree analyses", "", "| model | source |", "|---|---|"]
    md += [f"| {label} | `{info['source']}` |" for label, info in index["models"].items()]
    page = ["<!doctype html><html><head><meta charset='utf-8'><title>lnfree analyses</title>",
            f"<style>{CSS}</style>"]
    if plotly_js.is_file():
        page.append(f"<script charset='utf-8' src='{os.path.relpath(plotly_js, out)}'></script>")
    page += ["</head><body><h1>lnfree analyses</h1><h2>Models</h2><ul>"]
    page += [f"<li><b>{html.escape(label)}</b>: {html.escape(info['repr'])}</li>" for label, info in index["models"].items()]
    page += ["</ul>", "<h2>Headline numbers</h2>"]
    for name, summary in index["analyses"].items():
        headlines = headline_numbers(name, summary)
        if headlines:
            page += [f"<h3>{html.escape(name)}</h3>", *_html_table(labels, headlines)]
            md += ["", f"## {name}", "", *_md_table(labels, headlines), ""]
        else:
            md += ["", f"## {name}", ""]
        md += [f"- [{_rel(p, out)}]({_rel(p, out)})" for kind in ("figures", "tables") for p in summary.get(kind, [])]
    for name, reason in index.get("skipped", {}).items():
        md += ["", f"## {name}", "", f"Skipped: {reason}"]
        page.append(f"<h3>{html.escape(name)}</h3><p>Skipped: {html.escape(reason)}</p>")
    for name, summary in index["analyses"].items():
        page += [f"<h2 id='{html.escape(name)}'>{html.escape(name)}</h2>",
                 f"<p class='about'>{html.escape(ABOUT.get(name, ''))}</p>"]
        for path in summary.get("figures", []):
            if Path(path).suffix == ".html":
                page.append(f"<div class='figure'>{_figure_body(Path(path))}</div>")
        files = [_rel(p, out) for kind in ("figures", "tables") for p in summary.get(kind, [])]
        page.append("<p class='files'>Files: " + ", ".join(
            f"<a href='{html.escape(f)}'>{html.escape(f)}</a>" for f in files) + "</p>")
    page.append("</body></html>")
    (out / "index.md").write_text("\n".join(md) + "\n")
    (out / "index.html").write_text("\n".join(page) + "\n")
