"""The whole Llama decode step: qkernels beside pure PyTorch under torch.compile, in one process.

What is measured.  One model shape (--shape, default llama-8b: 32 layers, hidden 4096, 32/8 heads of
128, MLP 14336, vocab 32000, bfloat16, with the example's q/k/v/o biases), built once from random
weights (examples/decode_step.py's build_weights) and run two ways on the same weight tensors:
  qkernels   examples/decode_step.py's Model (imported, not copied): qkernels.linear, swiglu,
             rotary_emb, rmsnorm / fused_add_rmsnorm and attn_paged_decode over a token pool; one
             decode step captured in a CUDA graph and replayed
  PyTorch    the same model written as gpt-fast does: a static KV cache [B, Hkv, max_len, D] per
             layer, F.scaled_dot_product_attention(enable_gqa=True) over it with a position mask,
             cuBLAS matmuls through F.linear, RMSNorm with float32 statistics, rotate-half rope in
             float32; one decode step under torch.compile(mode="reduce-overhead", fullgraph=True)
             (CUDA graphs through cudagraph trees)
Greedy decoding at each batch size (--batches, default 1,8) and context (--contexts, default 16):
a context up to PREFILL_MAX tokens is a random prompt of that length, prefilled by each model
(eagerly) and checked; a longer one is a KV cache filled with random values (4k, 32k: the step's
time depends on the lengths, not the values).  --warmup steps run first (the compile, cudagraph
trees' warm-up and recording, our capture), then --steps steps are timed one by one with CUDA
events around each replay: device time per step, the median over the steps.  The per-step host
work that moves to the next token sits outside the events for PyTorch (the token copy, position
add); ours advances kv_indptr and its input token inside the graph (two small kernels).

The bound.  A step must read every weight once (all but the embedding table: 14.2 GB at llama-8b)
and the KV cache up to the current length; "% bound" is that byte count over the step time as a
share of the device-to-device copy rate (benchmarks/common.py's, measured in the same run; or
--bandwidth GB/s).  At 4.5 TB/s the llama-8b weights alone take 3.16 ms.

The check.  On the prefilled contexts, the first --check-steps greedy tokens of both models are
compared with a float64 reference (the example's Model on torch ops in float64) by the example's
rule (decode_step.compare: first-token logits within a tolerance of the reference, tokens equal
wherever the reference's top-2 margin is clear of it): PASS/FAIL per model in the check column.

--profile: one more step of each under torch.profiler, its kernels summed by name (top 25): where
the time between the bound and the step goes.

--device cpu (with --shape tiny): ours on the cpu backend (float32) beside the same PyTorch model run
eagerly, wall-clock per step: the script's smoke test, no GPU needed.

    python3 benchmarks/decode_step.py [--shape llama-8b] [--batches 1,8] [--contexts 16,4k,32k]
                                      [--steps 64] [--profile] [--markdown FILE]
    python3 benchmarks/decode_step.py --device cpu --shape tiny --steps 4
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace

# torch's OpenMP threads must not spin between its ops on the cores qkernels' threads use next (see
# examples/decode_step.py): set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import common  # noqa: E402  # first: it puts the checkout's qkernels on sys.path
import qkernels  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

PREFILL_MAX = 512  # longer contexts get random KV instead of a prefill (the eager anchor's mask is T x max_len)
TARGETS_US = {("llama-8b", 1): 4100.0, ("llama-8b", 8): 4650.0}  # ours, per step, prefilled contexts
COLUMNS = ["step", "case", "impl", "µs/step", "GB/s", "% bound", "anchor/ours", "target", "check"]
TOP_KERNELS = 25


def _load_example():
    """examples/decode_step.py as a module of another name: this file has the same one."""
    spec = importlib.util.spec_from_file_location("decode_step_example",
                                                  os.path.join(common.ROOT, "examples", "decode_step.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ds = _load_example()


# ---- the PyTorch model ----------------------------------------------------------------------

def _static(module, name, tensor):
    """A buffer cudagraph trees reads in place (no copy into a placeholder per replay)."""
    module.register_buffer(name, tensor)
    if tensor is not None:
        torch._dynamo.mark_static_address(tensor)


class TorchBlock(nn.Module):
    def __init__(self, w, cfg, heads, kv_heads, batch, max_len):
        super().__init__()
        self.eps, self.heads, self.kv_heads, self.head_dim = cfg.norm_eps, heads, kv_heads, cfg.head_dim
        for name in ("attn_norm", "w_qkv", "b_qkv", "wo", "bo", "mlp_norm", "w_gate", "w_up", "w_down"):
            _static(self, name, w[name])
        w = w["w_qkv"]
        for name in ("k_cache", "v_cache"):
            _static(self, name, torch.zeros(batch, kv_heads, max_len, cfg.head_dim, dtype=w.dtype, device=w.device))

    def forward(self, x, input_pos, freqs, mask):
        B, T, _ = x.shape
        Hq, Hkv, D = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(ds.rmsnorm(x, self.attn_norm, self.eps), self.w_qkv, self.b_qkv)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = rope(q.view(B, T, Hq, D), freqs).transpose(1, 2)
        k = rope(k.view(B, T, Hkv, D), freqs).transpose(1, 2)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        h = x + F.linear(y.transpose(1, 2).reshape(B, T, Hq * D), self.wo, self.bo)
        m = ds.rmsnorm(h, self.mlp_norm, self.eps)
        return h + F.linear(F.silu(F.linear(m, self.w_gate)) * F.linear(m, self.w_up), self.w_down)


def rope(x, freqs):
    """Rotate-half rope in float32 (x [B, T, H, D], freqs [T, D/2, 2]), the result in x's dtype."""
    return ds.TorchReference.rotary_emb(x.float(), freqs, interleaved=False).to(x.dtype)


