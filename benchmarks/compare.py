"""zeroengine against the engines users would otherwise pick, side by side in one run.

Same GPT-like model (byte vocabulary; ~25M parameters, or ~100M with --size 100m), same seed and
data, world size 2 on CPU with gloo (one thread per rank), AdamW (or with --optimizer muon torch's
Muon on the blocks' matrices + AdamW on the rest, for ddp and our rows). Variants:

    ddp            torch DistributedDataParallel (the floor: same compute, no sharding)
    zero-opt       torch ZeroRedundancyOptimizer under DDP (stage-1 analogue)
    fsdp2          torch fully_shard, reshard_after_forward=True (stage-3 analogue)
    fsdp2-keep     torch fully_shard, reshard_after_forward=False (stage-2 analogue)
    ds0..ds3       DeepSpeed ZeRO stages 0-3 (when deepspeed is importable; DS_ACCELERATOR=cpu)
    ds2-off ds3-off  DeepSpeed stage 2/3 with offload_optimizer (DeepSpeedCPUAdam)
    ze0..ze3       zeroengine stages 0-3 (stage 3 built under zero_init)
    ze2-off ze3-off  zeroengine stage 2/3 with offload_optimizer (our CPU Adam)
    <any of ddp, fsdp2*, ze*>-c  the same under torch.compile (inductor): DDP as
                   torch.compile(DDP(model)), FSDP2 as model.compile(), ours as engine.compile()

each in fp32 and/or bf16 (--precision). Runs are interleaved (repeat 1 of every variant, then
repeat 2, ...), each in fresh processes. Per variant: median step time over the measured steps
(slowest rank), peak RSS per rank and its rise above the post-import baseline, model-state bytes
per rank (every tensor the model, optimizer and engine hold, counted once per storage), bytes
sent per rank per step (from the loopback interface's counters, so C++ collectives such as DDP's
are counted too), and the first and last loss. Prints a Markdown table; --json writes the rows.

    DS_ACCELERATOR=cpu python benchmarks/compare.py [--size 25m|100m] [--repeats 3]
        [--precision fp32,bf16] [--variants ddp,ze2,...] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import resource
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
from zeroengine.examples.gpt import GPT, GPTConfig  # noqa: E402
from zeroengine.testing import run_ranks  # noqa: E402
from zeroengine.tools.estimate import gpt_num_params  # noqa: E402

SIZES = {"25m": GPTConfig(context=256, layers=8, heads=8, dim=512),
         "100m": GPTConfig(context=256, layers=14, heads=12, dim=768),
         "small": GPTConfig(context=128, layers=4, heads=4, dim=256),  # ~3.3M: bf16 on CPUs
         "tiny": GPTConfig(context=64, layers=2, heads=4, dim=128)}     # without bf16 units
PEERS = ["ddp", "zero-opt", "fsdp2-keep", "fsdp2", "ds0", "ds1", "ds2", "ds3", "ds2-off",
         "ds3-off"]
DEEPSPEED = [v for v in PEERS if v.startswith("ds")]
OURS = ["ze0", "ze1", "ze2", "ze3", "ze2-off", "ze3-off"]
# The peers with the same sharding as each of our rows (what its ratio is taken against).
SAME_SHARDING = {"ze0": ["ddp", "ds0"], "ze1": ["zero-opt", "ds1"],
                 "ze2": ["fsdp2-keep", "ds2"], "ze3": ["fsdp2", "ds3"],
                 "ze2-off": ["ds2-off"], "ze3-off": ["ds3-off"]}
# compiled rows (name + "-c") compare with the compiled rows of the same sharding
SAME_SHARDING.update({"ze0-c": ["ddp-c"], "ze2-c": ["fsdp2-keep-c"], "ze3-c": ["fsdp2-c"]})


def base_variant(variant: str) -> tuple[str, bool]:
    """("ze2", True) for "ze2-c": the variant and whether it runs under torch.compile."""
    return (variant[:-2], True) if variant.endswith("-c") else (variant, False)


# --ours-zero travels to the spawned ranks in this variable, --optimizer in the next
OURS_ZERO_ENV = "ZEROENGINE_COMPARE_ZERO"
OPTIMIZER_ENV = "ZEROENGINE_COMPARE_OPTIMIZER"
# the variants that can run Muon (torch's Muon takes only 2-D parameters: ZeroRedundancy-
# Optimizer and DeepSpeed's config path cannot split a model between two optimizers)
MUON_VARIANTS = ["ddp", "ze0", "ze1", "ze2", "ze3", "ze2-off", "ze3-off"]
# Parameters, gradients and Adam states in units of parameter count x bytes (ZeRO paper).
LR = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


# -- measurements inside a rank ----------------------------------------------------------------
def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def loopback_tx_bytes() -> int:
    """Bytes sent on the loopback interface by everything on this machine: ranks on one host
    talk over it, whatever library issues the collective."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def held_bytes(*roots) -> int:
    """Bytes of every tensor storage reachable from ``roots`` (modules, optimizers, engines and
    the lists, dicts and attributes inside them), each storage counted once. The same count for
    every engine, so peers are measured the way we are."""
    seen_objects, seen_storages, total = set(), set(), 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", None)  # DTensor: this rank's shard
            if local is not None:
                stack.append(local)
                continue
            if obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key and key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in (
                "torch", "deepspeed", "zeroengine", "__main__", "compare"):
            stack.extend(vars(obj).values())
    return total


