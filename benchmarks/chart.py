"""The chart of a benchmarks/run.py report: the share of the ceiling each op reaches, beside its anchors.

    python3 benchmarks/chart.py benchmarks/results/h200.json [-o FILE.png] [--all] [--title TEXT]

One panel per family that has a ceiling (the copy ceiling for GB/s tables, the GEMM ceiling for
prefill's TFLOP/s), one group of bars per op and case: qkernels and the fastest anchor timed in
that case (--all: every timed row, our variants included), each bar labelled with its impl and
its % of the ceiling measured in the same run.  Host overhead has no ceiling and is left out.

Needs matplotlib, which the GPU machine lacks: copy the JSON run.py wrote there to a machine that
has it (the CPU dev machine) and run this there.  Writes FILE.png (default: the JSON's name, .png).
"""

import argparse
import json
import os
import sys

COLORS = {"qkernels": "#1f77b4", "qkernels variant": "#9ecae1", "anchor": "#bdbdbd"}
BAR_H = 0.8
INCH_PER_BAR = 0.12  # a full H200 report (~50 cases, two bars each) stays under 20 inches


def load(path):
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    if "rows" not in report:
        sys.exit(f"benchmarks/chart.py: {path} has no 'rows': not a benchmarks/run.py report")
    return report


def case_groups(rows, show_all):
    """{family: [(label, [row, ...]), ...]} in report order: the rows a case's bars show, ours first."""
    families = {}
    cases = {}
    for row in rows:
        if row.get("ceiling") is None:
            continue
        cases.setdefault((row["family"], row["op"], row["case"]), []).append(row)
    for (family, op, case), group in cases.items():
        ours = next((r for r in group if r["role"] == "qkernels"), None)
        if show_all:
            bars = [r for r in group if r["pct_of_ceiling"] is not None or r is ours]
        else:
            fastest = next((r for r in group if ours and r["role"] == "anchor" and r["impl"] == ours["anchor"]), None)
            bars = [r for r in (ours, fastest) if r is not None]
        if bars:
            families.setdefault(family, []).append((f"{op}\n{case}", bars))
    return families


def pyplot():
    """matplotlib.pyplot drawing to files, or exit with where to run this."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("benchmarks/chart.py: matplotlib is not importable here; copy the report to a machine that has it "
                 "(the CPU dev machine: pip install matplotlib) and run chart.py there")
    matplotlib.use("Agg")  # files only: no display on the machines this runs on
    import matplotlib.pyplot as plt

    return plt


def draw(plt, report, show_all, title, out):
    meta = report.get("meta", {})
    ceilings = meta.get("ceilings", {})
    titles = {f["key"]: f["title"] for f in report.get("families", [])}
    groups = case_groups(report["rows"], show_all)
    if not groups:
        sys.exit("benchmarks/chart.py: no row with a % of the ceiling in the report: nothing to draw")

    heights = [sum(len(bars) + 1 for _, bars in cases) for cases in groups.values()]
    fig, axes = plt.subplots(len(groups), 1, squeeze=False, gridspec_kw={"height_ratios": heights},
                             figsize=(11, 0.8 + 0.6 * len(groups) + INCH_PER_BAR * sum(heights)),
                             layout="constrained")
    top = max(100.0, max(r["pct_of_ceiling"] or 0.0 for cases in groups.values() for _, bars in cases for r in bars))
    for ax, (family, cases) in zip(axes[:, 0], groups.items()):
        y, ticks, labels = 0.0, [], []
        for label, bars in cases:
            first = y
            for r in bars:
                pct = r["pct_of_ceiling"]
                ax.barh(y, pct or 0.0, height=BAR_H, color=COLORS.get(r["role"], COLORS["anchor"]))
                text = f"{r['impl']}  " + ("n/a" if pct is None else f"{pct:.0f}%")
                if r["role"] == "qkernels" and r.get("ratio") is not None:
                    text += f"  ({r['ratio']:.2f}x vs fastest anchor)"
                ax.text((pct or 0.0) + top * 0.01, y, text, va="center", fontsize=6.5)
                y += 1
            ticks.append((first + y - 1) / 2)
            labels.append(label)
            y += 1  # a gap between cases
        ceiling = cases[0][1][0]["ceiling"]
        value = ceilings.get("copy_gbps" if ceiling == "copy" else "gemm_tflops")
        unit = "GB/s" if ceiling == "copy" else "TFLOP/s"
        ax.set_title(f"{titles.get(family, family)}: % of the {ceiling} ceiling"
                     + (f" ({value:.0f} {unit})" if value else ""), fontsize=10, loc="left")
        ax.set_yticks(ticks, labels, fontsize=6.5)
        ax.invert_yaxis()
        ax.set_ylim(y - 1, -1)
        ax.set_xlim(0, top * 1.45)  # room for the labels right of the bars
        ax.axvline(100, color="black", linewidth=0.8, linestyle="--")
        ax.tick_params(axis="x", labelsize=8)
    axes[-1, 0].set_xlabel("% of the ceiling measured in the same run (dashed: 100%)", fontsize=9)
    if title is None:
        title = (f"qkernels beside {'its anchors' if show_all else 'the fastest anchor of each case'} — "
                 f"{meta.get('gpu', '?')}, {meta.get('date', '?')}" + (" (--quick)" if meta.get("quick") else ""))
    fig.suptitle(title, fontsize=11)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", help="the JSON benchmarks/run.py wrote")
    p.add_argument("-o", "--output", help="PNG to write (default: the report's name with .png)")
    p.add_argument("--all", action="store_true", help="every timed row of a case, not just ours and the fastest anchor")
    p.add_argument("--title", help="the figure's title (default: GPU and date from the report)")
    args = p.parse_args(argv)
    plt = pyplot()
    report = load(args.report)
    out = args.output or os.path.splitext(args.report)[0] + ".png"
    draw(plt, report, args.all, args.title, out)
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
