"""A short real run: a byte-level GPT learns Python from the standard library's own sources.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m zeroengine.examples.demo configs/zero2.json [steps]

(`zeroengine train` is the full job; this is the minimal loop it grows from.)
"""
from __future__ import annotations

import sys
import time

import torch

import zeroengine
from zeroengine.examples.corpus import stdlib_corpus
from zeroengine.examples.gpt import GPT, GPTConfig, num_params


def main() -> None:
    config_path = sys.argv[1] if len(sys.argv) > 1 else "configs/zero2.json"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    torch.manual_seed(0)
    cfg = GPTConfig(context=128, layers=4, heads=4, dim=256)
    model = GPT(cfg)
    engine = zeroengine.initialize(model, config_path)
    rank, world = engine.comm.rank, engine.comm.world_size
    micro = engine.config.train_micro_batch_size_per_gpu or 8
    data, _ = stdlib_corpus(4_000_000)  # the stdlib's own sources: no download
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank reads different windows
    if rank == 0:
        print(f"GPT {num_params(model) / 1e6:.1f}M params, ZeRO stage {engine.stage}, "
              f"world size {world}, micro batch {micro}x{cfg.context} bytes")
    start = time.perf_counter()
    for step in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            idx = torch.randint(0, len(data) - cfg.context - 1, (micro,), generator=gen)
            window = torch.stack([data[i:i + cfg.context + 1] for i in idx]).to(engine.device)
            loss = model.loss(window[:, :-1], window[:, 1:])
            engine.backward(loss)
            engine.step()
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            lr = engine.optimizer.param_groups[0]["lr"]
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {lr:.2e}  "
                  f"grad norm {engine.get_global_grad_norm():.2f}  "
                  f"{(time.perf_counter() - start) / (step + 1):.2f} s/step", flush=True)
    report = engine.memory_report()
    reports = engine.comm.all_gather_object(report)
    if rank == 0:
        print("model-state bytes per rank (MB):")
        for r, rep in enumerate(reports):
            print(f"  rank {r}: " + "  ".join(f"{k} {v / 1e6:.1f}" for k, v in rep.items()))


if __name__ == "__main__":
    main()
