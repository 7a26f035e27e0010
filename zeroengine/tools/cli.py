"""The ``zeroengine`` console script.

    zeroengine train CONFIG [--nproc N] [--resume] [--steps S] [--run-name NAME]
    zeroengine consolidate CKPT_DIR OUT [--tag TAG] [--pt]
    zeroengine check-config CONFIG [--world N] [--hidden-size H]
    zeroengine estimate (--params P | --config CONFIG) [--stage S] [--world N ...] ...
    zeroengine launch [--num_gpus N --num_nodes M --hostfile F ...] script.py ARGS (tools/launch.py)
"""
from __future__ import annotations

import argparse
import os
import sys


def _consolidate(args) -> int:
    from ..checkpoint import consolidate
    from ..checkpoint import format as fmt
    from ..checkpoint.sources import is_checkpoint, open_checkpoint
    from ..checkpoint.weights.hf_layout import parse_dtype, parse_size
    if args.tag is None and is_checkpoint(args.checkpoint_dir):
        path = args.checkpoint_dir  # given the checkpoint itself rather than its save_dir
    else:
        path = fmt.resolve(args.checkpoint_dir, args.tag)
    try:
        limit, dtype = parse_size(args.max_shard_size), parse_dtype(args.dtype)
    except ValueError as e:
        print(f"zeroengine consolidate: {e}", file=sys.stderr)
        return 2
    source = open_checkpoint(path)  # read once: DeepSpeed's pickles are parsed here
    # a tensor at a time, a file at a time: about one output file in memory
    written = consolidate.write_consolidated(source, args.out, limit, dtype)
    hf_config = source.meta.get("hf_config")
    if hf_config is not None:  # saved from a transformers model: make the directory loadable
        fmt.write_json_atomic(os.path.join(args.out, "config.json"), hf_config)
        written.append(os.path.join(args.out, "config.json"))
    if args.pt:  # one torch.save'd dict: this one holds the whole model in memory
        import torch
        state = consolidate.consolidated_state_dict(source)
        torch.save(state, os.path.join(args.out, "pytorch_model.pt"))
        written.append(os.path.join(args.out, "pytorch_model.pt"))
    print(f"{path} -> {', '.join(written)}")
    return 0


def _check_config(args) -> int:
    import dataclasses
    import json

    import torch

    from ..config import collect_report, parse_config, resolve_auto
    from ..core.optim.factory import optimizer_from_config
    from ..core.optim.schedulers import scheduler_from_config
    from .job_config import split_job
    engine_config, job = split_job(args.config)
    with collect_report() as report:
        try:
            cfg = parse_config(engine_config)
        finally:  # what was read before a refusal is worth seeing too
            width = max((len(k) for k, _ in report), default=0)
            for key, verdict in report:
                print(f"  {key:<{width}}  {verdict}", file=sys.stderr)
    resolve_auto(cfg, args.world, "float32", args.hidden_size)
    # "valid" means initialize() accepts it: build what it would build from the config alone
    # (the optimizer and scheduler sections, over a stand-in parameter)
    if cfg.optimizer is not None:
        optimizer = optimizer_from_config(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])
        scheduler_from_config(cfg.scheduler, optimizer)
    elif cfg.scheduler is not None:
        print(f"{args.config}: the scheduler section is checked when initialize() is given "
              "the optimizer (the config has none)", file=sys.stderr)
    resolved = dataclasses.asdict(cfg)
    resolved["job"] = dataclasses.asdict(job)
    print(json.dumps(resolved, indent=2, sort_keys=True))
    print(f"{args.config}: valid (resolved for world size {args.world})", file=sys.stderr)
    return 0


