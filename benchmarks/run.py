"""The full benchmark set in one process on the GPU, or with --cpu on the host: every family's
table, one report.

    python3 benchmarks/run.py [--families graph,decode,prefill,dense,overhead] [--quick] [--out DIR]
    python -m qkernels --bench                      (the same, every family, full sizes)
    python3 benchmarks/run.py --cpu [--families graph,graph_backward,...] [--quick] [--threads N]

Each family is its own script, imported as a module (with --cpu in a process of its own: what one
family frees changes the page faults of the next one's large outputs) and run through its collect() with the
defaults of its own command line (--quick passed on where the family has it): the same cases,
samples, checks and columns as running the script alone.  The copy ceiling (2 GiB device-to-device
copy, bytes read + written) and the GEMM ceiling (bf16 8192^3 torch.matmul) are measured once,
before any family, and every "% copy" / "% GEMM" of the run is a share of those two figures.
overhead runs first whichever order --families gives: its host-time figures come out noisier
after the GPU work (benchmarks/h200.sh runs it first for the same reason).

Progress (family i/N, then the family's own case lines) goes to stderr; stdout gets every
family's table and, last, the summary.  Written to --out (default benchmarks/results):
  <gpu>.md    date, GPU, versions, the ceilings, a summary table per family (qkernels' % of the
              ceiling, the worst and best ratio against the fastest anchor of a case, targets met),
              then every family's own header, table and footer
  <gpu>.json  the same as data, one record per table row (op, case, impl, µs, rate and its unit,
              % of the ceiling, the anchor a ratio compares with, the ratio); benchmarks/chart.py
              draws the PNG from it on a machine with matplotlib
<gpu> is the device name's slug (NVIDIA H200 -> h200), with "-quick" under --quick.  A results
page of that name that this script did not write (hand-written notes) is kept: the report then
goes to <gpu>-run.md/.json.  Both files are rewritten after every family, so a run cut short
leaves what it measured, marked incomplete.

--cpu runs the CPU families (each script's --cpu mode, or cpu_dense.py) with qkernels and torch on
the same --threads (default: every core), measures the host's copy rate once (a 1 GiB torch copy_,
bytes read + written) for every "% copy", and writes cpu.md / cpu.json: the CPU, its vector
features, the thread counts, the load average at the start and the end (a shared machine), one
summary table of every op and case (qkernels beside the fastest torch CPU anchor, target >= 1.0x),
then every family's table.  --tiny (with --cpu) runs the smallest sizes: a smoke run for the tests.

Ratios in the JSON are anchor time / qkernels time everywhere (>1: qkernels faster).  A qkernels
row names the fastest anchor timed in its case; an anchor row (and another qkernels variant, such
as our contiguous kernel beside the paged one) carries its own figure from the table's anchor/ours
column.  Host overhead has no ceiling and stays out of the chart.
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MARKER = "<!-- written by benchmarks/run.py"
COPY_SAMPLES = 15  # the copy-ceiling replays of graph_ops.py, attn_decode.py and dense_ops.py
GEMM_SAMPLES = 10  # attn_prefill.py's


@dataclass
class Family:
    key: str  # the --families name
    title: str
    module: str  # benchmarks/<module>.py
    unit: Optional[str] = None  # of the rate column
    ceiling: Optional[str] = None  # "copy" or "GEMM": what "% of ceiling" is a share of
    quick: bool = False  # the script has --quick
    op_names: dict = field(default_factory=dict)  # the table's first column -> the qkernels op
    cpu_flag: bool = False  # --cpu: the script takes --cpu (and --tiny)


# Run order.
FAMILIES = [
    Family("overhead", "host overhead", "overhead"),
    Family("graph", "graph ops", "graph_ops", "GB/s", "copy", quick=True),
    Family("decode", "decode attention", "attn_decode", "GB/s", "copy", quick=True,
           op_names={"contiguous": "attn_decode", "paged": "attn_paged_decode"}),
    Family("prefill", "prefill attention", "attn_prefill", "TFLOP/s", "GEMM", quick=True,
           op_names={"dense": "attn_prefill", "paged": "attn_paged_prefill"}),
    Family("dense", "dense ops", "dense_ops", "GB/s", "copy", quick=True),
]
FAMILY_BY_KEY = {f.key: f for f in FAMILIES}

GRAPH_OPS = ("sparse_aggregate", "fused_edge_features", "fused_norm_residual", "graph_norm_bce")
CPU_FAMILIES = [
    Family("graph", "graph ops", "graph_ops", "GB/s", "copy", quick=True, cpu_flag=True),
    Family("graph_backward", "graph ops forward + backward", "graph_backward", quick=True, cpu_flag=True,
           op_names={op: f"{op} + {op}_backward" for op in GRAPH_OPS}),
    Family("dense", "linear, swiglu, rotary_emb", "cpu_dense", "GB/s", "copy", quick=True),
    Family("rmsnorm", "rmsnorm, fused_add_rmsnorm", "rmsnorm", "GB/s", "copy", quick=True, cpu_flag=True),
    Family("rotary_kv_append", "rotary_kv_append", "rotary_kv_append", "GB/s", "copy", quick=True, cpu_flag=True),
    Family("decode", "decode attention", "attn_decode", "GB/s", "copy", quick=True, cpu_flag=True,
           op_names={"contiguous": "attn_decode", "paged": "attn_paged_decode"}),
    Family("prefill", "prefill attention", "attn_prefill", "GFLOP/s", quick=True, cpu_flag=True,
           op_names={"dense": "attn_prefill", "paged": "attn_paged_prefill"}),
]
CPU_FAMILY_BY_KEY = {f.key: f for f in CPU_FAMILIES}
CPU_COPY_BYTES = 1 << 30
CPU_COPY_ROUNDS = 5


@dataclass
class FamilyResult:
    family: Family
    header: list = field(default_factory=list)
    table: list = field(default_factory=list)  # markdown lines, the family's own columns
    text: list = field(default_factory=list)  # the same table for the terminal
    footer: list = field(default_factory=list)
    records: list = field(default_factory=list)  # one dict per table row
    error: Optional[str] = None  # why the family stopped, when it did
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# Rows to records, records to the summary (no GPU needed: tests/test_bench_tools.py)


def is_ours(impl):
    return impl.startswith("qkernels")


def family_records(family, rows):
    """Records of a family's table rows (common.Row or anything with its fields), in table order.

    In each case the first qkernels row is ours; the other qkernels rows are variants (a layout,
    our contiguous kernel beside the paged one); every other row is an anchor.
    """
    groups = {}
    for row in rows:
        groups.setdefault((row.op, row.case), []).append(row)
    records = []
    for (first_column, case), group in groups.items():
        ours = next((row for row in group if is_ours(row.impl)), None)
        anchors = [row for row in group if not is_ours(row.impl) and row.us]
        fastest = min(anchors, key=lambda row: row.us, default=None)
        for row in group:
            if row is ours:
                role = "qkernels"
                anchor = fastest.impl if fastest else None
                ratio = fastest.us / row.us if fastest and row.us else None
            else:
                role = "qkernels variant" if is_ours(row.impl) else "anchor"
                anchor, ratio = row.impl, row.ratio
            records.append({
                "family": family.key, "op": family.op_names.get(first_column, first_column), "case": case,
                "impl": row.impl, "role": role, "us": row.us,
                "anchor_us": fastest.us if row is ours and fastest else None, "rate": row.gbps,
                "unit": family.unit if row.gbps is not None else None, "pct_of_ceiling": row.pct_copy,
                "ceiling": family.ceiling, "anchor": anchor, "ratio": ratio, "target": row.target,
                "check": row.check})
    return records


def overhead_records(results):
    """Records of overhead.py's rows (name, median s, best s): the first is torch.add, the anchor."""
    anchor_name, anchor_s = results[0][0], results[0][1]
    records = []
    for i, (name, median_s, best_s) in enumerate(results):
        is_op = name.startswith("qkernels.") and "(" not in name  # one row per op; the rest break a call down
        role = "anchor" if i == 0 else "qkernels" if is_op else "breakdown"
        records.append({
            "family": "overhead", "op": "host overhead", "case": name, "impl": name, "role": role,
            "us": median_s * 1e6, "best_us": best_s * 1e6, "rate": None, "unit": None, "pct_of_ceiling": None,
            "ceiling": None, "anchor": anchor_name, "ratio": anchor_s / median_s if median_s else None,
            "target": "<=1.0x torch.add" if is_op else "", "check": ""})
    return records


