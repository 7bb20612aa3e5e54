"""decode_step.py's model, tensor-parallel over the ranks of one host.

    torchrun --nproc-per-node 2 examples/tp_decode.py                 # NCCL, one GPU per rank
    torchrun --nproc-per-node 2 examples/tp_decode.py --device cpu    # gloo, for a machine without GPUs

Megatron-style sharding of every layer: rank r holds query heads [r*Hq/ws, (r+1)*Hq/ws) and kv
heads [r*Hkv/ws, (r+1)*Hkv/ws) (the same query-to-kv grouping as the full model, so GQA stays local),
with its own KV pools for them.  q/k/v and gate/up are column-parallel (each rank computes its
heads / its slice of the MLP width, no communication); o_proj and down_proj are row-parallel (each
rank multiplies its slice of the inner dimension and an all_reduce sums the partial outputs), so
two all_reduces per layer.  A row-parallel bias is given to rank 0's linear only, so the sum holds
it once.  The embedding and LM head are replicated (a 4096-token vocabulary is small; a large one
would split the LM head by vocabulary and gather the logits).

Every rank builds the full weights from the same seed (decode_step.build_weights) and slices its
shard.  Rank 0 then runs the unsharded model (decode_step's path, on its own device) on the same
prompts and compares the greedy tokens by decode_step.compare; both throughputs are printed.  On the
CPU each rank's qkernels threads get cores / ranks cores, the 1-rank run included, so the CPU figures
compare one rank's share with all of them; the CPU mode is for testing the sharding, not for speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see decode_step.py
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast (NVLS) is off on the lent hosts
# On the CPU the ranks share the host's cores: give each its share (read when qkernels loads), as
# torchrun does for OMP_NUM_THREADS; otherwise every rank starts a thread per core.
os.environ.setdefault("QKERNELS_NUM_THREADS",
                      str(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import decode_step as ds  # noqa: E402  (this file's directory is sys.path[0])


def shard_weights(full, cfg, rank, world):
    """Rank `rank`'s slice of the full weights (float32 CPU tensors, as build_weights gives them)."""
    D = cfg.head_dim
    q = slice(rank * cfg.heads // world * D, (rank + 1) * cfg.heads // world * D)
    kv = slice(rank * cfg.kv_heads // world * D, (rank + 1) * cfg.kv_heads // world * D)
    mlp = slice(rank * cfg.intermediate // world, (rank + 1) * cfg.intermediate // world)
    w = {k: full[k] for k in ("embed", "final_norm", "lm_head")}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        w[p + "attn_norm"], w[p + "mlp_norm"] = full[p + "attn_norm"], full[p + "mlp_norm"]
        w[p + "wq"], w[p + "bq"] = full[p + "wq"][q], full[p + "bq"][q]  # column-parallel: output rows
        w[p + "wk"], w[p + "bk"] = full[p + "wk"][kv], full[p + "bk"][kv]
        w[p + "wv"], w[p + "bv"] = full[p + "wv"][kv], full[p + "bv"][kv]
        w[p + "wo"] = full[p + "wo"][:, q]  # row-parallel: input columns, partial sums reduced
        w[p + "bo"] = full[p + "bo"] if rank == 0 else None
        w[p + "w_gate"], w[p + "w_up"] = full[p + "w_gate"][mlp], full[p + "w_up"][mlp]
        w[p + "w_down"] = full[p + "w_down"][:, mlp]
    return w


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ds.add_model_args(p)
    a = p.parse_args(argv)
    cfg = ds.config_from_args(a)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, dtype = ds.device_and_dtype(a)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    # Every rank asks the dispatcher about the same calls, so all stop here alike, before any
    # process group: one line from rank 0 instead of a traceback per rank (or a rank left waiting).
    try:
        ctx, mode, _ = ds.environment_plan(device, dtype, cfg)
        with ctx:
            problem = ds.selection_problem(device, dtype, cfg, mode)
    except ValueError as e:  # a selection variable the dispatcher refuses
        problem = str(e)
    if problem:
        if rank == 0:
            print(f"tp_decode: {problem}", file=sys.stderr, flush=True)
        else:
            # torchrun stops every rank once one exits: leave rank 0 the time to say why first.
            time.sleep(2)
        return 2
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    for name, n in (("--heads", cfg.heads), ("--kv-heads", cfg.kv_heads), ("--intermediate", cfg.intermediate)):
        if n % world:
            p.error(f"{name} {n} must be a multiple of the world size {world}")

    full = ds.build_weights(a.seed, cfg)
    prompts = ds.make_prompts(a.seed, cfg, a.batch, a.min_len, a.max_len)
    ctx, mode, notes = ds.environment_plan(device, dtype, cfg)

    def all_reduce(x):
        dist.all_reduce(x)
        return x

    shard = shard_weights(full, cfg, rank, world)
    with ctx:
        ds.generate(ds.Model(cfg, shard, device, dtype, attention=mode, reduce=all_reduce), prompts,
                    min(a.tokens, 3), seed=a.seed)  # warm-up: NCCL communicators, thread pools
        dist.barrier()
        ops = ds.Ops(device=device, profile=a.profile)
        tp = ds.generate(ds.Model(cfg, shard, device, dtype, ops=ops, attention=mode, reduce=all_reduce), prompts,
                         a.tokens, seed=a.seed)
    # The slowest rank sets the pace.
    times = torch.tensor([tp.prefill_s, tp.decode_s], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    tp.prefill_s, tp.decode_s = times.tolist()

    status = torch.zeros(1, dtype=torch.int32, device=device)
    if rank == 0:
        print(f"tp_decode: {world} ranks ({dist.get_backend()}), device {device.type}, "
              f"dtype {str(dtype).replace('torch.', '')}, {ds.asdict(cfg)}")
        print(f"  batch {a.batch}, prompts {a.min_len}..{a.max_len} tokens, {a.tokens} new tokens; per rank "
              f"{cfg.heads // world}/{cfg.kv_heads // world} heads, MLP width {cfg.intermediate // world}; "
              f"env ASTR_BACKEND={os.environ.get('ASTR_BACKEND')}")
        for n in notes:
            print(f"  note: {n}")
        with ctx:
            ds.generate(ds.Model(cfg, full, device, dtype, attention=mode), prompts, min(a.tokens, 3), seed=a.seed)
            one_ops = ds.Ops(device=device, profile=a.profile)
            one = ds.generate(ds.Model(cfg, full, device, dtype, ops=one_ops, attention=mode), prompts, a.tokens,
                              seed=a.seed)
        one_rate = ds.report(f"1 {device.type}", one, a.batch, a.tokens, one_ops)
        tp_rate = ds.report(f"{world} x {device.type}, tensor-parallel (rank 0's ops)", tp, a.batch, a.tokens, ops)
        if a.tokens > 1:
            print(f"decode tok/s: 1 {device.type} {one_rate:.1f}, {world} {device.type} {tp_rate:.1f} "
                  f"({tp_rate / one_rate:.2f}x)")
        ok, text = ds.compare(one, tp, ds.LOGIT_TOL[dtype])
        print(f"TP vs 1 {device.type}: {'PASS' if ok else 'FAIL'}: {text}")
        for b, toks in enumerate(tp.tokens):
            print(f"  seq {b} (prompt {len(prompts[b])}): {toks}")
        status.fill_(0 if ok else 1)
    dist.broadcast(status, 0)  # every rank exits with rank 0's verdict
    dist.destroy_process_group()
    return int(status.item())


if __name__ == "__main__":
    sys.exit(main())