class TorchLlama(nn.Module):
    """gpt-fast's decoder on `ours`' weight tensors (shared, not copied), with static KV caches for
    `batch` sequences of up to max_len positions.  forward(tokens [B, T], input_pos [T]) -> logits
    [B, T, V]; every sequence is at the same positions."""

    def __init__(self, ours, batch, max_len):
        super().__init__()
        self.eps = ours.cfg.norm_eps
        for name in ("embed", "final_norm", "lm_head", "freqs"):
            _static(self, name, getattr(ours, name))
        _static(self, "positions", torch.arange(max_len, device=ours.device))
        self.layers = nn.ModuleList(TorchBlock(w, ours.cfg, ours.heads, ours.kv_heads, batch, max_len)
                                    for w in ours.layers)

    def forward(self, tokens, input_pos):
        x = self.embed[tokens]
        freqs = self.freqs[input_pos]
        mask = (self.positions[None, :] <= input_pos[:, None])[None, None]  # [1, 1, T, max_len]
        for layer in self.layers:
            x = layer(x, input_pos, freqs, mask)
        return F.linear(ds.rmsnorm(x, self.final_norm, self.eps), self.lm_head)


def torch_step(model, tokens, input_pos):
    """One greedy decode step: tokens [B] at position input_pos [1] -> (next tokens, top-2 margins)."""
    return ds._top2(model(tokens[:, None], input_pos)[:, -1])


# ---- runs -----------------------------------------------------------------------------------

class Run:
    """What a model's run leaves: the greedy tokens and margins (the first from the prefill), the
    prefill's logits (None for a random-KV context), the per-step times and the kernel profile."""

    def __init__(self, first_logits, tok, margin):
        self.first_logits, self.toks, self.margins = first_logits, [tok.clone()], [margin.clone()]
        self.ms, self.profile = [], None

    def record(self, tok, margin):
        self.toks.append(tok.clone())
        self.margins.append(margin.clone())

    def generation(self, steps):
        """The first steps as a decode_step.Generation, for decode_step.compare."""
        return ds.Generation(torch.stack(self.toks[:steps], 1).tolist(),
                             torch.stack(self.margins[:steps], 1).double().cpu(),
                             self.first_logits.double().cpu(), 0.0, 0.0, 0)


def timed_steps(run, step, after, n, device, timed=True):
    """n steps: step() -> (tokens, margins), then after(tokens, margins); with timed, the time of each
    step() (CUDA events around it on a GPU: device time; else wall-clock) goes to run.ms."""
    cuda = device.type == "cuda"
    events = []
    for _ in range(n):
        if cuda:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        t0 = time.perf_counter()
        out = step()
        if cuda:
            events[-1][1].record()
        elif timed:
            run.ms.append((time.perf_counter() - t0) * 1e3)
        after(*out)
        run.record(*out)
    if cuda:
        torch.cuda.synchronize(device)
        if timed:
            run.ms += [s.elapsed_time(e) for s, e in events]