def fmt_pct(values):
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo:.0f}%" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}%"


def summary_lines(result):
    """A markdown table, one line per op: qkernels' % of the ceiling, worst and best ratio against
    the fastest anchor of each case, targets met/missed (from the family's target column)."""
    family = result.family
    if family.ceiling is None:
        return list(result.footer)
    if not result.records:
        return ["no case measured"]
    ops = {}
    for record in result.records:
        ops.setdefault(record["op"], []).append(record)
    lines = [f"| op | cases | qkernels % of {family.ceiling} | worst ratio vs fastest anchor | "
             f"best ratio vs fastest anchor | targets |",
             "|---|---:|---:|---|---|---|"]
    for op, records in ops.items():
        ours = [r for r in records if r["role"] == "qkernels"]
        measured = [r for r in ours if r["us"] is not None]
        rated = [r for r in measured if r["ratio"] is not None]
        worst = min(rated, key=lambda r: r["ratio"], default=None)
        best = max(rated, key=lambda r: r["ratio"], default=None)
        targets = " ".join(r["target"] or "" for r in records)
        met, missed = len(re.findall(r"\bmet\b", targets)), len(re.findall(r"\bMISSED\b", targets))
        cases = f"{len(ours)}" + (f" ({len(ours) - len(measured)} n/a)" if len(measured) < len(ours) else "")

        def ratio_text(r):
            return "n/a" if r is None else f"{r['ratio']:.2f}x ({r['case']}; {r['anchor']})"

        pct = fmt_pct([r["pct_of_ceiling"] for r in measured if r["pct_of_ceiling"] is not None])
        target_text = f"{met} met, {missed} MISSED" if met or missed else "none"
        lines.append(f"| {op} | {cases} | {pct} | {ratio_text(worst)} | {ratio_text(best)} | {target_text} |")
    return lines