# -- building each variant -----------------------------------------------------------------------
def plain_step(model, opt):
    """One step of a model that reduces its own gradients (FSDP2): backward, step, zero."""
    def step(tokens, targets):
        loss = model.loss(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _engine_step(model, engine):
    """One step through engine.backward / engine.step (ours and DeepSpeed's share the verbs)."""
    def step(tokens, targets):
        loss = model.loss(tokens, targets)
        engine.backward(loss)
        engine.step()
        return loss
    return step


def make_optimizers(model, name: str) -> list:
    """AdamW over everything, or ("muon") torch's Muon over the blocks' weight matrices and
    AdamW over the rest (embeddings, norms, biases, head): the usual Muon split."""
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), **LR)]
    blocks = {id(p) for p in model.blocks.parameters()}
    matrices = [p for p in model.parameters() if p.dim() == 2 and id(p) in blocks]
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return [torch.optim.Muon(matrices, lr=0.02, momentum=0.95, weight_decay=0.1),
            torch.optim.AdamW(rest, **LR)]


def optimizer_state_bytes(optimizers) -> int:
    return sum(v.numel() * v.element_size() for opt in optimizers
               for state in opt.state.values() for v in state.values() if torch.is_tensor(v))


def build(variant: str, precision: str, cfg: GPTConfig, micro: int):
    """(train_step(tokens, targets) -> loss, roots holding the model states, model).
    ``train_step.state_bytes()``: the optimizer state this rank holds (where measured)."""
    bf16 = precision == "bf16"
    optimizer_name = os.environ.get(OPTIMIZER_ENV, "adamw")
    variant, compiled = base_variant(variant)
    if variant in OURS:
        import zeroengine
        stage, offload = int(variant[2]), variant.endswith("-off")
        config = {"train_micro_batch_size_per_gpu": micro,
                  "bf16": {"enabled": bf16},
                  "zero_optimization": {"stage": stage,
                                        **({"offload_optimizer": {"device": "cpu"}}
                                           if offload else {}),
                                        **json.loads(os.environ.get(OURS_ZERO_ENV, "{}"))}}
        torch.manual_seed(0)
        with zeroengine.zero_init(config):  # stage 3: built sharded (else a no-op)
            model = GPT(cfg)
        engine = zeroengine.initialize(model, config,
                                       optimizer=make_optimizers(model, optimizer_name))
        if compiled:
            engine.compile(backend="inductor")
        step = _engine_step(model, engine)
        step.state_bytes = engine.optimizer.state_nbytes
        return step, [engine], model

    torch.manual_seed(0)
    model = GPT(cfg)
    if variant in DEEPSPEED:
        import deepspeed
        stage, offload = int(variant[2]), variant.endswith("-off")
        # our defaults for the buckets, so both move the same sizes (DeepSpeed's stage-3
        # reduce_bucket_size default is 5e8 elements: a 2 GB buffer, mostly never touched)
        zero = {"stage": stage, "reduce_bucket_size": 5_000_000,
                "allgather_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {
                      **LR, "betas": list(LR["betas"]), **({} if offload else
                                                           {"torch_adam": True})}},
                  "bf16": {"enabled": bf16}, "zero_optimization": zero,
                  "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        return _engine_step(model, engine), [engine], model

    if variant.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        reshard = variant == "fsdp2"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), **LR)
        if compiled:
            model.compile(backend="inductor")
        return plain_step(model, opt), [model, opt], model

    from torch.nn.parallel import DistributedDataParallel as DDP
    wrapped = DDP(model)
    if compiled:
        wrapped = torch.compile(wrapped, backend="inductor")
    if variant == "zero-opt":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      **LR)
        opts = [opt]
    elif variant == "ddp":
        opts = make_optimizers(model, optimizer_name)
    else:
        raise ValueError(f"unknown variant {variant!r}")

    def step(tokens, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = wrapped(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        return loss
    if variant == "ddp":
        step.state_bytes = lambda: optimizer_state_bytes(opts)
    return step, [wrapped, *opts], model


def run_variant(variant: str, precision: str, size: str, steps: int, warmup: int,
                micro: int) -> dict:
    import torch.distributed as dist

    import zeroengine
    if variant in DEEPSPEED:
        importlib.import_module("deepspeed")  # its import is part of the baseline, not the model
    zeroengine.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = SIZES[size]
    gc.collect()
    baseline = rss_now()
    train_step, roots, model = build(variant, precision, cfg, micro)
    gen = torch.Generator().manual_seed(100 + rank)
    times, losses = [], []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            tx_start = loopback_tx_bytes()
        window = torch.randint(0, cfg.vocab, (micro, cfg.context + 1), generator=gen)
        start = time.perf_counter()
        loss = train_step(window[:, :-1], window[:, 1:])
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    dist.barrier()
    tx = loopback_tx_bytes() - tx_start
    params = gpt_num_params(cfg.vocab, cfg.context, cfg.layers, cfg.dim)
    out = {"step_s": statistics.median(times[warmup:]), "peak_rss": rss_peak(),
           "baseline_rss": baseline, "held_bytes": held_bytes(*roots), "params": params,
           "sent_per_rank_step": tx / world / steps, "first_loss": losses[0],
           "last_loss": losses[-1]}
    if base_variant(variant)[0] in OURS:
        out["memory_report"] = roots[0].memory_report()
    if hasattr(train_step, "state_bytes"):
        out["optimizer_state_bytes"] = train_step.state_bytes()
    del model
    return out


# -- the table -----------------------------------------------------------------------------------
def zero_formula_bytes(params: int, variant: str, precision: str, world: int) -> float | None:
    """Model states per rank by the ZeRO paper, for our rows (device + host)."""
    from zeroengine.tools.estimate import model_state_bytes
    variant = base_variant(variant)[0]
    if variant not in OURS:
        return None
    e = model_state_bytes(params, int(variant[2]), world, precision, 2,
                          offload_optimizer=variant.endswith("-off"))
    return e.device_total + e.host_total


def paper_volume(params: int, variant: str, precision: str, world: int) -> float:
    """Bytes each rank sends per step by the ZeRO paper: 2x the parameters' bytes (stages
    0-2), 3x (stage 3), times (N-1)/N for a ring; in the dtype the collectives carry."""
    stage = 3 if base_variant(variant)[0] in ("ze3", "ze3-off", "ds3", "ds3-off", "fsdp2") else 0
    width = 2 if precision == "bf16" else 4
    return (3 if stage == 3 else 2) * params * width * (world - 1) / world


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="25m", choices=sorted(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--precision", default="fp32", help="fp32 and/or bf16 (comma list); bf16 "
                    "matmuls are ~7x slower than fp32 on CPUs without AVX512-BF16")
    ap.add_argument("--variants", default=None, help="comma list (default: all that import)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                    help="muon: torch's Muon on the blocks' matrices + AdamW on the rest, for "
                    "the variants that can split a model between two optimizers (ddp, ze*)")
    ap.add_argument("--ours-zero", default=None, help="JSON merged into our rows' "
                    "zero_optimization, e.g. '{\"stage3_prefetch_bucket_size\": 5000000}'")
    args = ap.parse_args()
    if args.ours_zero:
        json.loads(args.ours_zero)  # refuse bad JSON here, not in every rank
        os.environ[OURS_ZERO_ENV] = args.ours_zero
    os.environ[OPTIMIZER_ENV] = args.optimizer
    have_ds = importlib.util.find_spec("deepspeed") is not None
    if not have_ds:
        print("deepspeed is not importable: its rows are left out "
              "(pip install 'zeroengine[bench]'; DS_ACCELERATOR=cpu)", file=sys.stderr)
    variants = args.variants.split(",") if args.variants else \
        [v for v in PEERS + OURS if have_ds or v not in DEEPSPEED]
    if args.optimizer == "muon":
        variants = [v for v in variants if v in MUON_VARIANTS]
    # bf16: the rows the targets name (offload and ZeroRedundancyOptimizer in fp32 only, unless
    # asked for by --variants)
    jobs = [(v, p) for p in args.precision.split(",") for v in variants
            if p == "fp32" or args.variants or not (v.endswith("-off") or v == "zero-opt")]
    runs: dict[tuple, list[list[dict]]] = {j: [] for j in jobs}
    for r in range(args.repeats):
        for v, p in jobs:
            t0 = time.time()
            runs[(v, p)].append(run_ranks(args.world, run_variant, v, p, args.size, args.steps,
                                          args.warmup, args.micro, timeout=3600))
            step = max(x["step_s"] for x in runs[(v, p)][-1])
            print(f"repeat {r + 1}/{args.repeats} {v:10s} {p}: {step:.3f} s/step "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        if args.json:  # after every repeat: a run cut short still leaves its numbers
            write_json(args, runs)
    print_table(summarise(runs, args), args)


def write_json(args, runs) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    done = {k: v for k, v in runs.items() if v}
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": summarise(done, args),
                   "raw": [{"variant": v, "precision": p, "repeats": reps}
                           for (v, p), reps in done.items()]}, f, indent=1)


def summarise(runs, args) -> list[dict]:
    rows = []
    for (v, p), reps in runs.items():
        step = statistics.median(max(x["step_s"] for x in rep) for rep in reps)
        r0 = reps[0][0]
        row = {"variant": v, "precision": p, "step_s": step,
               "peak_rss": max(statistics.median(rep[k]["peak_rss"] for rep in reps)
                               for k in range(args.world)),
               "rss_rise": max(statistics.median(rep[k]["peak_rss"] - rep[k]["baseline_rss"]
                                                 for rep in reps) for k in range(args.world)),
               "held_bytes": max(x["held_bytes"] for x in reps[0]),
               "sent_per_rank_step": statistics.median(rep[0]["sent_per_rank_step"]
                                                       for rep in reps),
               "params": r0["params"], "first_loss": r0["first_loss"],
               "last_loss": r0["last_loss"]}
        if "optimizer_state_bytes" in r0:
            row["optimizer_state_bytes"] = max(x["optimizer_state_bytes"] for x in reps[0])
        if "memory_report" in r0:
            row["memory_report_total"] = max(x["memory_report"]["total"] for x in reps[0])
            row["formula_bytes"] = zero_formula_bytes(r0["params"], v, p, args.world)
        row["paper_volume"] = paper_volume(r0["params"], v, p, args.world)
        rows.append(row)
    for p in {r["precision"] for r in rows}:
        same = {r["variant"]: r for r in rows if r["precision"] == p}
        floor = same.get("ddp")
        for r in same.values():
            r["vs_ddp"] = r["step_s"] / floor["step_s"] if floor else None
            peers = [same[x] for x in SAME_SHARDING.get(r["variant"], []) if x in same]
            if peers:
                best = min(peers, key=lambda x: x["step_s"])
                r["vs_best_peer"] = r["step_s"] / best["step_s"]
                r["best_peer"] = best["variant"]
    return rows


def print_table(rows: list[dict], args) -> None:
    mb = 2**20
    r0 = rows[0]
    print(f"\nGPT {r0['params'] / 1e6:.1f}M params ({args.size}), world size {args.world}, "
          f"micro batch {args.micro}x{SIZES[args.size].context}, "
          f"{'Muon + AdamW' if args.optimizer == 'muon' else 'AdamW'}, gloo, 1 thread/rank; "
          f"median of {args.repeats} interleaved repeats x {args.steps} steps "
          f"(after {args.warmup} warm-up)\n")
    print("| variant | prec | step (s) | vs DDP | vs same-sharding peer | peak RSS/rank (MB) "
          "| RSS rise (MB) | vs DDP rise | model states/rank (MB) | vs ZeRO formula "
          "| optimizer state/rank (MB) | vs DDP "
          "| sent/rank/step (MB) | vs paper | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ddp_rise = next((x["rss_rise"] for x in rows if x["variant"] == "ddp"
                         and x["precision"] == r["precision"]), None)
        peer = (f"{r['vs_best_peer']:.2f}x {r['best_peer']}" if "vs_best_peer" in r else "")
        formula = (f"{r['memory_report_total'] / r['formula_bytes']:.3f}"
                   if r.get("formula_bytes") else "")
        vs_ddp = f"{r['vs_ddp']:.2f}x" if r["vs_ddp"] else ""
        rise = f"{r['rss_rise'] / ddp_rise:.2f}x" if ddp_rise else ""
        ddp_state = next((x.get("optimizer_state_bytes") for x in rows if x["variant"] == "ddp"
                          and x["precision"] == r["precision"]), None)
        state = r.get("optimizer_state_bytes")
        state_cells = [f"{state / mb:.1f}" if state is not None else "",
                       f"{state / ddp_state:.2f}x" if state is not None and ddp_state else ""]
        cells = [r["variant"], r["precision"], f"{r['step_s']:.3f}", vs_ddp, peer,
                 f"{r['peak_rss'] / mb:.0f}", f"{r['rss_rise'] / mb:.0f}", rise,
                 f"{r['held_bytes'] / mb:.0f}", formula, *state_cells,
                 f"{r['sent_per_rank_step'] / mb:.1f}",
                 f"{r['sent_per_rank_step'] / r['paper_volume']:.2f}",
                 f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
