"""Greedy generation with a decoder-only transformer on qkernels' LLM ops.

The model: randomly initialised from a seed (build_weights), Llama-shaped; --shape picks the size
(small, the default; tiny; llama-8b: 32 layers, hidden 4096, 32/8 heads of 128, MLP 14336, vocab
32000, 14.2 GB of bfloat16 weights read per step). Per layer: one fused q/k/v projection
(qkernels.linear, with bias), rotary embedding on q and k fused with the append of k and v to a
token-pool KV cache (qkernels.rotary_kv_append, rotate-half / NeoX convention: pairs
(x[i], x[i + D/2])), attention over the pool, the out projection (qkernels.linear, with bias), the
residual add and RMSNorm in one call (qkernels.fused_add_rmsnorm), the SwiGLU MLP (qkernels.swiglu,
then qkernels.linear for the down projection), and again the residual add with the next RMSNorm: the
next layer's attention norm, after the last layer the final norm. The residual stream is one buffer
(the embedded tokens) that fused_add_rmsnorm updates in place; only the first layer's norm is a
plain qkernels.rmsnorm. The LM head (qkernels.linear) gives the logits; the next token is their
argmax. The embedding lookup and top-2 are torch.

The KV cache is a token pool as in SGLang: per layer a K and a V pool [S, Hkv, D]; request b's token
j lives in slot req_to_token[req_pool_indices[b], j], slots taken from a shuffled free list so no
request's tokens are contiguous. rotary_kv_append writes each token's K/V at its slot (the prompt's
at prefill, the new token's at each decode step, position len - 1); then qkernels.attn_paged_prefill
(causal, ragged batch through qo_indptr/kv_indptr) or qkernels.attn_paged_decode reads the pools.
(With the flash backend, qkernels.rotary_emb rotates q and k and the K/V go into the pools by
indexing.)

Backends.  The dispatcher decides per call: ASTR_BACKEND=cuda|flash|cpu|auto (or QKERNELS_OPS)
selects for the LLM families and this script reports which backend served each op (from
qkernels.resolve on the op's first call).  flash implements only attention and only over
contiguous caches, so when the environment selects it the other families stay on the automatic
chain and attention gathers each request's K/V from the pool into a dense [B, L, Hkv, D] cache for
qkernels.attn_prefill / attn_decode.

The decode figure is ms/step beside the weight-read bound: the bytes one step must read (every
weight but the embedding table) over the device-to-device copy rate, measured on the GPU (or given
by --bandwidth).  benchmarks/decode_step.py times the step itself (CUDA events around a graph
replay) beside a pure PyTorch model under torch.compile.

--check runs the same generation on every available backend (cuda and flash in bfloat16 on the
GPU, cpu in float32 on CPU copies of the weights) and on a float64 torch reference, and compares
each with the reference by the rule in compare() (first-token logits within a tolerance; greedy
tokens equal wherever the reference's top-2 margin is clear of it).

    python examples/decode_step.py [--shape llama-8b] [--tokens 16] [--batch 4] [--profile] [--check] [--graph]
    ASTR_BACKEND=cpu python examples/decode_step.py --device cpu

The examples import the installed qkernels (`pip install .`), from any directory; in a source
checkout built in place, put it on the path: PYTHONPATH=. python examples/...
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

# torch's OpenMP threads spin after each parallel region (libgomp's active wait), taking the cores
# from qkernels' CPU threads that run next: on 2 cores prefill took 3x as long.  Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qkernels  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Config:
    layers: int = 4
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 2816
    vocab: int = 4096
    rope_theta: float = 10000.0
    max_positions: int = 4096
    norm_eps: float = 1e-6


SHAPES = {
    "small": Config(),
    "tiny": Config(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=512),
    "llama-8b": Config(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=32000),
}


def build_weights(seed, cfg, device="cpu"):
    """The full (unsharded) weights, drawn from a seed on `device`: float32 on the CPU (the same
    numbers for a seed on every machine), bfloat16 on a GPU (the same on GPUs of one kind; llama-8b's
    7.2e9 values then need neither 29 GB of host memory nor a host-to-device copy).

    Linear weights are [out, in] with std 1/sqrt(in), so activations keep unit scale; q/k/v and
    o_proj carry biases (o_proj's shows how a row-parallel bias is added once under TP).  Every value
    is rounded through bfloat16, so bf16, fp16 and fp32 runs start from the same numbers and a
    comparison between them measures arithmetic only."""
    device = torch.device(device)
    g = torch.Generator(device).manual_seed(seed)
    store = torch.float32 if device.type == "cpu" else torch.bfloat16
    H, D, Hq, Hkv, Im = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.intermediate

    def normal(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=g, device=device) * std + mean).bfloat16().to(store)

    w = {"embed": normal(cfg.vocab, H), "final_norm": normal(H, std=0.1, mean=1.0),
         "lm_head": normal(cfg.vocab, H, std=H**-0.5)}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        w[p + "attn_norm"] = normal(H, std=0.1, mean=1.0)
        w[p + "wq"] = normal(Hq * D, H, std=H**-0.5)
        w[p + "wk"] = normal(Hkv * D, H, std=H**-0.5)
        w[p + "wv"] = normal(Hkv * D, H, std=H**-0.5)
        w[p + "bq"] = normal(Hq * D, std=0.1)
        w[p + "bk"] = normal(Hkv * D, std=0.1)
        w[p + "bv"] = normal(Hkv * D, std=0.1)
        w[p + "wo"] = normal(H, Hq * D, std=(Hq * D) ** -0.5)
        w[p + "bo"] = normal(H, std=0.1)
        w[p + "mlp_norm"] = normal(H, std=0.1, mean=1.0)
        w[p + "w_gate"] = normal(Im, H, std=H**-0.5)
        w[p + "w_up"] = normal(Im, H, std=H**-0.5)
        w[p + "w_down"] = normal(H, Im, std=Im**-0.5)
    return w


def rope_table(cfg, device):
    """freqs_cis [max_positions, D/2, 2] float32: (cos, sin) of position * theta^(-2i/D), made in float64."""
    inv = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    ang = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.stack([ang.cos(), ang.sin()], -1).float().to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- op calls: which backend served them, and (with --profile) how long they took ----------

class Ops:
    """Calls the ops of `impl` (the qkernels module, or TorchReference) by name.

    The first call of each op asks qkernels.resolve which backend takes it, so the report shows the
    dispatcher's own answer.  With profile=True every call is timed, synchronising the device before
    and after so the time is the op's own (this costs throughput; without it only totals are kept)."""

    def __init__(self, impl=qkernels, device=torch.device("cpu"), profile=False):
        self.impl, self.device, self.profile = impl, device, profile
        self.backends = {}
        self.times = defaultdict(float)
        self.calls = defaultdict(int)

    def __call__(self, name, *args, **kwargs):
        fn = getattr(self.impl, name)
        if name not in self.backends:
            self.backends[name] = self._backend(name, args, kwargs)
        if not self.profile:
            return fn(*args, **kwargs)
        sync(self.device)
        t0 = time.perf_counter()
        r = fn(*args, **kwargs)
        sync(self.device)
        self.times[name] += time.perf_counter() - t0
        self.calls[name] += 1
        return r

    def timed(self, name, fn, *args):
        """A non-qkernels step that belongs in the profile (TP's all_reduce)."""
        self.backends.setdefault(name, "torch.distributed")
        if not self.profile:
            return fn(*args)
        sync(self.device)
        t0 = time.perf_counter()
        r = fn(*args)
        sync(self.device)
        self.times[name] += time.perf_counter() - t0
        self.calls[name] += 1
        return r

    def _backend(self, name, args, kwargs):
        if self.impl is not qkernels:
            return self.impl.name
        d = qkernels.resolve(name, *args, **kwargs)
        if d.winner is None:
            return f"none: {d.error}"
        return d.winner + (" staged through host memory" if d.staged else "") + f" ({d.origin})"


class TorchReference:
    """The ops in plain torch (use it in float64): the yardstick for --check."""

    name = "torch reference"

    @staticmethod
    def linear(x, weight, bias=None):
        return F.linear(x, weight, bias)

    @staticmethod
    def swiglu(x, up_weight, gate_weight):
        return F.linear(x, up_weight) * F.silu(F.linear(x, gate_weight))

    @staticmethod
    def rotary_emb(x, freqs_cis, *, interleaved=True, out=None):
        c, s = (freqs_cis[..., i].unsqueeze(-2).to(x.dtype) for i in (0, 1))  # broadcast over heads
        half = x.shape[-1] // 2
        xe, xo = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
        ye, yo = xe * c - xo * s, xe * s + xo * c
        y = torch.stack([ye, yo], -1).flatten(-2) if interleaved else torch.cat([ye, yo], -1)
        return y if out is None else out.copy_(y)

    @classmethod
    def rotary_kv_append(cls, q, k, v, cos_sin, positions, k_pool, v_pool, slots, *, interleaved=True, out=None):
        f, s = cos_sin[positions.long()], slots.long()
        k_pool[s], v_pool[s] = cls.rotary_emb(k, f, interleaved=interleaved), v
        return cls.rotary_emb(q, f, interleaved=interleaved, out=out)

    @staticmethod
    def rmsnorm(x, weight, *, eps=1e-6):
        return rmsnorm(x, weight, eps)

    @staticmethod
    def fused_add_rmsnorm(x, residual, weight, *, eps=1e-6):
        return rmsnorm(residual.add_(x), weight, eps)

    @staticmethod
    def _attend(q, k, v, causal):
        """q [Lq, Hq, D], k/v [L, Hkv, D]; causal bottom-right (query i sees keys j <= i + L - Lq)."""
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        if causal:
            Lq, L = q.shape[0], k.shape[0]
            pos = torch.arange(max(L, Lq), device=q.device)
            keep = pos[None, :L] <= pos[:Lq, None] + (L - Lq)
            s = s.masked_fill(~keep, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    @classmethod
    def attn_paged_prefill(cls, q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, qo_indptr,
                           *, is_causal=False):
        out = torch.zeros_like(q)
        for b in range(len(req_pool_indices)):
            slots = req_to_token[req_pool_indices[b], :kv_indptr[b + 1] - kv_indptr[b]].long()
            rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
            out[rows] = cls._attend(q[rows], k_cache[slots], v_cache[slots], is_causal)
        return out

    @classmethod
    def attn_paged_decode(cls, q, k_cache, v_cache, req_to_token, req_pool_indices, kv_indptr, *, new_k=None,
                          new_v=None):
        out = torch.zeros_like(q)
        for b in range(len(req_pool_indices)):
            slots = req_to_token[req_pool_indices[b], :kv_indptr[b + 1] - kv_indptr[b]].long()
            if new_k is not None:
                k_cache[slots[-1]], v_cache[slots[-1]] = new_k[b], new_v[b]
            out[b] = cls._attend(q[b:b + 1], k_cache[slots], v_cache[slots], False)[0]
        return out


# ---- the model ------------------------------------------------------------------------------

class KVCache:
    """Per layer K and V token pools [S, Hkv, D]; req_to_token [R, max_ctx] int32 maps (request row,
    position) to a slot.  Slots come from a seeded shuffled free list, and request b is row
    req_pool_indices[b] of a table with spare rows, so neither mapping is the identity."""

    def __init__(self, model, batch, max_ctx, num_slots, seed=0):
        g = torch.Generator().manual_seed(seed)
        dev, Hkv, D = model.device, model.kv_heads, model.cfg.head_dim
        self.free = torch.randperm(num_slots, generator=g).tolist()
        rows = torch.randperm(batch + 2, generator=g)[:batch]
        # -1 marks positions no request holds yet: the cpu backend rejects reading one (ValueError)
        self.req_to_token = torch.full((batch + 2, max_ctx), -1, dtype=torch.int32, device=dev)
        self.req_pool_indices = rows.to(torch.int32).to(dev)
        self.rows = rows.tolist()
        self.lens = [0] * batch
        self.k = [torch.zeros(num_slots, Hkv, D, dtype=model.dtype, device=dev) for _ in range(model.cfg.layers)]
        self.v = [torch.zeros_like(k) for k in self.k]

    def append(self, counts):
        """Give request b counts[b] more positions (slots off the free list) -> their slots, request order."""
        rows, pos, slots = [], [], []
        for b, n in enumerate(counts):
            rows += [self.rows[b]] * n
            pos += range(self.lens[b], self.lens[b] + n)
            slots += [self.free.pop() for _ in range(n)]
            self.lens[b] += n
        dev = self.req_to_token.device
        slots = torch.tensor(slots, dtype=torch.int64)
        self.req_to_token[torch.tensor(rows, device=dev), torch.tensor(pos, device=dev)] = slots.to(dev, torch.int32)
        return slots.to(dev)

    def indptr(self):
        """kv_indptr [B+1] int32 on the host: prefix sums of the lengths."""
        return torch.tensor([0] + list(_cumsum(self.lens)), dtype=torch.int32)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def rmsnorm(x, weight, eps):
    """Llama's RMSNorm in torch: the statistics in float32 (or wider), the output in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Model:
    """The transformer on one device.  The head counts and MLP width come from the weight shapes, so
    a tensor-parallel shard (tp_decode.py) is the same class with sliced weights and a `reduce`
    (all_reduce) after the row-parallel projections; a row-parallel bias is then given on one rank only.

    attention="paged" uses attn_paged_prefill / attn_paged_decode on the pools; "dense" gathers each
    request's K/V from the pools for attn_prefill / attn_decode (for the flash backend)."""

    def __init__(self, cfg, weights, device, dtype, ops=None, attention="paged", reduce=None):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.ops = ops or Ops(device=self.device)
        self.attention, self.reduce = attention, reduce
        D = cfg.head_dim

        def t(x):
            return None if x is None else x.to(self.device, dtype).contiguous()

        self.embed = t(weights["embed"])
        self.final_norm, self.lm_head = t(weights["final_norm"]), t(weights["lm_head"])
        self.layers = []
        for i in range(cfg.layers):
            p = f"layers.{i}."
            w = {k: weights.get(p + k) for k in ("attn_norm", "wo", "bo", "mlp_norm", "w_gate", "w_up", "w_down")}
            # One projection for q, k and v: one weight read and one launch instead of three.
            w["w_qkv"] = torch.cat([weights[p + "wq"], weights[p + "wk"], weights[p + "wv"]])
            w["b_qkv"] = torch.cat([weights[p + "bq"], weights[p + "bk"], weights[p + "bv"]])
            self.layers.append({k: t(v) for k, v in w.items()})
        self.heads = weights["layers.0.wq"].shape[0] // D
        self.kv_heads = weights["layers.0.wk"].shape[0] // D
        self.freqs = rope_table(cfg, self.device)

    def _reduced(self, x):
        return x if self.reduce is None else self.ops.timed("all_reduce", self.reduce, x)

    def _layers(self, residual, rotate, attend):
        """residual [T, H]: the embedded tokens, the residual stream, updated in place -> the final
        norm of the stream.  Each residual add is fused with the norm that follows it.  rotate(i, q,
        k, v) rotates q and k in place (and may append k, v to layer i's pools); attend(i, q, k, v)."""
        Hq, Hkv, D, T = self.heads, self.kv_heads, self.cfg.head_dim, residual.shape[0]
        op, eps = self.ops, self.cfg.norm_eps
        next_norms = [w["attn_norm"] for w in self.layers[1:]] + [self.final_norm]
        h = op("rmsnorm", residual, self.layers[0]["attn_norm"] if self.layers else self.final_norm, eps=eps)
        for i, w in enumerate(self.layers):
            qkv = op("linear", h, w["w_qkv"], w["b_qkv"])
            q = qkv[:, :Hq * D].view(T, Hq, D)
            k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
            rotate(i, qkv, q, k, v)
            o = op("linear", attend(i, q, k, v).reshape(T, Hq * D), w["wo"], w["bo"])
            h = op("fused_add_rmsnorm", self._reduced(o), residual, w["mlp_norm"], eps=eps)
            m = op("swiglu", h, w["w_up"], w["w_gate"])
            d = op("linear", m, w["w_down"])
            h = op("fused_add_rmsnorm", self._reduced(d), residual, next_norms[i], eps=eps)
        return h

    def _rotate(self, cache, positions, slots):
        """-> rotate(i, qkv, q, k, v) for _layers.  Paged: rotary_kv_append rotates q and k and writes
        k, v at `slots` of layer i's pools in one kernel.  Dense (the flash path): rotary_emb on q and
        k, which are adjacent in a qkv row, so one in-place call covers both (rows strided)."""
        Hq, Hkv, D = self.heads, self.kv_heads, self.cfg.head_dim
        if self.attention == "paged":
            def rotate(i, qkv, q, k, v):
                self.ops("rotary_kv_append", q, k, v, self.freqs, positions, cache.k[i], cache.v[i], slots,
                         interleaved=False, out=q)
            return rotate
        freqs = self.freqs[positions.long()]

        def rotate(i, qkv, q, k, v):
            qk = qkv[:, :(Hq + Hkv) * D].view(qkv.shape[0], Hq + Hkv, D)
            self.ops("rotary_emb", qk, freqs, interleaved=False, out=qk)
        return rotate

    def weight_bytes(self):
        """The weight bytes one decode step reads: every weight but the embedding table (B rows)."""
        tensors = [t for w in self.layers for t in w.values() if t is not None] + [self.final_norm, self.lm_head]
        return sum(t.nbytes for t in tensors)

    def prefill(self, tokens, positions, cache, slots, qo_indptr, kv_indptr, last_rows):
        """A ragged batch of whole prompts: tokens/positions/slots [T] (request after request),
        qo_indptr = kv_indptr [B+1] int32 -> logits [B, V] at each request's last token."""
        op, r2t, rpi = self.ops, cache.req_to_token, cache.req_pool_indices

        def attend(i, q, k, v):
            if self.attention == "paged":  # k, v are in the pools already (rotary_kv_append)
                return op("attn_paged_prefill", q, cache.k[i], cache.v[i], r2t, rpi, kv_indptr, qo_indptr,
                          is_causal=True)
            cache.k[i][slots], cache.v[i][slots] = k, v
            bounds = qo_indptr.tolist()  # dense: one call per request (flash_attn_func takes no ragged batch)
            return torch.cat([op("attn_prefill", q[None, a:b], k[None, a:b], v[None, a:b], is_causal=True)[0]
                              for a, b in zip(bounds, bounds[1:])])

        h = self._layers(self.embed[tokens], self._rotate(cache, positions, slots), attend)
        return self.ops("linear", h[last_rows], self.lm_head)

    def decode(self, tokens, cache, kv_indptr, max_len=None):
        """One new token per request: tokens [B]; kv_indptr [B+1] int32 counts it -> logits [B, V].
        Positions come from kv_indptr on the device, so a captured graph follows changing lengths.
        max_len (a host int) is needed by attention="dense" only."""
        op, r2t, rpi = self.ops, cache.req_to_token, cache.req_pool_indices
        lens = kv_indptr[1:] - kv_indptr[:-1]
        positions = lens - 1
        slots = r2t[rpi.long(), positions.long()]  # where each request's new token goes
        if self.attention != "paged":  # the same for every layer: once per step
            slot_rows = slots.long()
            table = r2t[rpi.long(), :max_len].long().clamp_min(0)  # -1 past a length: masked by kv_lens

        def attend(i, q, k, v):
            if self.attention == "paged":  # k, v are in the pools already (rotary_kv_append)
                return op("attn_paged_decode", q, cache.k[i], cache.v[i], r2t, rpi, kv_indptr)
            cache.k[i][slot_rows], cache.v[i][slot_rows] = k, v
            return op("attn_decode", q[:, None], cache.k[i][table], cache.v[i][table], kv_lens=lens)[:, 0]

        h = self._layers(self.embed[tokens], self._rotate(cache, positions, slots), attend)
        return self.ops("linear", h, self.lm_head)


# ---- generation -----------------------------------------------------------------------------

@dataclass
class Generation:
    tokens: list            # [B][N] greedy tokens
    margins: torch.Tensor   # [B, N] float64: top-1 minus top-2 logit at each step
    first_logits: torch.Tensor  # [B, V] float64: the logits that chose the first new token
    prefill_s: float
    decode_s: float
    prompt_tokens: int


def make_prompts(seed, cfg, batch, min_len, max_len):
    """batch prompts of lengths spread evenly over [min_len, max_len], random token ids."""
    g = torch.Generator().manual_seed(seed + 1)
    lens = [min_len + (max_len - min_len) * b // max(batch - 1, 1) for b in range(batch)]
    return [torch.randint(0, cfg.vocab, (n,), generator=g).tolist() for n in lens]


def _top2(logits):
    top = logits.float().topk(2, dim=-1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


def generate(model, prompts, new_tokens, *, seed=0, graph=False):
    """Greedy generation: one prefill over all prompts, then new_tokens - 1 decode steps.

    graph=True (cuda): the first decode step runs eagerly (the warm-up), the second is captured in a
    torch.cuda.CUDAGraph and every later step replays it after writing the new slot into req_to_token
    and the new lengths into kv_indptr in place."""
    dev, B = model.device, len(prompts)
    lens = [len(p) for p in prompts]
    cache = KVCache(model, B, max(lens) + new_tokens, sum(lens) + B * new_tokens + B, seed)
    out_tok = torch.zeros(B, new_tokens, dtype=torch.int64, device=dev)
    out_margin = torch.zeros(B, new_tokens, dtype=torch.float32, device=dev)

    sync(dev)
    t0 = time.perf_counter()
    slots = cache.append(lens)
    indptr = cache.indptr().to(dev)
    tokens = torch.tensor([t for p in prompts for t in p], device=dev)
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    logits = model.prefill(tokens, positions, cache, slots, indptr, indptr, (indptr[1:] - 1).long())
    out_tok[:, 0], out_margin[:, 0] = _top2(logits)
    sync(dev)
    prefill_s = time.perf_counter() - t0
    first_logits = logits.double().cpu()

    # Static inputs of a decode step: a captured graph reads them at replay, so they change in place.
    tok_in = out_tok[:, 0].clone()
    indptr_in = torch.zeros(B + 1, dtype=torch.int32, device=dev)

    def step():
        return _top2(model.decode(tok_in, cache, indptr_in, max(cache.lens)))

    cuda_graph, static_out = None, None
    t0 = time.perf_counter()
    for t in range(1, new_tokens):
        cache.append([1] * B)
        indptr_in.copy_(cache.indptr())
        if not graph:
            tok, margin = step()
        elif t == 1:  # warm-up on a side stream, as torch.cuda.graphs asks before capture
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                tok, margin = step()
            torch.cuda.current_stream(dev).wait_stream(side)
        else:
            if cuda_graph is None:  # captured once; the capture's time is not decode time
                sync(dev)
                c0 = time.perf_counter()
                cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cuda_graph):
                    static_out = step()
                sync(dev)
                t0 += time.perf_counter() - c0
            cuda_graph.replay()
            tok, margin = static_out
        out_tok[:, t], out_margin[:, t] = tok, margin
        tok_in.copy_(tok)
    sync(dev)
    decode_s = time.perf_counter() - t0
    return Generation(out_tok.tolist(), out_margin.double().cpu(), first_logits, prefill_s, decode_s, sum(lens))


# ---- comparing runs -------------------------------------------------------------------------

# Tolerance on logits, in units of the reference logits' standard deviation.  The largest error over
# the B x V first-token logits at the default size, seeds 0-2, measured with the cpu backend (which
# rounds like the cuda kernels: fp32 sums, one rounding per op output): float32 2.5e-6, float16
# 5.1e-3, bfloat16 4.1e-2 (8 mantissa bits, ~10 roundings a layer).  The tolerances are 2.5-40x those.
LOGIT_TOL = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 2e-2}


def logit_tol(dtype, cfg):
    """LOGIT_TOL for cfg's depth: rounding errors add up like a random walk over the layers, so a
    model deeper than the default's 4 layers gets sqrt(layers / 4) times the tolerance."""
    return LOGIT_TOL[dtype] * math.sqrt(max(1.0, cfg.layers / Config().layers))


def compare(ref, run, tol):
    """Check run against ref -> (ok, text).

    1. The first new token's logits: both runs see the same prompt, so max|run - ref| must be at most
       tol * std(ref logits).
    2. The greedy tokens: if every logit is within eps = tol * std of the reference, the argmax can
       only change where the reference's top-2 margin is at most 2 * eps.  Tokens must therefore be
       equal at every step whose reference margin exceeds 2 * eps; at a step where they differ and
       the margin is within 2 * eps (a near-tie), the two continuations legitimately part, and that
       sequence is compared no further."""
    scale = ref.first_logits.std().item()
    err = (run.first_logits - ref.first_logits).abs().max().item() / scale
    ok, notes = err <= tol, [f"first-token logits max err {err:.2e} x std (tol {tol:.0e})"]
    tie = 2 * tol * scale
    compared, parted = 0, 0
    for b, (rt, ot) in enumerate(zip(ref.tokens, run.tokens)):
        for t, (x, y) in enumerate(zip(rt, ot)):
            if x == y:
                compared += 1
                continue
            margin = ref.margins[b, t].item()
            if margin <= tie:
                parted += 1
                notes.append(f"seq {b} parts at step {t} on a near-tie (margin {margin:.3g} <= {tie:.3g})")
            else:
                ok = False
                notes.append(f"seq {b} step {t}: token {y} != {x} with a clear margin {margin:.3g} > {tie:.3g}")
            break
    notes.insert(1, f"{compared} tokens equal, {parted} sequences parted at near-ties")
    return ok, "; ".join(notes)


# ---- the command line -----------------------------------------------------------------------

MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


def add_model_args(p):
    p.add_argument("--shape", choices=tuple(SHAPES), default="small",
                   help="the model's size; the options below change one field of it")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int, help="query heads")
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--intermediate", type=int, help="SwiGLU MLP width")
    p.add_argument("--vocab", type=int)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--min-len", type=int, default=5, help="shortest prompt")
    p.add_argument("--max-len", type=int, default=40, help="longest prompt")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees a GPU")
    p.add_argument("--dtype", choices=("auto",) + tuple(DTYPES), default="auto",
                   help="auto: bfloat16 on cuda, float32 on cpu (the cpu backend takes float32)")
    p.add_argument("--profile", action="store_true", help="time every op (synchronising around it)")


def config_from_args(a):
    return replace(SHAPES[a.shape], **{f: getattr(a, f) for f in MODEL_FIELDS if getattr(a, f) is not None})


def device_and_dtype(a):
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[a.dtype] if a.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


def environment_plan(device, dtype, cfg):
    """(context manager, attention mode, notes) that make the environment's selection runnable.

    ASTR_BACKEND=flash (or QKERNELS_OPS=attention=flash) is strict: flash has no linear, rotary,
    swiglu or rmsnorm and no token-pool attention.  Asked on a sample call, the dispatcher says so; then the
    other families go back to the automatic chain and attention takes the dense path."""
    q = torch.zeros(1, cfg.heads, cfg.head_dim, device=device, dtype=dtype)
    notes, families = [], {}
    for op, fam, args in (("linear", "linear", (q[0], q[0])), ("rotary_emb", "rotary_emb", (q, q)),
                          ("swiglu", "swiglu", (q[0], q[0], q[0])), ("rmsnorm", "rmsnorm", (q[0], q[0, 0]))):
        d = qkernels.resolve(op, *args)
        if d.winner is None and d.requested == "flash":
            families[fam] = "auto"
    if families:
        notes.append(f"flash has no {', '.join(families)} kernels: those run on the automatic chain")
    d = qkernels.resolve("attn_paged_decode", q, q, q, q, q, q)
    mode = "paged"
    if d.winner is None and d.requested == "flash":
        mode = "dense"
        notes.append("flash takes no token pool: attention gathers K/V into dense caches (attn_prefill/attn_decode)")
    ctx = qkernels.use_backend(**families) if families else contextlib.nullcontext()
    return ctx, mode, notes


def selection_problem(device, dtype, cfg, mode):
    """Why the backends selected (environment, use_backend) cannot run the model here: the
    dispatcher's message for the first op it refuses, asked on a sample call of each; or None."""
    q = torch.zeros(1, cfg.heads, cfg.head_dim, device=device, dtype=dtype)
    idx = torch.zeros(2, dtype=torch.int32, device=device)
    calls = [("linear", (q[0], q[0])), ("swiglu", (q[0], q[0], q[0])), ("rotary_emb", (q, q)),
             ("rmsnorm", (q[0], q[0, 0])), ("fused_add_rmsnorm", (q[0], q[0], q[0, 0]))]
    if mode == "paged":
        calls += [("rotary_kv_append", (q, q, q, q.float(), idx, q, q, idx))]
        calls += [("attn_paged_prefill", (q, q, q, idx, idx, idx, idx)), ("attn_paged_decode", (q, q, q, idx, idx, idx))]
    else:
        calls += [("attn_prefill", (q[:, None],) * 3), ("attn_decode", (q[:, None],) * 3)]
    for op, args in calls:
        d = qkernels.resolve(op, *args)
        if d.winner is None:
            return d.error
    return None


def backend_runs(device, dtype):
    """The runs of --check: (name, device, dtype, use_backend kwargs, attention mode)."""
    runs = []
    on_gpu = torch.cuda.is_available() and device.type == "cuda"
    half = dtype if dtype != torch.float32 else torch.bfloat16
    if on_gpu and qkernels.backend_available("cuda")[0]:
        runs.append(("cuda", device, half, {"llm": "cuda"}, "paged"))
    if on_gpu and qkernels.backend_available("flash")[0]:
        avail = qkernels.backend_available("cuda")[0]
        runs.append(("flash", device, half, {"llm": "cuda" if avail else "auto", "attention": "flash"}, "dense"))
    runs.append(("cpu", torch.device("cpu"), torch.float32, {"llm": "cpu"}, "paged"))
    return runs


def copy_rate_gbps(device, nbytes=1 << 30, reps=10):
    """Bytes read + written per second by a device-to-device copy: the rate a step that streams its
    weights can hope for (benchmarks/common.py times the same within a CUDA graph)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) * 1e6)


def report(title, gen, batch, new_tokens, ops, bound=None):
    """The run's figures; bound = (bytes a decode step reads, GB/s, where the rate comes from) adds
    the step time the bytes take at that rate, and the share of it reached."""
    dec = batch * (new_tokens - 1)
    total = gen.prefill_s + gen.decode_s
    print(f"{title}:")
    print(f"  prefill  {gen.prompt_tokens} prompt tokens in {gen.prefill_s * 1e3:.1f} ms "
          f"({gen.prompt_tokens / gen.prefill_s:.0f} tok/s)")
    if dec:
        print(f"  decode   {new_tokens - 1} steps x {batch} = {dec} tokens in {gen.decode_s * 1e3:.1f} ms "
              f"({dec / gen.decode_s:.1f} tok/s, {gen.decode_s / (new_tokens - 1) * 1e3:.2f} ms/step)")
        if bound:
            nbytes, gbps, source = bound
            bound_ms, step_ms = nbytes / gbps / 1e6, gen.decode_s / (new_tokens - 1) * 1e3
            print(f"  bound    {nbytes / 1e9:.3g} GB of weights per step at {gbps:.0f} GB/s ({source}) = "
                  f"{bound_ms:.2f} ms/step; {bound_ms / step_ms:.0%} of it reached")
    print(f"  overall  {batch * new_tokens} new tokens in {total * 1e3:.1f} ms ({batch * new_tokens / total:.1f} tok/s)")
    print("  backends: " + ", ".join(f"{k} -> {v}" for k, v in sorted(ops.backends.items())))
    if ops.profile and ops.times:
        print(f"  {'op':<20}{'calls':>7}{'ms':>10}{'share':>8}")
        for name, s in sorted(ops.times.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<20}{ops.calls[name]:>7}{s * 1e3:>10.2f}{s / total:>8.1%}")
        rest = total - sum(ops.times.values())
        print(f"  {'other':<20}{'':>7}{rest * 1e3:>10.2f}{rest / total:>8.1%}  "
              "(torch: embedding, top-2, the dense path's KV copies; Python)")
    return dec / gen.decode_s if dec else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--check", action="store_true", help="compare every available backend with a float64 reference")
    p.add_argument("--graph", action="store_true", help="replay decode steps from a CUDA graph (cuda only)")
    p.add_argument("--bandwidth", type=float, metavar="GBPS",
                   help="the rate for the weight-read bound (default on cuda: a device-to-device copy, measured)")
    a = p.parse_args(argv)
    cfg = config_from_args(a)
    device, dtype = device_and_dtype(a)
    if a.graph and device.type != "cuda":
        p.error("--graph needs --device cuda")
    if a.graph and a.profile:
        p.error("--profile times ops one launch at a time; a graph replay has none: use one or the other")
    if a.tokens < 1 or a.min_len < 1 or a.max_len < a.min_len:
        p.error("need --tokens >= 1 and 1 <= --min-len <= --max-len")

    env = {k: os.environ.get(k) for k in ("ASTR_BACKEND", "QKERNELS_OPS") if os.environ.get(k)}
    print(f"decode_step: {asdict(cfg)}")
    print(f"  batch {a.batch}, prompts {a.min_len}..{a.max_len} tokens, {a.tokens} new tokens, device {device}, "
          f"dtype {str(dtype).replace('torch.', '')}, rotary rotate-half, "
          f"env {env or 'none (automatic selection)'}, qkernels cuda available: {qkernels.AVAILABLE}")
    weights = build_weights(a.seed, cfg, device)
    prompts = make_prompts(a.seed, cfg, a.batch, a.min_len, a.max_len)
    try:
        ctx, mode, notes = environment_plan(device, dtype, cfg)  # the first dispatcher use reads the env
    except ValueError as e:
        p.error(str(e))
    for n in notes:
        print(f"  note: {n}")
    if a.graph and mode != "paged":
        p.error("--graph needs the token-pool attention (the dense path sizes its gather on the host)")

    try:
        with ctx:
            # A short warm-up run first, so the timed one pays no first-call costs (thread pools, cuBLAS).
            generate(Model(cfg, weights, device, dtype, attention=mode), prompts, min(a.tokens, 3), seed=a.seed,
                     graph=a.graph)
            ops = Ops(device=device, profile=a.profile)
            model = Model(cfg, weights, device, dtype, ops=ops, attention=mode)
            gen = generate(model, prompts, a.tokens, seed=a.seed, graph=a.graph)
    except qkernels.ExplicitSelectionError as e:  # the environment chose a backend that cannot run here
        print(f"decode_step: {e}", file=sys.stderr)
        return 2
    bound = None
    if a.bandwidth:
        bound = (model.weight_bytes(), a.bandwidth, "--bandwidth")
    elif device.type == "cuda":
        bound = (model.weight_bytes(), copy_rate_gbps(device), "device-to-device copy")
    report("run", gen, a.batch, a.tokens, ops, bound)
    for b, toks in enumerate(gen.tokens):
        print(f"  seq {b} (prompt {len(prompts[b])}): {toks}")

    if not a.check:
        return 0
    ref_ops = Ops(TorchReference())
    ref = generate(Model(cfg, weights, "cpu", torch.float64, ops=ref_ops), prompts, a.tokens, seed=a.seed)
    print("check against the float64 torch reference (rule: decode_step.compare):")
    failed = []
    for name, dev, dt, sel, amode in backend_runs(device, dtype):
        ops = Ops(device=dev)
        with qkernels.use_backend(**sel):
            run = generate(Model(cfg, weights, dev, dt, ops=ops, attention=amode), prompts, a.tokens, seed=a.seed)
        ok, text = compare(ref, run, logit_tol(dt, cfg))
        print(f"  {name:<6} {str(dt).replace('torch.', ''):<9} {'PASS' if ok else 'FAIL'}: {text}")
        print("         backends: " + ", ".join(f"{k} -> {v}" for k, v in sorted(ops.backends.items())))
        if not ok:
            failed.append(name)
    if failed:
        print(f"check FAILED: {', '.join(failed)}")
        return 1
    print("check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