def cpu_summary_lines(results):
    """--cpu: a markdown table, one line per op and case of every family: qkernels' time beside the
    fastest torch anchor's, the ratio, the share of the host copy rate, the target >= 1.0x."""
    lines = ["| op | case | qkernels µs | fastest torch CPU anchor | anchor µs | anchor/ours | qkernels % copy | "
             "target >= 1.0x |", "|---|---|---:|---|---:|---:|---:|---|"]
    for result in results:
        for r in result.records:
            if r["role"] != "qkernels":
                continue
            ratio = r["ratio"]
            verdict = "n/a" if ratio is None else "met" if ratio >= 1.0 else "MISSED"
            pct = r["pct_of_ceiling"] if r["ceiling"] == "copy" else None
            lines.append(f"| {r['op']} | {r['case']} | {fmt_us(r['us'])} | {r['anchor'] or 'none'} | "
                         f"{fmt_us(r['anchor_us'])} | {'' if ratio is None else f'{ratio:.2f}x'} | "
                         f"{'' if pct is None else f'{pct:.0f}%'} | {verdict} |")
    return lines


def fmt_us(us):
    return "n/a" if us is None else f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def missed_cases(results):
    """--cpu: (op, case, ratio) of each qkernels row below 1.0x its fastest anchor."""
    return [(r["op"], r["case"], r["ratio"]) for result in results for r in result.records
            if r["role"] == "qkernels" and r["ratio"] is not None and r["ratio"] < 1.0]