def _estimate(args) -> int:
    from ..config import parse_config
    from .estimate import gpt_num_params, model_state_bytes, states_per_param
    stage, precision, optimizer = args.stage, args.precision, args.optimizer
    offload_optimizer, offload_param = args.offload_optimizer, args.offload_param
    params = args.params
    master, state_bytes = args.master, 2 if args.states == "bf16" else 4
    source = f"{params:,.0f} parameters" if params else ""
    if args.config:
        from .job_config import split_job
        engine_config, job = split_job(args.config)
        cfg = parse_config(engine_config)
        from ..core.optim.precision import OptimizerPrecision
        kept = OptimizerPrecision.from_config(cfg)
        master = kept.master if master is None else master
        state_bytes = kept.states.itemsize if args.states is None else state_bytes
        zero = cfg.zero_optimization
        stage = zero.stage if stage is None else stage
        precision = "fp16" if cfg.fp16.enabled is True else (
            "bf16" if cfg.bf16.enabled is True else "fp32")
        offload_optimizer = offload_optimizer or zero.offload_optimizer.device
        offload_param = offload_param or zero.offload_param.device
        if cfg.optimizer is not None:
            optimizer = cfg.optimizer.type
        if not params:
            m = job.model
            params = gpt_num_params(256, m.context, m.layers, m.dim)
            source = (f"the built-in GPT of {args.config} ({m.layers} layers, dim {m.dim}): "
                      f"{params:,} parameters")
    if not params:
        raise SystemExit("zeroengine estimate: give --params or --config")
    stage = 0 if stage is None else stage
    master = master or "fp32"
    states = states_per_param(optimizer)
    gib = 2 ** 30
    offload_optimizer, offload_param = offload_optimizer or "none", offload_param or "none"
    nvme = "nvme" in (offload_optimizer, offload_param)
    print(f"Model states per rank for {source}, stage {stage}, {precision}, {optimizer} "
          f"({states} states/param, {state_bytes} bytes each; {master} master), offload "
          f"optimizer {offload_optimizer}, params "
          f"{offload_param} (GiB; ZeRO formulas, no activations or buffers)\n")
    print("| world size | params | grads | optimizer states | device total | host total |"
          + (" NVMe total |" if nvme else ""))
    print("|---|---|---|---|---|---|" + ("---|" if nvme else ""))
    for world in args.world:
        e = model_state_bytes(params, stage, world, precision, states, offload_optimizer,
                              offload_param, master, state_bytes)
        print(f"| {world} | {e.params / gib:.3f} | {e.grads / gib:.3f} | "
              f"{e.optimizer_states / gib:.3f} | {e.device_total / gib:.3f} | "
              f"{e.host_total / gib:.3f} |" + (f" {e.nvme_total / gib:.3f} |" if nvme else ""))
    if args.recommend or args.time:
        if nvme:  # the model has no drive in it: it would predict a CPU-offload step
            raise SystemExit("zeroengine estimate: --time/--recommend do not model NVMe "
                             "offload (the drive's time); the memory table above holds")
        _predict_steps(args, params, stage, precision, states, offload_optimizer == "cpu",
                       offload_param == "cpu")
    if args.ranks_per_node:
        _cross_node_traffic(args, params, stage, precision)
    return 0


def _cross_node_traffic(args, params, stage, precision) -> None:
    """Per world size: bytes crossing nodes per step, plain and with each feature of
    docs/hybrid.md, and the time they take on the inter-node links."""
    from .traffic import Topology, cross_node_bytes, step_comm_seconds
    if stage == 0:
        print("\ncross-node traffic: stage 0 is not modelled (plain all-reduce)")
        return
    rows = [("plain", {})]
    rows += [("hybrid (mics_shard_size = node)", {"hybrid": True})]
    if stage == 3:
        rows += [("hpZ", {"hpz": True}), ("qwZ", {"qwz": True}), ("qwZ + qgZ", {"qwz": True,
                                                                               "qgz": True}),
                 ("hpZ + qwZ + qgZ", {"hpz": True, "qwz": True, "qgz": True})]
    else:
        rows += [("qgZ", {"qgz": True})]
    print(f"\nBytes crossing nodes per optimizer step ({args.ranks_per_node} ranks per node, "
          f"{args.inter_gbps:g} Gbit/s per node, {args.micro_steps} micro-step(s); "
          "zeroengine.tools.traffic) and the time they take with every link busy:\n")
    print("| world size | variant | GB across, all nodes | GB per node | link seconds |")
    print("|---|---|---|---|---|")
    for world in args.world:
        if world % args.ranks_per_node or world <= args.ranks_per_node:
            continue
        topo = Topology(world, args.ranks_per_node, args.inter_gbps)
        for name, features in rows:
            moved = cross_node_bytes(params, topo, stage, precision, args.micro_steps,
                                     backend=args.backend, **features)
            total = sum(moved.values())
            print(f"| {world} | {name} | {total / 1e9:.2f} | {total / topo.nodes / 1e9:.3f} | "
                  f"{step_comm_seconds(moved, topo):.3f} |")


