"""zeroengine's own probe of DeepSpeed's API, written as a DeepSpeed script is (not a public
one: tests/test_ds_scripts.py runs it with DeepSpeed itself and with zeroengine.deepspeed,
chosen by PROBE_ENGINE, and compares what rank 0 writes to --out): the loader
``initialize(training_data=...)`` builds, the per-step lr of the config's scheduler, losses,
the global counters, the final parameters (zero.GatheredParameters), and a checkpoint saved
with client_state and resumed by load_checkpoint."""
import argparse
import json
import os

import torch

if os.environ.get("PROBE_ENGINE") == "deepspeed":
    import deepspeed
else:
    import zeroengine.deepspeed as deepspeed


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.body = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                        torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        # checkpointed where its input requires grad: DeepSpeed's reentrant checkpoint gives
        # the block no gradients at all when none of its inputs requires grad (torch's
        # non-reentrant one, which zeroengine.deepspeed uses, computes them)
        return self.head(deepspeed.checkpointing.checkpoint(self.body, self.inp(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--save_at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Net()
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=gen),
                                          torch.randn(64, 3, generator=gen))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data)
    start = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.ckpt)
        start = client["step"]
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    rows, batches = [], iter(loader)
    for step in range(start, args.steps):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        rows.append({"step": step, "loss": loss.item(), "lr": engine.get_lr()[0],
                     "global_steps": engine.global_steps,
                     "applied": engine.was_step_applied()})
        if step + 1 == args.save_at:
            engine.save_checkpoint(args.ckpt, client_state={"step": step + 1})
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        final = {name: p.detach().float().flatten().tolist()
                 for name, p in model.named_parameters()}
    if deepspeed.comm.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "final": final, "loader_batches": len(loader),
                       "micro": engine.train_micro_batch_size_per_gpu(),
                       "stage": engine.zero_optimization_stage()}, f)
    deepspeed.comm.barrier()
    # the group goes down with every rank still connected (see recorder.py)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