# ---------------------------------------------------------------------------------------------
# The report files


def gpu_slug(name):
    """'NVIDIA H200' -> 'h200', 'NVIDIA GeForce RTX 4090' -> 'geforce-rtx-4090'."""
    name = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def written_by_run(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(MARKER)
    except OSError:
        return False


def report_stem(out_dir, slug, quick):
    """The report's file stem: <slug>[-quick], or <slug>[-quick]-run where a page of that name was
    written by hand (it is never overwritten)."""
    stem = slug + ("-quick" if quick else "")
    md = os.path.join(out_dir, stem + ".md")
    if os.path.exists(md) and not written_by_run(md):
        stem += "-run"
    return stem


def ceiling_lines(meta):
    c = meta["ceilings"]
    return [f"- copy: {c['copy_gbps']:.0f} GB/s ({c['copy_method']})",
            f"- GEMM: {c['gemm_tflops']:.0f} TFLOP/s ({c['gemm_method']})"]


def cpu_environment_lines(meta):
    """--cpu: the host, the threads, the load, the copy rate."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
    flags = ", ".join(f"{f} {'yes' if f in meta['flags'] else 'no'}" for f in wanted)
    load = meta["load_start"], meta.get("load_end")
    return [f"qkernels {meta['qkernels']}" + (f" (git {meta['git']})" if meta.get("git") else "")
            + f" · torch {meta['torch']} · {meta['machine']}, {meta['cores']} cores", "",
            f"- CPU features: {flags}; qkernels' linear/swiglu path: {meta['isa']}",
            f"- threads: {meta['threads']} for qkernels and {meta['threads']} for torch (torch.set_num_threads; "
            "the same count on both sides in every family)",
            f"- load average (1, 5, 15 min) at the start: {', '.join(f'{x:.2f}' for x in load[0])}; at the end: "
            + (", ".join(f"{x:.2f}" for x in load[1]) if load[1] else "not yet") + " (a shared machine: torch's "
            "OpenMP team waits for a descheduled thread, so a busy core costs torch more than qkernels)",
            f"- copy rate: {meta['ceilings']['copy_gbps']:.1f} GB/s ({meta['ceilings']['copy_method']}); every "
            "% copy below is a share of it (above 100%: the data stays in cache between calls)"]


def markdown_report(meta, results, pending=()):
    """The results page: meta (run.py's main() fills it), the families run so far, those still to run."""
    done = ", ".join(r.family.key for r in results)
    quick = " — --quick sizes, not the published figures" if meta["quick"] else ""
    cpu = meta.get("cpu", False)
    regenerate = "python3 benchmarks/run.py --cpu" if cpu else "python -m qkernels --bench"
    lines = [f"{MARKER}: regenerate with `{regenerate}`; edits are lost -->",
             f"# {'CPU: ' + meta['machine'] if cpu else meta['gpu']} — qkernels benchmark set", "",
             f"Measured {meta['date']} by `{meta['command']}`, "
             f"{'each family in a process of its own' if cpu else 'the families in one process'} "
             f"({meta['seconds'] / 60:.1f} min){quick}.", ""]
    if cpu:
        lines += cpu_environment_lines(meta)
    else:
        lines += [f"qkernels {meta['qkernels']}" + (f" (git {meta['git']})" if meta.get("git") else "")
                  + f" · torch {meta['torch']} · CUDA {meta['cuda']} · cuDNN {meta['cudnn']} · {meta['gpu']} "
                  f"({meta['device']})", "",
                  "Ceilings, measured once at the start of this run; every % below is a share of them:", ""]
        lines += ceiling_lines(meta)
    if pending:
        lines += ["", f"**Incomplete**: written after {done or 'no family'}; still to run: {', '.join(pending)}."]
    if cpu:
        missed = missed_cases(results)
        lines += ["", "## Summary", "",
                  "One row per op and case: qkernels (backend cpu) beside the fastest torch CPU anchor timed in the "
                  "case, anchor/ours = anchor time / qkernels time (>1: qkernels faster); the target is >= 1.0x.", ""]
        lines += cpu_summary_lines(results)
        lines += ["", f"{len(missed)} row(s) below 1.0x" + (": " + "; ".join(
            f"{op} {case} {ratio:.2f}x" for op, case, ratio in missed) if missed else "") + "."]
        failed = [f"{r.family.key}: {r.error}" for r in results if r.error]
        if failed:
            lines += ["", "Families that failed: " + "; ".join(failed)]
    else:
        lines += ["", "## Summary", "",
                  "Ratio: the fastest anchor's time / qkernels' time in a case (>1: qkernels faster), worst and best "
                  "over the op's cases; targets: the family's target column, counted."]
        for r in results:
            lines += ["", f"### {r.family.title}", ""]
            lines += [f"failed: {r.error}"] if r.error and not r.records else summary_lines(r)
    for r in results:
        lines += ["", f"## {r.family.title} (`benchmarks/{r.family.module}.py`, {r.seconds:.0f} s)", ""]
        if r.error:
            lines += [f"**failed**: {r.error}", ""]
        for line in r.header:  # one paragraph each, as the scripts' own --markdown files have them
            lines += [line, ""]
        if r.table:
            lines += r.table + [""]
        for line in r.footer:
            lines += [line, ""]
    return "\n".join(lines).rstrip() + "\n"


def json_report(meta, results, pending=()):
    return {
        "generator": "benchmarks/run.py",
        "meta": meta,
        "incomplete": list(pending),
        "families": [{"key": r.family.key, "title": r.family.title, "script": f"benchmarks/{r.family.module}.py",
                      "unit": r.family.unit, "ceiling": r.family.ceiling, "header": r.header, "footer": r.footer,
                      "error": r.error, "seconds": r.seconds} for r in results],
        "rows": [record for r in results for record in r.records],
    }


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_reports(out_dir, stem, meta, results, pending=()):
    """-> (markdown path, JSON path)."""
    os.makedirs(out_dir, exist_ok=True)
    md, js = os.path.join(out_dir, stem + ".md"), os.path.join(out_dir, stem + ".json")
    write_atomic(md, markdown_report(meta, results, pending))
    write_atomic(js, json.dumps(json_report(meta, results, pending), indent=1, ensure_ascii=False) + "\n")
    return md, js


# ---------------------------------------------------------------------------------------------
# The run (GPU)


def log(msg):
    print(f"[run] {msg}", file=sys.stderr, flush=True)


def require_gpu():
    """torch with a CUDA device, or exit with why (no traceback)."""
    try:
        import torch
    except ImportError as exc:
        sys.exit(f"benchmarks/run.py: torch is not importable ({exc}); the benchmarks time CUDA kernels beside "
                 "torch anchors on an NVIDIA GPU")
    if not torch.cuda.is_available():
        why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device visible to torch"
        sys.exit(f"benchmarks/run.py: no CUDA GPU here ({why}; torch {torch.__version__}): the benchmarks time "
                 "CUDA kernels; run this on a machine with an NVIDIA GPU (benchmarks/h200.sh does)")
    return torch


def git_revision():
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + (", modified" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def family_argv(family, quick, cpu=False, tiny=False, samples=None):
    """The family script's command line in this run."""
    argv = ["--cpu"] if cpu and family.cpu_flag else []
    if tiny:
        argv.append("--tiny")
    elif quick and family.quick:
        argv.append("--quick")
    return argv + (["--samples", str(samples)] if samples else [])


def run_family(family, quick, ceilings, cpu=False, tiny=False, samples=None):
    """One family through its collect(): its progress lines go to stderr."""
    import importlib

    import common

    result = FamilyResult(family)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            module = importlib.import_module(family.module)
            args = module.parse_args(family_argv(family, quick, cpu, tiny, samples))
            if family.key == "overhead":
                result.header, results, result.footer = module.collect(args)
                result.table = result.text = module.markdown_table(results)
                result.records = overhead_records(results)
            else:
                ceiling = {"gemm": ceilings["gemm_tflops"]} if family.ceiling == "GEMM" else \
                    {"copy_gbps": ceilings["copy_gbps"]} if family.ceiling == "copy" else {}
                result.header, rows, result.footer = module.collect(args, **ceiling)
                columns = module.columns(args) if hasattr(module, "columns") else getattr(module, "COLUMNS",
                                                                                           common.COLUMNS)
                cells = getattr(module, "row_cells", common.row_cells)
                result.table = common.markdown_table(rows, columns, cells)
                result.text = common.text_table(rows, columns, cells)
                result.records = family_records(family, rows)
    except Exception as exc:  # a family that breaks (memory, a sticky CUDA error) costs its table only
        traceback.print_exc()
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    finally:
        common.release_gpu_memory()
    result.seconds = time.perf_counter() - start
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=None,
                   help=f"comma list from {', '.join(f.key for f in FAMILIES)}, or with --cpu from "
                        f"{', '.join(f.key for f in CPU_FAMILIES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="each family's --quick where it has one (smoke run)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for <gpu>.md and <gpu>.json")
    p.add_argument("--cpu", action="store_true", help="the CPU families on the host: cpu.md and cpu.json")
    p.add_argument("--threads", type=int, default=None,
                   help="--cpu: threads for qkernels and torch (default: all cores)")
    p.add_argument("--tiny", action="store_true", help="--cpu: the smallest sizes, figures meaningless (a test)")
    p.add_argument("--samples", type=int, default=None, help="passed to every family (default: each family's own)")
    # --cpu runs each family in a process of its own, started with these two (not for users)
    p.add_argument("--family-result", help=argparse.SUPPRESS)
    p.add_argument("--copy-gbps", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    families = CPU_FAMILIES if args.cpu else FAMILIES
    keys = [k.strip() for k in (args.families or ",".join(f.key for f in families)).split(",") if k.strip()]
    unknown = [k for k in keys if k not in {f.key for f in families}]
    if unknown or not keys:
        p.error(f"--families: unknown {', '.join(unknown) or '(none given)'}; "
                f"expected some of {', '.join(f.key for f in families)}")
    if (args.tiny or args.threads) and not args.cpu:
        p.error("--tiny and --threads go with --cpu")
    if (args.threads is not None and args.threads < 1) or (args.samples is not None and args.samples < 1):
        p.error("--threads and --samples must be at least 1")
    args.families = [f for f in families if f.key in keys]
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # The family scripts import `common` from benchmarks/ and `qkernels` from the checkout; through
    # runpy (python -m qkernels --bench) neither folder is on sys.path.
    for path in (ROOT, HERE):
        if path not in sys.path:
            sys.path.insert(0, path)
    if args.cpu and args.family_result:
        return cpu_family_child(args)
    if args.cpu:
        return main_cpu(args, argv)
    torch = require_gpu()
    try:
        import common
        import qkernels
    except ImportError as exc:
        sys.exit(f"benchmarks/run.py: {exc}; build the extension first (python3 setup.py build_ext --inplace)")
    if not qkernels.AVAILABLE:
        log(f"warning: qkernels CUDA backend unavailable ({qkernels.info()['cuda_reason']}); our rows will be n/a")

    start = time.perf_counter()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu = torch.cuda.get_device_name()
    stem = report_stem(args.out, gpu_slug(gpu), args.quick)
    log(f"{gpu}; {len(args.families)} famil{'y' if len(args.families) == 1 else 'ies'}: "
        f"{', '.join(f.key for f in args.families)}; report: {os.path.join(args.out, stem)}.md/.json"
        + (" (a page this script did not write holds the plain name: kept)" if stem.endswith("-run") else ""))

    log("ceilings: 2 GiB device-to-device copy, bf16 8192^3 matmul")
    ceilings = {"copy_gbps": common.gpu_copy_ceiling_gbps(COPY_SAMPLES),
                "copy_method": f"{common.GPU_COPY_BYTES >> 30} GiB device-to-device copy, bytes read + written, "
                               "the faster of copy_ and an elementwise kernel",
                "gemm_tflops": common.gpu_gemm_ceiling_tflops(GEMM_SAMPLES),
                "gemm_method": "bf16 8192^3 torch.matmul"}
    common.release_gpu_memory()
    log(f"copy ceiling {ceilings['copy_gbps']:.0f} GB/s, GEMM ceiling {ceilings['gemm_tflops']:.0f} TFLOP/s")

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    meta = {"gpu": gpu, "slug": gpu_slug(gpu),
            "device": f"sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                      f"{props.total_memory / 2**30:.0f} GiB",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python3 benchmarks/run.py"] + list(argv)), "quick": args.quick,
            "qkernels": qkernels.__version__, "qkernels_cuda": bool(qkernels.AVAILABLE), "git": git_revision(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
            "families": [f.key for f in args.families], "ceilings": ceilings, "seconds": 0.0}

    results = []
    for i, family in enumerate(args.families):
        log(f"family {i + 1}/{len(args.families)}: {family.title} (benchmarks/{family.module}.py"
            f"{' --quick' if args.quick and family.quick else ''})")
        result = run_family(family, args.quick, ceilings, samples=args.samples)
        results.append(result)
        log(f"{family.title}: {len(result.records)} rows in {result.seconds:.0f} s"
            + (f"; failed: {result.error}" if result.error else ""))
        meta["seconds"] = time.perf_counter() - start
        md, js = write_reports(args.out, stem, meta, results, [f.key for f in args.families[i + 1:]])

    for r in results:
        print(f"\n{r.family.title} (benchmarks/{r.family.module}.py)" + (f": failed: {r.error}" if r.error else ""))
        print("\n".join(r.header + [""] + r.text + ([""] + r.footer if r.footer else [])))
    print(f"\nsummary ({gpu}; copy ceiling {ceilings['copy_gbps']:.0f} GB/s, GEMM ceiling "
          f"{ceilings['gemm_tflops']:.0f} TFLOP/s; ratio = fastest anchor / qkernels, >1: qkernels faster)")
    for r in results:
        print(f"\n{r.family.title}" + (f": failed: {r.error}" if r.error else ""))
        print("\n".join(summary_lines(r)))
    print(f"\nwritten: {md}\n         {js}\n(chart: python3 benchmarks/chart.py {js}, where matplotlib is installed)")
    return 1 if any(r.error for r in results) else 0


def cpu_threads(args):
    """--cpu: one thread count for qkernels and torch; -> the count."""
    import torch

    from qkernels import _C

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    _C._configure(num_threads=threads)
    return threads


def cpu_family_child(args):
    """One CPU family in this (fresh) process, its result written as JSON to --family-result."""
    cpu_threads(args)
    result = run_family(args.families[0], args.quick, {"copy_gbps": args.copy_gbps}, True, args.tiny, args.samples)
    with open(args.family_result, "w") as f:
        json.dump({k: v for k, v in vars(result).items() if k != "family"}, f)
    return 0


def run_cpu_family(family, args, threads, copy_gbps):
    """A CPU family in a process of its own: what the families before it freed decides whether a large
    fresh output faults its pages in (docs/cpu.md), so in one process a family's figures would depend
    on the order of the run."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--cpu", "--families", family.key, "--threads", str(threads),
               "--copy-gbps", repr(copy_gbps), "--family-result", path]
        cmd += (["--quick"] if args.quick else []) + (["--tiny"] if args.tiny else [])
        cmd += ["--samples", str(args.samples)] if args.samples else []
        code = subprocess.run(cmd, stdout=sys.stderr).returncode  # its progress lines, as in-process
        result = FamilyResult(family)
        if os.path.exists(path):
            with open(path) as f:
                for k, v in json.load(f).items():
                    setattr(result, k, v)
        else:
            result.error = f"its process exited with status {code} before writing a result"
        return result


def main_cpu(args, argv):
    """--cpu: every CPU family on the host with one thread count for qkernels and torch: cpu.md/.json."""
    try:
        import torch

        import common
        import qkernels
        from qkernels import _C
    except ImportError as exc:
        sys.exit(f"benchmarks/run.py: {exc}; the CPU benchmarks need torch and the extension built in place "
                 "(QKERNELS_CUDA=0 python3 setup.py build_ext --inplace)")
    load_start = os.getloadavg()
    start = time.perf_counter()
    threads = cpu_threads(args)
    quick = args.quick or args.tiny
    stem = report_stem(args.out, "cpu", quick)
    model, flags = common.cpu_model()
    log(f"{model}, {threads} threads; {len(args.families)} famil{'y' if len(args.families) == 1 else 'ies'}: "
        f"{', '.join(f.key for f in args.families)}; report: {os.path.join(args.out, stem)}.md/.json")
    copy_bytes = (64 << 20) if args.tiny else CPU_COPY_BYTES
    ceilings = {"copy_gbps": common.host_copy_gbps(copy_bytes, CPU_COPY_ROUNDS),
                "copy_method": f"torch copy_ of a {copy_bytes >> 20} MiB float32 buffer on {threads} threads, bytes "
                               f"read + written, median of {CPU_COPY_ROUNDS} batches of ~50 ms"}
    log(f"copy rate {ceilings['copy_gbps']:.1f} GB/s")
    meta = {"cpu": True, "machine": model, "cores": os.cpu_count(), "flags": flags, "isa": _C._cpu_isa(),
            "threads": threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python3 benchmarks/run.py"] + list(argv)), "quick": quick,
            "qkernels": qkernels.__version__, "git": git_revision(), "torch": torch.__version__,
            "families": [f.key for f in args.families], "ceilings": ceilings, "load_start": load_start,
            "load_end": None, "seconds": 0.0}

    results = []
    for i, family in enumerate(args.families):
        script = [f"benchmarks/{family.module}.py"] + family_argv(family, args.quick, True, args.tiny, args.samples)
        log(f"family {i + 1}/{len(args.families)}: {family.title} ({' '.join(script)})")
        result = run_cpu_family(family, args, threads, ceilings["copy_gbps"])
        results.append(result)
        log(f"{family.title}: {len(result.records)} rows in {result.seconds:.0f} s"
            + (f"; failed: {result.error}" if result.error else ""))
        meta["seconds"] = time.perf_counter() - start
        meta["load_end"] = os.getloadavg() if i + 1 == len(args.families) else None
        md, js = write_reports(args.out, stem, meta, results, [f.key for f in args.families[i + 1:]])

    for r in results:
        print(f"\n{r.family.title} (benchmarks/{r.family.module}.py)" + (f": failed: {r.error}" if r.error else ""))
        print("\n".join(r.header + [""] + r.text + ([""] + r.footer if r.footer else [])))
    print(f"\nsummary ({model}, {threads} threads; copy rate {ceilings['copy_gbps']:.1f} GB/s; ratio = fastest "
          "torch anchor / qkernels, >1: qkernels faster)\n")
    print("\n".join(cpu_summary_lines(results)))
    print(f"\nwritten: {md}\n         {js}")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