def _predict_steps(args, params, stage, precision, states, offload_optimizer,
                   offload_param) -> None:
    """Step time (and, with --recommend, the stage and offload to use) per world size."""
    from .scale_model import Hardware, Job, predict, recommend
    hw = Hardware(flops=args.flops, bandwidth=args.bandwidth, latency=args.latency,
                  device_memory=args.device_memory * 2**30)
    common = dict(precision=precision, states=states, tokens_per_rank=args.tokens,
                  activation_bytes=args.activation_gib * 2**30,
                  reduce_bucket_size=int(args.bucket_size),
                  prefetch_bucket_size=int(args.bucket_size))
    gib = 2**30
    print(f"\nPredicted step ({args.tokens} tokens/rank/step, {hw.flops / 1e12:.0f} TFLOP/s, "
          f"{hw.bandwidth / 1e9:.0f} GB/s and {hw.latency * 1e6:.0f} us per ring step, buckets "
          f"of {args.bucket_size:.0e} elements, "
          f"{args.device_memory:.0f} GiB/device with {args.activation_gib:.0f} GiB for "
          f"activations){': recommended setting' if args.recommend else ''}\n")
    print("| world size | stage | offload opt/param | device GiB (states + buffers) | host GiB "
          "| sent/rank/step GiB | compute s | exposed comm s | optimizer s | step s | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world in args.world:
        if args.recommend:
            job, pred = recommend(params, world, hw, **common)
            if job is None:
                print(f"| {world} | - | - | nothing fits | | | | | | | no |")
                continue
        else:
            job = Job(params, stage, world, offload_optimizer=offload_optimizer,
                      offload_param=offload_param, **common)
            pred = predict(job, hw)
        print(f"| {world} | {job.stage} | {'yes' if job.offload_optimizer else 'no'}/"
              f"{'yes' if job.offload_param else 'no'} | {pred.model_states / gib:.1f} + "
              f"{pred.buffers / gib:.1f} | {pred.host / gib:.1f} | {pred.comm_bytes / gib:.1f} | "
              f"{pred.compute_s:.2f} | {pred.exposed_comm_s:.2f} | {pred.optimizer_s:.2f} | "
              f"{pred.step_s:.2f} | {'yes' if pred.fits(hw, job.activation_bytes) else 'no'} |")


def _train(args) -> int:
    worker_args = [args.config, "--runs-dir", args.runs_dir] + \
        (["--resume"] if args.resume else []) + \
        (["--steps", str(args.steps)] if args.steps else []) + \
        (["--run-name", args.run_name] if args.run_name else [])
    from ..distributed.launch_env import pytorchjob_procs_per_pod, pytorchjob_torchrun_args
    launched = any(k in os.environ for k in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))
    torchrun_args = None
    if pytorchjob_procs_per_pod(os.environ) is not None:
        # A multi-process PyTorchJob pod: its RANK is the pod index, torchrun makes the ranks.
        torchrun_args = pytorchjob_torchrun_args(os.environ)
    elif args.nproc and not launched:
        torchrun_args = ["--standalone", f"--nproc_per_node={args.nproc}"]
    if torchrun_args is not None:
        # Launch the ranks here, through torchrun's own module (restarts, signals, exit codes).
        import subprocess
        env = dict(os.environ)
        if args.nproc:
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args,
               "-m", "zeroengine.tools.train_job", *worker_args]
        return subprocess.call(cmd, env=env)
    from .train_job import main as worker  # under a launcher already: just join
    return worker(worker_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroengine", description="zeroengine tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("launch", help="run a training script on N processes per node with the "
                   "deepspeed command's flags (zeroengine launch --help)", add_help=False)
    t = sub.add_parser("train", help="train the built-in byte-level GPT on the Python standard "
                       "library's sources, as the config's 'job' section says")
    t.add_argument("config")
    t.add_argument("--nproc", type=int, default=None, help="launch this many local ranks "
                   "(under torchrun/SLURM/MPI already: omit it, the ranks just join)")
    t.add_argument("--resume", action="store_true", help="continue from the run's latest "
                   "checkpoint")
    t.add_argument("--steps", type=int, default=None, help="override job.steps")
    t.add_argument("--run-name", default=None, help="override job.run_name")
    t.add_argument("--runs-dir", default="runs")
    t.set_defaults(run=_train)

    c = sub.add_parser("consolidate", help="write the model's weights from a sharded checkpoint "
                       "(zeroengine's, DeepSpeed's ZeRO or a torch.distributed.checkpoint "
                       "directory, any world size) in the Hugging Face layout, a file at a time")
    c.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint "
                   "or DeepSpeed's (its latest tag is used), or one checkpoint directory")
    c.add_argument("out", help="output directory")
    c.add_argument("--tag", default=None, help="checkpoint tag (default: the latest)")
    c.add_argument("--pt", action="store_true", help="also write pytorch_model.pt (holds "
                   "the whole model in memory)")
    c.add_argument("--max-shard-size", default="5GB", help="largest output file (e.g. 5GB, "
                   "500MB, 2GiB; default 5GB): several files and model.safetensors.index.json "
                   "when the model is larger, as save_pretrained writes")
    c.add_argument("--dtype", default=None, help="fp32 (default, as saved), bf16 or fp16")
    c.set_defaults(run=_consolidate)

    k = sub.add_parser("check-config", help="validate a JSON config and print it resolved")
    k.add_argument("config")
    k.add_argument("--world", type=int, default=1, help="world size to resolve batch sizes for")
    k.add_argument("--hidden-size", type=int, default=None, help="the model's config."
                   "hidden_size, to resolve \"auto\" bucket sizes as initialize() does for a "
                   "Hugging Face model (without it: zeroengine's defaults)")
    k.set_defaults(run=_check_config)

    e = sub.add_parser("estimate", help="model-state memory per rank (ZeRO formulas)")
    e.add_argument("--params", type=float, default=None, help="parameter count, e.g. 7e9")
    e.add_argument("--config", default=None, help="take stage, precision, offload and "
                   "optimizer from this config (and the size of its built-in job model)")
    e.add_argument("--stage", type=int, default=None, choices=(0, 1, 2, 3))
    e.add_argument("--world", type=int, nargs="+", default=[1, 2, 8, 64, 1024])
    e.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    e.add_argument("--optimizer", default="adamw")
    e.add_argument("--master", default=None, choices=("fp32", "low", "remainder"),
                   help="how the master weights are kept: fp32; low (the bf16/fp16 weights "
                   "themselves: bf16_master_weights_and_grads); remainder (bf16 weights + 16 "
                   "bits: store_param_remainders). Default: the config's, else fp32")
    e.add_argument("--states", default=None, choices=("fp32", "bf16"),
                   help="the optimizer states' dtype (bf16: bf16_optimizer_states)")
    e.add_argument("--offload-optimizer", nargs="?", const="cpu", default=None,
                   choices=("none", "cpu", "nvme"), help="where the optimizer states go "
                   "(the flag alone: cpu)")
    e.add_argument("--offload-param", nargs="?", const="cpu", default=None,
                   choices=("none", "cpu", "nvme"), help="where stage 3's parameter shard goes "
                   "(the flag alone: cpu)")
    e.add_argument("--time", action="store_true", help="also predict the step time "
                   "(zeroengine.tools.scale_model: compute, ring collectives, overlap)")
    e.add_argument("--recommend", action="store_true", help="per world size, the least "
                   "sharded stage/offload whose memory fits --device-memory and whose step is "
                   "within 5%% of the fastest that fits, and its step time")
    e.add_argument("--tokens", type=int, default=8 * 4096, help="tokens per rank per step")
    e.add_argument("--flops", type=float, default=400e12, help="achieved FLOP/s per rank")
    e.add_argument("--bandwidth", type=float, default=45e9, help="collective bytes/s per rank")
    e.add_argument("--latency", type=float, default=5e-6, help="seconds per ring step")
    e.add_argument("--bucket-size", type=float, default=5e8, help="elements per gradient "
                   "bucket and per stage-3 prefetch (reduce_bucket_size, "
                   "stage3_prefetch_bucket_size; at this scale set them large)")
    e.add_argument("--device-memory", type=float, default=80, help="GiB per device")
    e.add_argument("--activation-gib", type=float, default=0.0, help="GiB per device kept "
                   "for activations")
    e.add_argument("--ranks-per-node", type=int, default=0, help="also print the bytes that "
                   "cross nodes per step, plain and with hybrid sharding / hpZ / qwZ / qgZ "
                   "(docs/hybrid.md)")
    e.add_argument("--inter-gbps", type=float, default=100.0, help="each node's inter-node "
                   "bandwidth, Gbit/s (with --ranks-per-node)")
    e.add_argument("--micro-steps", type=int, default=1, help="gradient accumulation steps "
                   "(with --ranks-per-node)")
    e.add_argument("--backend", default="nccl", choices=("nccl", "gloo"), help="how the "
                   "reduce-scatter moves (nccl: ring; gloo: point to point)")
    e.set_defaults(run=_estimate)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # the deepspeed command's flags, then the script's own
        from .launch import LaunchError, launch
        try:
            return launch(argv[1:])
        except (LaunchError, OSError) as err:
            print(f"zeroengine launch: error: {err}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    from ..checkpoint.format import CheckpointError
    from ..config import ConfigError
    try:
        return args.run(args)
    except (CheckpointError, ConfigError, ValueError) as err:
        print(f"zeroengine {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