def kernel_profile(step, after, device):
    """One step under torch.profiler -> [(name, calls, µs)], summed by name, longest first: the
    device's kernels and copies on a GPU; on the CPU torch's ops by self time (qkernels' C calls are
    not torch ops: they are in the step's remainder)."""
    cuda = device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        out = step()
        if cuda:
            torch.cuda.synchronize(device)
    after(*out)
    us, calls = defaultdict(float), defaultdict(int)
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                us[e.name] += e.time_range.elapsed_us()
                calls[e.name] += 1
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                us[e.key], calls[e.key] = e.self_cpu_time_total, e.count
    return sorted(((k, calls[k], v) for k, v in us.items()), key=lambda r: -r[2])


def start_tokens(cfg, batch, ctx, seed, device):
    """The prompts of a prefilled context (batch x ctx random tokens), or None past PREFILL_MAX."""
    return ds.make_prompts(seed, cfg, batch, ctx, ctx) if ctx <= PREFILL_MAX else None


def random_start(cfg, batch, seed, device):
    g = torch.Generator().manual_seed(seed + 2)
    return torch.randint(0, cfg.vocab, (batch,), generator=g).to(device), torch.zeros(batch, device=device)


def run_ours(model, batch, ctx, a, graph):
    """examples/decode_step.py's Model: prefill (or random KV), then decode steps; with graph, one
    eager step, then every later step a replay of one captured step."""
    dev, cfg = model.device, model.cfg
    after_ctx = a.warmup + a.steps + 1  # + the profiled step
    cache = ds.KVCache(model, batch, ctx + after_ctx, batch * (ctx + after_ctx) + batch, a.seed)
    slots = cache.append([ctx] * batch)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * ctx
    prompts = start_tokens(cfg, batch, ctx, a.seed, dev)
    if prompts is None:
        g = torch.Generator(dev).manual_seed(a.seed + 3)
        for pool in cache.k + cache.v:
            pool.normal_(generator=g)
        run = Run(None, *random_start(cfg, batch, a.seed, dev))
    else:
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.arange(ctx, device=dev).repeat(batch)
        logits = model.prefill(tokens, positions, cache, slots, indptr, indptr, (indptr[1:] - 1).long())
        run = Run(logits, *ds._top2(logits))
    # Every later position's slot now, so that a step changes kv_indptr alone, on the device.
    cache.append([after_ctx] * batch)
    one_each = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    tok_in = run.toks[0].clone()

    def step():
        indptr.add_(one_each)
        tok, margin = ds._top2(model.decode(tok_in, cache, indptr))
        tok_in.copy_(tok)
        return tok, margin

    def after(tok, margin):
        pass

    if graph:
        side = torch.cuda.Stream(dev)  # the eager warm-up step on a side stream, as capture asks
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            run.record(*step())
        torch.cuda.current_stream(dev).wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            static_out = step()
        step = lambda: (cuda_graph.replay(), static_out)[1]  # noqa: E731
        timed_steps(run, step, after, a.warmup - 1, dev, timed=False)
    else:
        timed_steps(run, step, after, a.warmup, dev, timed=False)
    timed_steps(run, step, after, a.steps, dev)
    if a.profile:
        run.profile = kernel_profile(step, after, dev)
    return run


