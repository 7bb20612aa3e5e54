"""benchmarks/run.py and benchmarks/chart.py without a GPU: the refusal to run, the report writers
on synthetic rows, the chart from a tiny report (where matplotlib is installed); and
benchmarks/decode_step.py run tiny on the CPU."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import requires_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "benchmarks", "run.py")
CHART = os.path.join(ROOT, "benchmarks", "chart.py")
NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="")
DECODE_STEP = os.path.join(ROOT, "benchmarks", "decode_step.py")


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("qk_bench_run", RUN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def Row(op, case, impl, us, rate=None, pct=None, ratio=None, target="", check=""):
    """What common.Row holds, without importing torch."""
    return SimpleNamespace(op=op, case=case, impl=impl, us=us, gbps=rate, pct_copy=pct, ratio=ratio,
                           target=target, check=check)


def graph_rows():
    return [
        Row("sparse_aggregate", "uniform", "qkernels", 4000.0, 4200.0, 100.0, check="PASS 1e-07"),
        Row("sparse_aggregate", "uniform", "cuSPARSE", 12000.0, 1400.0, 33.0, 3.0, ">=1.5x met"),
        Row("sparse_aggregate", "uniform", "gather + index_add_ (PyG)", 64000.0, 260.0, 6.0, 16.0, ">=10.0x met"),
        Row("sparse_aggregate", "power-law", "qkernels", None, check="n/a (RuntimeError)"),
        Row("sparse_aggregate", "power-law", "cuSPARSE", 9000.0, 1900.0, 45.0),
        Row("graph_norm_bce", "E=4M", "qkernels", 40.0, 1600.0, 38.0, target="<=40 µs met"),
        Row("graph_norm_bce", "E=4M", "PyTorch eager", 7000.0, 9.0, 0.2, 175.0),
        Row("graph_norm_bce", "E=4M", "segment_reduce", 100.0, 640.0, 15.0, 2.5),
    ]


def meta(quick=False):
    return {"gpu": "NVIDIA H200", "slug": "h200", "device": "sm_90, 132 SMs, 140 GiB", "date": "2026-12-01 10:00 UTC",
            "command": "python3 benchmarks/run.py", "quick": quick, "qkernels": "0.1.0", "git": "abc123",
            "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91900, "seconds": 420.0,
            "ceilings": {"copy_gbps": 4240.0, "copy_method": "2 GiB copy", "gemm_tflops": 738.0,
                         "gemm_method": "bf16 8192^3 torch.matmul"}}


def test_run_without_a_gpu_says_so():
    r = subprocess.run([sys.executable, RUN, "--families", "graph"], capture_output=True, text=True, env=NO_GPU,
                       timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "benchmarks/run.py: no CUDA GPU here" in r.stderr or "torch is not importable" in r.stderr


def test_bench_entry_without_a_gpu_says_so():
    # python -m qkernels --bench runs run.py through runpy: the same message, not an import error
    r = subprocess.run([sys.executable, "-m", "qkernels", "--bench"], capture_output=True, text=True, env=NO_GPU,
                       timeout=120, cwd=ROOT)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "benchmarks/run.py: no CUDA GPU here" in r.stderr or "torch is not importable" in r.stderr


def test_run_options():
    r = subprocess.run([sys.executable, RUN, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--families" in r.stdout and "--quick" in r.stdout
    r = subprocess.run([sys.executable, RUN, "--families", "graph,bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown bogus" in r.stderr


def test_gpu_slug(run):
    assert run.gpu_slug("NVIDIA H200") == "h200"
    assert run.gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert run.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


def test_records(run):
    records = run.family_records(run.FAMILY_BY_KEY["graph"], graph_rows())
    assert len(records) == 8
    ours = records[0]
    # the qkernels row names the fastest anchor of its case and the ratio against it
    assert (ours["role"], ours["anchor"], ours["ratio"]) == ("qkernels", "cuSPARSE", 3.0)
    assert (ours["rate"], ours["unit"], ours["pct_of_ceiling"], ours["ceiling"]) == (4200.0, "GB/s", 100.0, "copy")
    # an anchor row keeps the table's anchor/ours figure
    assert (records[2]["role"], records[2]["anchor"], records[2]["ratio"]) == ("anchor", records[2]["impl"], 16.0)
    # our call n/a: no ratio, the anchors still recorded
    assert records[3]["us"] is None and records[3]["ratio"] is None and records[3]["unit"] is None
    assert records[4]["us"] == 9000.0
    assert records[5]["anchor"] == "segment_reduce" and records[5]["ratio"] == pytest.approx(2.5)

    decode = run.family_records(run.FAMILY_BY_KEY["decode"], [
        Row("paged", "B=8", "qkernels attn_paged_decode", 10.0, 3000.0, 70.0),
        Row("paged", "B=8", "qkernels attn_decode, contiguous KV", 8.0, 3500.0, 82.0, 0.8),
        Row("paged", "B=8", "gather + SDPA FLASH", 30.0, 1000.0, 24.0, 3.0)])
    assert [r["op"] for r in decode] == ["attn_paged_decode"] * 3
    # our own contiguous kernel is a variant, not the anchor the ratio is against
    assert [r["role"] for r in decode] == ["qkernels", "qkernels variant", "anchor"]
    assert decode[0]["anchor"] == "gather + SDPA FLASH" and decode[0]["ratio"] == 3.0


def test_overhead_records(run):
    records = run.overhead_records([("torch.add(x, y)  [anchor]", 7e-6, 6e-6),
                                    ("qkernels.sparse_aggregate", 5e-6, 4e-6),
                                    ("dispatcher lookup alone", 0.5e-6, 0.4e-6)])
    assert [r["role"] for r in records] == ["anchor", "qkernels", "breakdown"]
    assert records[1]["us"] == pytest.approx(5.0) and records[1]["ratio"] == pytest.approx(1.4)
    assert all(r["pct_of_ceiling"] is None and r["ceiling"] is None for r in records)


def test_summary(run):
    result = run.FamilyResult(run.FAMILY_BY_KEY["graph"], records=run.family_records(run.FAMILY_BY_KEY["graph"],
                                                                                       graph_rows()))
    lines = run.summary_lines(result)
    assert lines[0].startswith("| op | cases | qkernels % of copy |")
    sparse, bce = lines[2], lines[3]
    assert sparse.startswith("| sparse_aggregate | 2 (1 n/a) | 100% | 3.00x (uniform; cuSPARSE) |")
    assert sparse.endswith("| 2 met, 0 MISSED |")
    assert bce.startswith("| graph_norm_bce | 1 | 38% | 2.50x (E=4M; segment_reduce) |")


def test_reports(run, tmp_path):
    graph, overhead = run.FAMILY_BY_KEY["graph"], run.FAMILY_BY_KEY["overhead"]
    results = [
        run.FamilyResult(overhead, header=["Host overhead per call on NVIDIA H200"],
                         table=["| call | µs |", "|---|---:|"],
                         footer=["qkernels.sparse_aggregate / torch.add = 0.71x (meets the <= 1.0x target)"],
                         records=run.overhead_records([("torch.add", 7e-6, 6e-6), ("qkernels", 5e-6, 4e-6)])),
        run.FamilyResult(graph, header=["graph ops: ...", "copy ceiling: 4240 GB/s"],
                         table=["| op | case |", "|---|---|", "| sparse_aggregate | uniform |"],
                         records=run.family_records(graph, graph_rows()), seconds=12.0),
    ]
    md_path, json_path = run.write_reports(str(tmp_path), "h200", meta(), results, pending=["decode"])
    md = open(md_path, encoding="utf-8").read()
    assert md.startswith(run.MARKER)
    for text in ("# NVIDIA H200", "2026-12-01 10:00 UTC", "torch 2.11.0+cu130", "CUDA 13.0", "git abc123",
                 "- copy: 4240 GB/s", "- GEMM: 738 TFLOP/s", "**Incomplete**", "still to run: decode",
                 "### host overhead", "0.71x (meets", "### graph ops", "| sparse_aggregate | 2 (1 n/a) |",
                 "## graph ops (`benchmarks/graph_ops.py`, 12 s)", "| sparse_aggregate | uniform |"):
        assert text in md, text
    report = json.load(open(json_path, encoding="utf-8"))
    assert report["generator"] == "benchmarks/run.py" and report["incomplete"] == ["decode"]
    assert report["meta"]["ceilings"]["copy_gbps"] == 4240.0
    assert [f["key"] for f in report["families"]] == ["overhead", "graph"]
    assert len(report["rows"]) == 2 + 8
    keys = {"family", "op", "case", "impl", "role", "us", "rate", "unit", "pct_of_ceiling", "ceiling", "anchor",
            "ratio"}
    assert all(keys <= set(row) for row in report["rows"])

    # complete: no incomplete note
    run.write_reports(str(tmp_path), "h200", meta(), results)
    assert "Incomplete" not in open(md_path, encoding="utf-8").read()


def test_report_name_keeps_a_hand_written_page(run, tmp_path):
    assert run.report_stem(str(tmp_path), "h200", False) == "h200"
    assert run.report_stem(str(tmp_path), "h200", True) == "h200-quick"
    (tmp_path / "h200.md").write_text("# NVIDIA H200 — figures written by hand\n")
    assert run.report_stem(str(tmp_path), "h200", False) == "h200-run"
    run.write_reports(str(tmp_path), "h100", meta(), [])
    assert run.report_stem(str(tmp_path), "h100", False) == "h100"  # our own page is rewritten


def synthetic_report(run):
    graph = run.FAMILY_BY_KEY["graph"]
    results = [run.FamilyResult(graph, records=run.family_records(graph, graph_rows())),
               run.FamilyResult(run.FAMILY_BY_KEY["overhead"],
                                records=run.overhead_records([("torch.add", 7e-6, 6e-6), ("qkernels", 5e-6, 4e-6)]))]
    return run.json_report(meta(), results)


def test_chart(run, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(synthetic_report(run)))
    for extra in ([], ["--all"]):
        out = tmp_path / f"chart{len(extra)}.png"
        r = subprocess.run([sys.executable, CHART, str(path), "-o", str(out), *extra], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_without_matplotlib(run, tmp_path):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(synthetic_report(run)))
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "  # None in sys.modules: import raises ImportError
            f"sys.argv = [{CHART!r}, {str(path)!r}]; runpy.run_path({CHART!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "matplotlib is not importable" in r.stderr
    assert not (tmp_path / "h200.png").exists()


@requires_torch
def test_decode_step_benchmark_on_the_cpu(tmp_path):
    """The decode-step benchmark's whole path at the tiny shape: ours on the cpu backend and the
    PyTorch model (eager) on the same weights, both checked against the float64 reference, the table,
    the profile; and the random-KV context, which has no check."""
    md = tmp_path / "decode.md"
    cmd = [sys.executable, DECODE_STEP, "--device", "cpu", "--shape", "tiny", "--batches", "1,3", "--contexts",
           "16,1k", "--steps", "2", "--warmup", "1", "--check-steps", "4", "--bandwidth", "20", "--profile",
           "--markdown", str(md)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # a PASS per model and batch at the prefilled context, no check at the random-KV one
    passes = re.findall(r"^ +(qkernels cpu|PyTorch eager) +[\d.]+ ms/step .*% of bound .* PASS: ", r.stdout, re.M)
    assert sorted(passes) == ["PyTorch eager"] * 2 + ["qkernels cpu"] * 2, r.stdout
    assert r.stdout.count("no check (random KV)") >= 4 and "FAIL" not in r.stdout, r.stdout
    assert len(re.findall(r"^ +[\d.]+ µs in all$", r.stdout, re.M)) == 8, r.stdout
    table = md.read_text()
    assert "| step | case | impl | µs/step | GB/s | % bound | anchor/ours | target | check |" in table
    assert len(re.findall(r"^\| decode step \| tiny B=[13] ctx (16|1024) \| (qkernels cpu|PyTorch eager) \| [\d.]+ \|",
                          table, re.M)) == 8, table


@requires_torch
def test_decode_step_benchmark_options():
    r = subprocess.run([sys.executable, DECODE_STEP, "--device", "cpu", "--contexts", "16,x"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--contexts" in r.stderr and "Traceback" not in r.stderr


@requires_torch
def test_cpu_report(tmp_path):
    """run.py --cpu --tiny: every CPU family in one process at the smallest sizes (torch.compile
    replaced by the function itself: its compile time is not what is tested), then the report's
    structure: the header, one summary row per op and case, every family's section."""
    code = ("import runpy, sys, torch; torch.compile = lambda fn, **kw: fn; "
            f"sys.argv = [{RUN!r}, '--cpu', '--tiny', '--samples', '1', '--threads', '1', '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({RUN!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    md = (tmp_path / "cpu-quick.md").read_text(encoding="utf-8")
    report = json.loads((tmp_path / "cpu-quick.json").read_text(encoding="utf-8"))
    assert md.startswith("<!-- written by benchmarks/run.py") and "Incomplete" not in md
    for text in ("--cpu --tiny --samples 1 --threads 1", "- CPU features: avx2 ", "amx_bf16 ",
                 "- threads: 1 for qkernels and 1 for torch", "- load average (1, 5, 15 min) at the start: ",
                 "- copy rate: ", "## Summary", "| op | case | qkernels µs | fastest torch CPU anchor |"):
        assert text in md, text
    meta = report["meta"]
    assert meta["cpu"] and meta["threads"] == 1 and len(meta["load_end"]) == 3 and meta["ceilings"]["copy_gbps"] > 0
    families = ["graph", "graph_backward", "dense", "rmsnorm", "rotary_kv_append", "decode", "prefill"]
    assert [f["key"] for f in report["families"]] == families
    assert not any(f["error"] for f in report["families"])
    for f in report["families"]:
        assert f"## {f['title']} (`{f['script']}`" in md
    ours = [row for row in report["rows"] if row["role"] == "qkernels"]
    # every op of the library, each case beside a torch anchor, every check passed
    ops = {row["op"] for row in ours}
    for op in ("sparse_aggregate", "fused_edge_features", "fused_norm_residual", "graph_norm_bce", "rotary_emb",
               "rotary_kv_append", "linear", "swiglu", "rmsnorm", "fused_add_rmsnorm", "attn_decode",
               "attn_paged_decode", "attn_prefill", "attn_paged_prefill",
               "graph_norm_bce + graph_norm_bce_backward", "sparse_aggregate + sparse_aggregate_backward"):
        assert op in ops, op
    assert any("training" in row["case"] for row in ours if row["op"] == "fused_norm_residual")
    assert {"float32", "bfloat16", "float16"} <= {row["case"].split()[0] for row in ours if row["op"] == "swiglu"}
    assert all(row["us"] and row["anchor_us"] and row["ratio"] for row in ours)
    assert all(row["check"].startswith("PASS") for row in ours), [row["check"] for row in ours]
    summary = md.split("## Summary")[1].split("\n## ")[0]
    lines = [line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| op ")]
    assert len(lines) == len(ours)
    assert all(re.search(r"\| [\d.]+x \| (\d+%)? \| (met|MISSED) \|$", line) for line in lines), lines
