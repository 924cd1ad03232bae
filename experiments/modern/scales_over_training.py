"""Position 0's and the most extreme other token's scale at the norm inputs, and the held-out CE, over a
removal run, from the run's own log (every evaluation logs them, `lnfree.removal.losses.massive.massive_scales`).

    python experiments/modern/scales_over_training.py RUN_OR_LOG --out DIR [--title "Gemma 3 270M"]

RUN_OR_LOG is a run folder or a copy of its log.jsonl. Writes scales_over_training.csv, .md and
.html (x: optimiser step; scales as RMS over the median token's, the max over norm inputs; the number
of norms fixed so far) to DIR.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lnfree.removal.layout import LOG


def scales_over_training(log: Path) -> list[dict]:
    """One row per evaluation of the run whose log is `log`: step, CE, the two scales, norms switched before it."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    rows = [{k: r[k] for k in ("step", "held_out_ce", "position0_scale", "outlier_scale")} for r in records
            if r.get("event") in ("start", "eval", "end") and "position0_scale" in r]
    removals = [r["step"] for r in records if r.get("event") == "remove" and "sigma" in r]  # not special σ
    for row in rows:
        row["norms_switched"] = sum(step < row["step"] for step in removals)
    return rows


def figure(rows: list[dict], out: Path, title: str) -> None:
    """scales_over_training.{csv,md,html} in `out`."""
    import pandas as pd
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from lnfree.analysis.common import write_figure

    out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    table.to_csv(out / "scales_over_training.csv", index=False)
    lines = ["| step | norms switched | held-out CE | position 0 / median | most extreme other / median |", "|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['norms_switched']} | {r['held_out_ce']:.4f} | {r['position0_scale']:.1f} | "
              f"{r['outlier_scale']:.1f} |" for r in rows]
    (out / "scales_over_training.md").write_text(f"# {title}: scales over the removal run\n\n" + "\n".join(lines) + "\n")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for key, name in (("position0_scale", "position 0"), ("outlier_scale", "most extreme other token")):
        fig.add_trace(go.Scatter(x=table["step"], y=table[key], name=f"{name} (RMS / median, max over norms)"))
    fig.add_trace(go.Scatter(x=table["step"], y=table["held_out_ce"], name="held-out CE (nats)",
                             line={"dash": "dot"}), secondary_y=True)
    fig.update_yaxes(type="log", title_text="scale at the norm inputs", secondary_y=False)
    fig.update_yaxes(title_text="held-out CE", secondary_y=True)
    fig.update_layout(title=f"{title}: massive activations over the removal run", height=450,
                      xaxis_title="optimiser step")
    write_figure(fig, out, "scales_over_training")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run folder or its log.jsonl")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="removal run")
    args = parser.parse_args()
    log = args.run / LOG if args.run.is_dir() else args.run
    rows = scales_over_training(log)
    if not rows:
        raise SystemExit(f"{log} holds no evaluation with scales")
    figure(rows, args.out, args.title)
    print((args.out / "scales_over_training.md").read_text())


if __name__ == "__main__":
    main()