def run_torch(ours, batch, ctx, a, compiled):
    """The gpt-fast-style model on ours' weights: prefill (eager) or random KV, then decode steps,
    compiled (reduce-overhead, fullgraph) or eager."""
    dev, cfg = ours.device, ours.cfg
    model = TorchLlama(ours, batch, ctx + a.warmup + a.steps + 1)
    prompts = start_tokens(cfg, batch, ctx, a.seed, dev)
    if prompts is None:
        g = torch.Generator(dev).manual_seed(a.seed + 3)
        for layer in model.layers:
            layer.k_cache[:, :, :ctx].normal_(generator=g)
            layer.v_cache[:, :, :ctx].normal_(generator=g)
        run = Run(None, *random_start(cfg, batch, a.seed, dev))
    else:
        logits = model(torch.tensor(prompts, device=dev), torch.arange(ctx, device=dev))[:, -1]
        run = Run(logits, *ds._top2(logits))
    tok_in, pos = run.toks[0].clone(), torch.tensor([ctx], device=dev)
    if compiled:
        torch._dynamo.mark_static_address(tok_in)
        torch._dynamo.mark_static_address(pos)
        fn = torch.compile(torch_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    else:
        fn = torch_step

    def step():
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(model, tok_in, pos)

    def after(tok, margin):
        tok_in.copy_(tok)
        pos.add_(1)

    timed_steps(run, step, after, a.warmup, dev, timed=False)
    timed_steps(run, step, after, a.steps, dev)
    if a.profile:
        run.profile = kernel_profile(step, after, dev)
    return run


# ---- the command line and the table -----------------------------------------------------------

def context(text):
    """'4k' -> 4096, '512' -> 512."""
    text = text.strip().lower()
    n = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    if n < 1:
        raise ValueError(text)
    return n


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=tuple(ds.SHAPES), default="llama-8b")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees a GPU")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    p.add_argument("--contexts", default="16", help=f"comma list of context lengths (4k = 4096); up to "
                   f"{PREFILL_MAX} a prefilled random prompt (checked), longer a random KV cache")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (>= 3 on cuda)")
    p.add_argument("--check-steps", type=int, default=8, help="greedy tokens compared with the float64 reference")
    p.add_argument("--bandwidth", type=float, metavar="GBPS", help="the rate for the bound (default on cuda: "
                   "a 2 GiB device-to-device copy, measured)")
    p.add_argument("--profile", action="store_true", help="the kernels of one more step of each, summed by name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", help="also write the table to this file")
    a = p.parse_args(argv)
    try:
        a.batches = [int(b) for b in a.batches.split(",") if b.strip()]
        a.contexts = [context(c) for c in a.contexts.split(",") if c.strip()]
    except ValueError:
        p.error("--batches and --contexts take comma lists of positive integers (a context may end in k)")
    if not a.batches or min(a.batches) < 1 or not a.contexts:
        p.error("--batches and --contexts take comma lists of positive integers")
    a.device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device visible to torch: pass --device cpu (with --shape tiny)")
    if a.steps < 1 or a.warmup < (3 if a.device.type == "cuda" else 1) or a.check_steps < 0:
        p.error("need --steps >= 1, --warmup >= 3 on cuda (1 on cpu), --check-steps >= 0")
    a.cpu = a.device.type == "cpu"  # common.main: no CUDA backend needed
    a.failed = []
    return a


def references(cfg, weights, a, contexts):
    """The float64 reference's Generation per (batch, context) checked: decode_step's Model on its
    torch ops, on the run's device, built once and dropped before anything is timed."""
    if not a.check_steps or not contexts:
        return {}
    ref_model = ds.Model(cfg, weights, a.device, torch.float64, ops=ds.Ops(ds.TorchReference(), a.device))
    refs = {}
    for batch in a.batches:
        for ctx in contexts:
            prompts = start_tokens(cfg, batch, ctx, a.seed, a.device)
            refs[batch, ctx] = ds.generate(ref_model, prompts, a.check_steps, seed=a.seed)
            print(f"  float64 reference B={batch} context {ctx}: {a.check_steps} tokens", flush=True)
    del ref_model
    release(a.device)
    return refs


def release(device):
    if device.type == "cuda":
        common.release_gpu_memory()


def verdict(refs, key, run, a, cfg, dtype):
    if key not in refs:
        return "no check (random KV)" if run.first_logits is None else ""
    ok, text = ds.compare(refs[key], run.generation(a.check_steps), ds.logit_tol(dtype, cfg))
    return ("PASS: " if ok else "FAIL: ") + text


def print_profile(title, rows, step_us):
    print(f"  {title}: one step's kernels summed by name (top {TOP_KERNELS}; step {step_us:.0f} µs)")
    total = sum(us for _, _, us in rows)
    if not rows:
        print("    (no kernel records)")
    for name, calls, us in rows[:TOP_KERNELS]:
        print(f"    {us:>9.1f} µs {us / max(total, 1e-9):>6.1%} {calls:>5}x  {name[:110]}")
    rest = rows[TOP_KERNELS:]
    if rest:
        print(f"    {sum(us for _, _, us in rest):>9.1f} µs in {len(rest)} more names")
    print(f"    {total:>9.1f} µs in all", flush=True)


