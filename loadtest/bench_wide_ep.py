"""Wide-EP on this host: the time of one MoE layer split into dispatch, expert compute and
combine at 2 and 4 ranks (gloo on 127.0.0.1), and decode tokens/s of one DEP2 group against two
independent workers, in one run.

Every rank is its own process with one torch thread. The layer timing runs the `small` preset's
first MoE layer on 64 tokens per rank (a decode step's worth), with a barrier before each
iteration so that the phases line up. The throughput part runs 32 greedy requests per rank
(prompts 32..256, 64 output tokens): a DEP2 group (experts split over the two ranks, tokens
exchanged) against two engines that each hold every expert.

    python loadtest/bench_wide_ep.py            # writes loadtest/results/wide_ep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import record, write_result

from ferry import kernels as ops
from ferry.infra.ports import free_port
from ferry.services.engine import Engine, EngineConfig, SamplingParams
from ferry.services.engine.expert_parallel import EPGroup, combine, dispatch
from ferry.services.engine.experts import ExpertPlacement
from ferry.services.engine.model import load_model, model_config


def _layer_rank(
    rank: int, size: int, master: str, model: str, tokens: int, iters: int, out: str
) -> None:
    torch.set_num_threads(1)
    group = EPGroup.init(size, rank, master)
    mc = model_config(model)
    placement = ExpertPlacement.spread(mc.num_moe_layers, mc.n_routed_experts, size, rank)
    m = load_model(model, placement=placement)
    m.attach_ep_group(group)
    moe = next(layer.mlp for layer in m.model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(tokens, mc.hidden_size, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {"dispatch": [], "compute": [], "combine": []}
    with torch.inference_mode():
        logits = torch.nn.functional.linear(x.float(), moe.gate.weight)
        weights, ids = ops.moe_route(
            logits,
            moe.gate.e_score_correction_bias,
            mc.num_experts_per_tok,
            mc.n_group,
            mc.topk_group,
            mc.norm_topk_prob,
            mc.routed_scaling_factor,
        )
        slots = placement.select_slots(moe.moe_layer, ids)
        for i in range(iters + 3):
            dist.barrier()
            t0 = time.perf_counter()
            d = dispatch(x, slots, weights, placement.slots_per_rank, group)
            t1 = time.perf_counter()
            y = ops.fused_moe(
                d.hidden,
                moe.experts.w13,
                moe.experts.w2,
                d.weights[:, None],
                d.local_slots[:, None],
            )
            t2 = time.perf_counter()
            combine(y, d, group)
            t3 = time.perf_counter()
            if i >= 3:  # warm-up
                for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    times[k].append(v)
    Path(out, f"layer-{size}-{rank}.json").write_text(json.dumps(times))
    group.close()


def _decode_rank(
    rank: int, size: int, master: str, dep: bool, model: str, n: int, out: str
) -> None:
    torch.set_num_threads(1)
    group = EPGroup.init(size, rank, master)
    mc = model_config(model)
    cfg = EngineConfig(model=model, block_size=16, num_kv_blocks=1024)
    if dep:
        placement = ExpertPlacement.spread(mc.num_moe_layers, mc.n_routed_experts, size, rank)
        engine = Engine(cfg, placement, group)
    else:
        engine = Engine(cfg)
    gen = torch.Generator().manual_seed(rank)
    prompts = [
        torch.randint(
            1, 250, (int(torch.randint(32, 257, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    dist.barrier()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    dist.barrier()  # both ranks done: the run's wall time
    seconds = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    Path(out, f"decode-{'dep' if dep else 'solo'}-{rank}.json").write_text(
        json.dumps({"tokens": tokens, "seconds": seconds})
    )
    group.close()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--model", default="small")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank in the layer timing")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--requests", type=int, default=32, help="per rank, in the decode run")
    p.add_argument("--out", default="loadtest/results/wide_ep.json")
    args = p.parse_args()
    result: dict[str, object] = {
        **record(),
        "model": args.model,
        "layer": {},
        "decode": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for size in (2, 4):
            master = f"127.0.0.1:{free_port()}"
            mp.spawn(
                _layer_rank,
                args=(size, master, args.model, args.tokens, args.iters, tmp),
                nprocs=size,
                join=True,
            )
            ranks = [
                json.loads(Path(tmp, f"layer-{size}-{r}.json").read_text()) for r in range(size)
            ]
            row = {
                k: statistics.median(t for rk in ranks for t in rk[k]) * 1e3
                for k in ("dispatch", "compute", "combine")
            }
            result["layer"][f"{size}_ranks"] = {f"{k}_ms": v for k, v in row.items()}  # type: ignore[index]
            print(
                f"{size} ranks, one MoE layer, {args.tokens} tokens/rank: "
                + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()),
                flush=True,
            )
        for dep in (True, False):
            master = f"127.0.0.1:{free_port()}"
            mp.spawn(
                _decode_rank,
                args=(2, master, dep, args.model, args.requests, tmp),
                nprocs=2,
                join=True,
            )
            name = "dep" if dep else "solo"
            ranks = [json.loads(Path(tmp, f"decode-{name}-{r}.json").read_text()) for r in range(2)]
            tps = sum(r["tokens"] for r in ranks) / max(r["seconds"] for r in ranks)
            key = "dep2_group" if dep else "two_independent_workers"
            result["decode"][key] = {"output_tokens_per_s": tps, "requests": 2 * args.requests}  # type: ignore[index]
            print(f"decode, {key}: {tps:.0f} tokens/s", flush=True)
    d = result["decode"]
    result["dep2_over_independent"] = (
        d["dep2_group"]["output_tokens_per_s"]  # type: ignore[index]
        / d["two_independent_workers"]["output_tokens_per_s"]
    )  # type: ignore[index]
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