def collect(a):
    cfg = ds.SHAPES[a.shape]
    cfg = replace(cfg, max_positions=max(cfg.max_positions, max(a.contexts) + a.warmup + a.steps + 2))
    dev, cuda = a.device, a.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    anchor = "torch.compile reduce-overhead" if cuda else "PyTorch eager"
    ours_name = "qkernels, CUDA graph" if cuda else "qkernels cpu"
    gbps, source = a.bandwidth, "--bandwidth"
    if not gbps and cuda:
        gbps, source = common.gpu_copy_ceiling_gbps(15), f"{common.GPU_COPY_BYTES >> 30} GiB device-to-device copy"
    machine = None if cuda else "the host CPU"
    timing = "CUDA events around each step's replay" if cuda else "wall-clock per step"
    header = common.header(
        "decode_step", f"pure PyTorch ({anchor})",
        f"shape {a.shape}: {ds.asdict(cfg)}; {str(dtype).replace('torch.', '')}",
        f"{a.steps} steps timed after {a.warmup}, {timing}, median; "
        + (f"bound rate {gbps:.0f} GB/s ({source})" if gbps else "no bound rate (give --bandwidth)"),
        machine=machine)

    with torch.no_grad():
        weights = ds.build_weights(a.seed, cfg, dev)
        refs = references(cfg, weights, a, [c for c in a.contexts if c <= PREFILL_MAX])
        with qkernels.use_backend(llm="cuda" if cuda else "cpu"):
            ours = ds.Model(cfg, weights, dev, dtype)
        del weights
        wbytes = ours.weight_bytes()
        kv_token_bytes = 2 * cfg.layers * ours.kv_heads * cfg.head_dim * ours.embed.element_size()
        print(f"weights read per step: {wbytes / 1e9:.2f} GB"
              + (f" = {wbytes / gbps / 1e6:.2f} ms at {gbps:.0f} GB/s" if gbps else ""), flush=True)
        rows, rates, profiles = [], [], []
        for ctx in a.contexts:
            for batch in a.batches:
                case = f"{a.shape} B={batch} ctx {ctx}"
                nbytes = wbytes + batch * (ctx + a.warmup + a.steps // 2) * kv_token_bytes
                print(f"\n{case}: {nbytes / 1e9:.2f} GB per step", flush=True)
                runs = {}
                for name in (ours_name, anchor):
                    try:
                        if name == ours_name:
                            with qkernels.use_backend(llm="cuda" if cuda else "cpu"):
                                runs[name] = run_ours(ours, batch, ctx, a, graph=cuda)
                        else:
                            torch._dynamo.reset()  # each case compiles afresh
                            runs[name] = run_torch(ours, batch, ctx, a, compiled=cuda)
                    except Exception as exc:  # a refused capture, a compile failure: report, go on
                        print(f"  {name}: {common.describe(exc)}: {common.first_line(exc)}", flush=True)
                        runs[name] = exc
                    torch._dynamo.reset()  # drops the graphs and their pools (KV caches of 34 GB at 32k x 8)
                    release(dev)
                ours_us = None
                for name, run in runs.items():
                    if isinstance(run, Exception):
                        a.failed.append(f"{case} {name}: {common.describe(run)}")
                        rows.append(common.Row("decode step", case, name, None, None, None, None, "",
                                               common.describe(run)))
                        continue
                    us = statistics.median(run.ms) * 1e3
                    ours_us = us if name == ours_name else ours_us
                    rate = nbytes / us / 1e3
                    target = TARGETS_US.get((a.shape, batch)) if name == ours_name and ctx <= PREFILL_MAX else None
                    check = verdict(refs, (batch, ctx), run, a, cfg, dtype)
                    if check.startswith("FAIL"):
                        a.failed.append(f"{case} {name}: check FAIL")
                    rows.append(common.Row(
                        "decode step", case, name, us, rate, 100 * rate / gbps if gbps else None,
                        us / ours_us if name != ours_name and ours_us else None,
                        f"<={target:.0f} µs {'met' if us <= target else 'MISSED'}" if target else "", check))
                    rates.append(f"{case} {name}: {batch * 1e6 / us:.1f} tok/s")
                    print(f"  {name:<30} {us / 1e3:8.3f} ms/step {batch * 1e6 / us:9.1f} tok/s"
                          + (f" {100 * rate / gbps:5.1f}% of bound ({nbytes / gbps / 1e6:.2f} ms)" if gbps else "")
                          + (f"  {check}" if check else ""), flush=True)
                    if run.profile:
                        profiles.append((f"{case}, {name}", run.profile, us))
                del runs
                release(dev)
        for title, prof, us in profiles:
            print_profile(title, prof, us)
    footer = ["tokens/s (B / step time): " + "; ".join(rates),
              "% bound: (weights + the KV read at the mean timed length) / step time, as a share of the bound "
              "rate; anchor/ours: PyTorch's step time / ours (>1: qkernels faster)"]
    return header, rows, footer


def main(argv=None):
    """The table; exit status 1 where a model failed its check or could not run."""
    args = []
    common.main(lambda: args.append(parse_args(argv)) or args[0], collect, COLUMNS)
    if args[0].failed:
        print("decode_step FAILED: " + "; ".join(args[0].failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
