"""Everything about the CUDA path that needs a GPU, in one run (one H200 here: ~5 minutes).

    python benchmarks/gpu_check.py [--quick] [--json out.json]

1. builds the kernels of csrc/cuda (the setup.py build if present, else a JIT build);
2. fused Adam/AdamW against torch.optim.AdamW: fp32 max relative error <= 1e-6, the bf16/fp16
   copy exactly the fp32 result rounded, bf16 gradients, the unscale coefficient, inf/NaN
   elements left alone and flagged, >36 tensors and odd sizes (several launches, ragged chunks);
3. the multi-tensor flatten/unflatten against a loop of copy_ (exact, with dtype conversion);
4. side streams: a collective issued on a side stream waits for the compute stream's producer,
   and a consumer after Handle.wait() sees its result (a long matmul makes any missing
   ordering show);
5. world-size-1 training (NCCL group) at stages 0-3, bf16, stage 2/3 with optimizer offload,
   stage 2/3 under torch.compile (inductor) and with a tensor-wise optimizer (Adafactor),
   against plain PyTorch on the same data;
6. times our fused Adam against torch.optim.AdamW(fused=True) at 100M and 1B parameters (fp32;
   and with the bf16 copy-out, against torch fused + a separate copy), as a ratio and as a
   fraction of the measured device-to-device copy bandwidth. Targets: >= 1.0x torch fused,
   >= 80% of copy bandwidth;
2b. the 16-bit step (bf16/fp16 masters, bf16 moments, stochastic rounding: csrc/cuda/
   mixed_adam.cu) against the CPU kernel, element for element.
Exits non-zero if a correctness check fails; timings are reported, never asserted.

``--cpu-dry-run`` runs checks 2, 3 and 5 on the CPU through the PyTorch paths (no kernels, gloo):
it proves the script itself before a GPU's limited minutes are spent on it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

RESULTS: dict = {"checks": {}, "timings": []}
FAILED: list[str] = []
DEVICE = "cuda"  # "cpu" under --cpu-dry-run


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"[{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


# -- 1. build ----------------------------------------------------------------------------------
def build_kernels():
    from zeroengine.ops import extensions
    start = time.perf_counter()
    try:
        import zeroengine._cuda_ext as ext
        how = "setup.py build"
    except ImportError:
        ext = extensions.jit_build_cuda(verbose=False)
        how = "JIT build"
    check("build", ext is not None, f"{how} in {time.perf_counter() - start:.1f} s")
    extensions._cuda_module = ext  # what the engine's load_cuda_kernels() returns from now on
    return ext


# -- 2. fused Adam -----------------------------------------------------------------------------
SIZES = [1, 3, 7, 64, 65535, 65536, 65537, 100_003, 1_000_003] + [4097] * 40  # > 36 tensors


def adam_case(ext, adamw: bool, grad_dtype, low_dtype, coef: float, steps: int = 5):
    from zeroengine.ops import FusedAdam
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ref = [torch.nn.Parameter(torch.randn(n, device=DEVICE, generator=gen)) for n in SIZES]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    lows = {p: torch.empty(p.shape, dtype=low_dtype, device=DEVICE) for p in ours} \
        if low_dtype is not None else {}
    ref_opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref, foreach=False, **hyper)
    opt = FusedAdam(ours, **hyper, adamw_mode=adamw, use_cuda_kernels=DEVICE == "cuda")
    for _ in range(steps):
        grads = [torch.randn(n, device=DEVICE, generator=gen).to(grad_dtype) for n in SIZES]
        for p, g in zip(ref, grads):
            p.grad = g.float()
        ref_opt.step()
        opt.step(low_precision_copies=lows, grad_coef=coef,
                 grads={p: (g.float() / coef).to(grad_dtype) if coef != 1 else g
                        for p, g in zip(ours, grads)})
    err = max(rel_err(o.detach(), r.detach()) for o, r in zip(ours, ref))
    low_exact = all(torch.equal(lows[p], p.detach().to(low_dtype)) for p in ours) if lows else True
    return err, low_exact, int(opt.found_nonfinite.item())


def check_fused_adam(ext) -> None:
    for adamw in (True, False):
        err, _, flag = adam_case(ext, adamw, torch.float32, None, 1.0)
        check(f"fused {'AdamW' if adamw else 'Adam'} fp32 vs torch", err <= 1e-6 and flag == 0,
              f"max rel err {err:.2e} (<= 1e-6)")
    for low in (torch.bfloat16, torch.float16):
        err, exact, _ = adam_case(ext, True, torch.float32, low, 1.0)
        check(f"fused AdamW {low} copy-out", err <= 1e-6 and exact,
              f"max rel err {err:.2e}, copy == fp32 result rounded: {exact}")
    # bf16 gradients: torch sees the same bf16 values in fp32; a power-of-two scale is exact
    err, exact, _ = adam_case(ext, True, torch.bfloat16, torch.bfloat16, 1.0)
    check("fused AdamW bf16 grads", err <= 1e-6 and exact, f"max rel err {err:.2e}")
    err, _, _ = adam_case(ext, True, torch.float16, None, 1 / 1024)
    check("fused AdamW fp16 grads x1024 unscaled", err <= 1e-6, f"max rel err {err:.2e}")
    # non-finite: those elements untouched, the rest updated, the flag set
    from zeroengine.ops import FusedAdam
    p = torch.nn.Parameter(torch.linspace(-1, 1, 300_000, device=DEVICE))
    before = p.detach().clone()
    g = torch.ones_like(p)
    g[5], g[200_000] = float("inf"), float("nan")
    opt = FusedAdam([p], lr=0.1, use_cuda_kernels=DEVICE == "cuda")
    opt.step(grads={p: g})
    untouched = p[5].item() == before[5].item() and p[200_000].item() == before[200_000].item()
    moved = bool((p.detach() != before).sum().item() == p.numel() - 2)
    check("fused Adam inf/NaN", untouched and moved and int(opt.found_nonfinite.item()) == 1,
          f"bad elements untouched: {untouched}, others updated: {moved}")


# -- 2b. 16-bit masters and states (bf16/fp16 master keys) --------------------------------------
def mixed_steps(device: str, use_extension: bool, pdt, sdt, stochastic: bool, low_dtype,
                steps: int = 3):
    """Three CPUAdam steps over three tensors of master dtype ``pdt`` and moments ``sdt``,
    with runs of model indices (stochastic rounding's bits): (params, moments, lows) on the CPU."""
    from zeroengine.ops import CPUAdam
    gen = torch.Generator().manual_seed(5)
    sizes = [1, 65537, 100_003]
    ps = [(1 + torch.rand(n, generator=gen)).to(pdt).to(device) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(device) for n in sizes] for _ in range(steps)]
    lows = {p: torch.empty(p.shape, dtype=low_dtype, device=device) for p in ps} \
        if low_dtype else {}
    runs = {p: torch.tensor([[0, n // 2, 1000 * i], [n // 2, n - n // 2, 7_000_000 + i]])
            for i, (p, n) in enumerate(zip(ps, sizes))}
    opt = CPUAdam(ps, lr=1e-3, weight_decay=0.01, use_extension=use_extension,
                  state_dtype=sdt, stochastic_rounding=stochastic, rounding_seed=3)
    for step_grads in grads:
        opt.step(grads=dict(zip(ps, step_grads)), grad_coef=0.5, low_precision_copies=lows,
                 index_runs=runs)
    moments = [opt.state[p][k] for p in ps for k in ("exp_avg", "exp_avg_sq")]
    return [t.cpu() for t in ps + moments + list(lows.values())]


def check_mixed_adam() -> None:
    """The 16-bit step on DEVICE (the CUDA kernel; in the dry run the PyTorch path) against the
    CPU kernel: the same random bits and roundings, element for element, except where the two
    float32 results differ by an ulp across a rounding boundary (>= 99.5% identical, the rest
    neighbouring values)."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for pdt, sdt, stochastic, low in [(bf16, bf16, False, None), (bf16, bf16, True, None),
                                      (bf16, f32, True, None), (f32, bf16, True, bf16),
                                      (f16, f32, False, None)]:
        ours = mixed_steps(DEVICE, DEVICE == "cuda", pdt, sdt, stochastic, low)
        cpu = mixed_steps("cpu", DEVICE == "cuda", pdt, sdt, stochastic, low) \
            if DEVICE == "cuda" else mixed_steps("cpu", False, pdt, sdt, stochastic, low)
        same = min((a.view(-1) == b.view(-1)).float().mean().item() for a, b in zip(ours, cpu))
        apart = max(_ulps_apart(a, b) for a, b in zip(ours, cpu))
        name = f"mixed adam {str(pdt)[6:]} master, {str(sdt)[6:]} states" + \
            (", stochastic" if stochastic else "") + (", bf16 copy" if low else "")
        check(name, same >= 0.995 and apart <= 1,
              f"{100 * same:.3f}% identical to the CPU kernel, at most {apart} ulp apart")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.dtype == torch.float32:
        return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


# -- 3. flatten ----------------------------------------------------------------------------------
def check_flatten(ext) -> None:
    from zeroengine.ops import flatten_into, unflatten_from
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    shapes = [(3, 5), (70_000,), (1,), (128, 129)] + [(17,)] * 50
    tensors = [torch.randn(s, device=DEVICE, generator=gen) for s in shapes]
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos += t.numel() + 3  # gaps: padding must stay untouched
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.full((pos,), 7.0, device=DEVICE, dtype=dtype)
        expected = flat.clone()
        for t, off in zip(tensors, offsets):
            expected[off:off + t.numel()].copy_(t.reshape(-1))
        flatten_into(tensors, flat, offsets)
        back = [torch.empty_like(t) for t in tensors]
        unflatten_from(flat, back, offsets)
        roundtrip = all(torch.equal(b, t.to(dtype).float()) for b, t in zip(back, tensors))
        check(f"flatten/unflatten kernel {dtype}", torch.equal(flat, expected) and roundtrip,
              f"{len(tensors)} tensors in one call")


# -- 3b. int8 quantization (qwZ / qgZ wire format) -----------------------------------------------
def check_quantize() -> None:
    """The kernel's bytes equal the PyTorch fallback's (ops/quantize.py), bf16 and fp32."""
    from zeroengine.ops import quantize as qz
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(1_000_003, device=DEVICE, generator=gen) * 3).to(dtype)
        x[:512] = 0  # all-zero blocks
        q, s = qz.quantize(x, 256)
        saved = qz._kernels
        qz._kernels = lambda t: None  # the fallback
        try:
            fq, fs = qz.quantize(x, 256)
            fout = qz.dequantize(fq, fs, torch.empty(x.numel(), device=DEVICE), 256)
        finally:
            qz._kernels = saved
        out = qz.dequantize(q, s, torch.empty(x.numel(), device=DEVICE), 256)
        bound = qz.error_bound(x, 256)
        ok = torch.equal(q, fq) and torch.equal(s, fs) and torch.equal(out, fout) and \
            bool(((out - x.float()).abs() <= bound * (1 + 1e-4)).all())
        check(f"int8 quantize kernel {dtype}", ok, "same bytes as the fallback, within bound")


# -- 4. side streams -----------------------------------------------------------------------------
def check_streams() -> None:
    from zeroengine.handles import GATHER, Handle, copy_async
    a = torch.randn(8192, 8192, device=DEVICE)
    for _trial in range(3):
        produced = a @ a  # long-running on the compute stream
        target = torch.empty_like(produced)

        def launch(target=target, produced=produced):  # stands in for an async collective:
            target.copy_(produced)  # reads the input, writes the output
            return Handle()
        handle = GATHER.run([target, produced], launch)
        handle.wait()
        consumed = target.sum()  # on the compute stream, after the wait
        ok = torch.allclose(consumed, produced.sum(), rtol=1e-4)
        if not ok:
            break
    check("side stream ordering", ok, "producer -> side-stream copy -> wait -> consumer")
    # No record_stream: the handle keeps the source alive until wait(); freeing it right after
    # and overwriting the memory it had must not change what the side stream copied.
    expected = (a @ a).sum()
    source = a @ a
    host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    handle = copy_async(host, source)
    handle.wait()
    del source
    scribble = torch.full_like(a, float("nan"))  # may reuse the freed block
    torch.cuda.synchronize()
    ok = torch.allclose(host.sum(), expected.cpu(), rtol=1e-4) and scribble.isnan().all().item()
    check("side stream copy, freed after wait", ok, "device->host copy_async, then free")


# -- 5. world-size-1 training ------------------------------------------------------------------
def train_case(stage: int, bf16: bool, offload, steps: int = 4, compiled: bool = False,
               optimizer: str = "adamw", states: dict | None = None) -> float:
    """Deviation from plain PyTorch. ``offload``: False, True ("cpu") or "nvme" (pinned host
    tiles, swap files in a temporary directory), "nvme+params" (the stage-3 parameter shard
    on the drive too, through a cache smaller than it), "params" (only the parameter shard on
    the drive, the optimizer on the GPU); ``states``: receives the trained state dict."""
    import zeroengine
    from zeroengine.examples.gpt import GPT, GPTConfig
    cfg = GPTConfig(context=64, layers=2, heads=4, dim=128)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    torch.manual_seed(0)
    ref = GPT(cfg).to(DEVICE)
    make = (lambda ps: torch.optim.AdamW(ps, **hyper)) if optimizer == "adamw" else \
        (lambda ps: torch.optim.Adafactor(ps, lr=1e-2))  # tensor-wise: whole params on owners
    ref_opt = make(ref.parameters())
    torch.manual_seed(0)
    model = GPT(cfg)
    zero = {"stage": stage}
    if stage == 3:  # partition this small model's parameters too (default threshold: 100k)
        zero["stage3_param_persistence_threshold"] = 0
    swap_dir = None
    if offload == "params":
        import tempfile
        swap_dir = tempfile.mkdtemp(prefix="gpu_check_nvme_")
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True,
                                 "max_in_cpu": 50_000, "buffer_count": 2, "buffer_size": 50_000}
    elif offload in ("nvme", "nvme+params"):
        import tempfile
        swap_dir = tempfile.mkdtemp(prefix="gpu_check_nvme_")
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True,
                                     "pipeline_read": True, "pipeline_write": True}
        zero["sub_group_size"] = 20_000  # several tiles in flight
        if offload == "nvme+params":
            zero["offload_param"] = {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True,
                                     "max_in_cpu": 50_000, "buffer_count": 2,
                                     "buffer_size": 50_000}
    elif offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine = zeroengine.initialize(model, {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16}, "zero_optimization": zero}, optimizer=make(model.parameters()))
    if compiled:  # inductor on the GPU; aot_eager in the CPU dry run (same graph split)
        engine.compile(backend="inductor" if DEVICE == "cuda" else "aot_eager")
    gen = torch.Generator().manual_seed(5)
    initial = {k: v.detach().float().clone() for k, v in ref.state_dict().items()}
    for _ in range(steps):
        window = torch.randint(0, cfg.vocab, (4, cfg.context + 1), generator=gen).to(DEVICE)
        loss = ref.loss(window[:, :-1], window[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(model.loss(window[:, :-1], window[:, 1:]))
        engine.step()
    ours = engine.consolidated_state_dict()
    if states is not None:
        states.update(ours)
    num = den = 0.0
    for k, v in ref.state_dict().items():
        num += (ours[k].float().to(DEVICE) - v.float()).double().pow(2).sum().item()
        den += (v.float() - initial[k]).double().pow(2).sum().item()
    engine.close()
    if swap_dir is not None:
        import shutil
        shutil.rmtree(swap_dir, ignore_errors=True)
    return (num / den) ** 0.5


def check_training() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import zeroengine
    zeroengine.init_distributed()
    for stage, bf16, offload, compiled, optimizer in [
            (0, False, False, False, "adamw"), (1, False, False, False, "adamw"),
            (2, False, False, False, "adamw"), (3, False, False, False, "adamw"),
            (1, True, False, False, "adamw"), (2, True, False, False, "adamw"),
            (3, True, False, False, "adamw"), (2, False, True, False, "adamw"),
            (3, False, True, False, "adamw"), (2, True, False, True, "adamw"),
            (3, True, False, True, "adamw"), (2, False, False, False, "adafactor"),
            (3, True, False, False, "adafactor")]:
        # relative to how far the weights moved. fp32: our kernel vs torch's AdamW differ by
        # rounding, which Adam amplifies where a gradient is ~0; bf16: the CPU tests' bound
        # (tests/test_precision.py). A wrong step, scale or shard gives order 1.
        bound = 0.1 if bf16 else 1e-3
        dev = train_case(stage, bf16, offload, compiled=compiled, optimizer=optimizer)
        name = f"train world 1 stage {stage}" + (" bf16" if bf16 else "") + \
            (" offload" if offload else "") + (" compiled" if compiled else "") + \
            (f" {optimizer}" if optimizer != "adamw" else "")
        check(name, dev < bound, f"deviation from plain PyTorch {dev:.2e} (< {bound})")
    # NVMe offload: pinned tiles, device copies of the updated values read from them while the
    # next tile's read is in flight; the same numbers as CPU offload, bit for bit
    for stage, bf16, where in [(2, False, "nvme"), (3, True, "nvme"), (3, True, "nvme+params")]:
        cpu, nvme = {}, {}
        train_case(stage, bf16, True, states=cpu)
        dev = train_case(stage, bf16, where, states=nvme)
        same = all(torch.equal(cpu[k], nvme[k]) for k in cpu)
        check(f"train world 1 stage {stage}{' bf16' if bf16 else ''} {where} offload",
              same and dev < (0.1 if bf16 else 1e-3),
              f"bitwise equal to CPU offload: {same}; deviation from plain PyTorch {dev:.2e}")
    # only the parameter shard on the drive: FusedAdam on the GPU, the bf16 values written
    # through the swap instead of in the kernel - the same rounding, so the same bits
    plain, drive = {}, {}
    train_case(3, True, False, states=plain)
    dev = train_case(3, True, "params", states=drive)
    same = all(torch.equal(plain[k], drive[k]) for k in plain)
    check("train world 1 stage 3 bf16 parameters on nvme", same and dev < 0.1,
          f"bitwise equal to the run without offload: {same}; deviation from plain PyTorch "
          f"{dev:.2e}")


# -- 6. timings ------------------------------------------------------------------------------------
def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, by CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 28, device=DEVICE)  # 1 GiB
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), 20)
    return 2 * src.numel() * 4 / t


def time_adam(numel: int, pieces: int, low: bool, bandwidth: float, repeats: int) -> dict:
    from zeroengine.ops import FusedAdam
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    sizes = [numel // pieces] * pieces
    ps = [torch.nn.Parameter(torch.randn(n, device=DEVICE)) for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    lows = {p: torch.empty(p.shape, dtype=torch.bfloat16, device=DEVICE) for p in ps} if low else {}
    torch_opt = torch.optim.AdamW(ps, fused=True, **hyper)

    def torch_step():
        torch_opt.step()
        if low:  # torch has no copy-out: a separate pass, as an engine on it must do
            torch._foreach_copy_(list(lows.values()), ps)
    t_torch = timed(torch_step, repeats)
    ours = FusedAdam(ps, **hyper, use_cuda_kernels=DEVICE == "cuda")
    t_ours = timed(lambda: ours.step(low_precision_copies=lows), repeats)
    moved = numel * (28 + (2 if low else 0))  # read p g m v, write p m v (+ the bf16 copy)
    row = {"params": numel, "tensors": pieces, "bf16_copy_out": low, "ours_ms": t_ours * 1e3,
           "torch_fused_ms": t_torch * 1e3, "speedup": t_torch / t_ours,
           "ours_GBps": moved / t_ours / 1e9, "copy_GBps": bandwidth / 1e9,
           "fraction_of_copy_bw": moved / t_ours / bandwidth}
    print(f"  {numel / 1e6:7.0f}M in {pieces:3d} tensors{' +bf16 copy' if low else '':12s} "
          f"ours {t_ours * 1e3:8.2f} ms   torch fused {t_torch * 1e3:8.2f} ms   "
          f"{row['speedup']:.2f}x   {row['ours_GBps']:7.0f} GB/s = "
          f"{100 * row['fraction_of_copy_bw']:.0f}% of copy", flush=True)
    RESULTS["timings"].append(row)
    return row  # its tensors go with this frame; main() empties the cache


def time_mixed(numel: int, stochastic: bool, bandwidth: float, repeats: int) -> dict:
    """The 16-bit step (bf16 master, bf16 moments, bf16 gradient) over ``numel`` elements:
    reads p g m v and writes p m v at 2 bytes each (14 B per element, against fp32's 28)."""
    from zeroengine.ops import CPUAdam
    p = torch.randn(numel, device=DEVICE).to(torch.bfloat16)
    g = torch.randn(numel, device=DEVICE).to(torch.bfloat16)
    opt = CPUAdam([p], lr=1e-3, weight_decay=0.01, state_dtype=torch.bfloat16,
                  stochastic_rounding=stochastic)
    runs = {p: torch.tensor([[0, numel, 0]])} if stochastic else None
    t = timed(lambda: opt.step(grads={p: g}, index_runs=runs), repeats)
    moved = numel * 14
    row = {"params": numel, "mixed": "bf16 master+states", "stochastic": stochastic,
           "ours_ms": t * 1e3, "ours_GBps": moved / t / 1e9,
           "fraction_of_copy_bw": moved / t / bandwidth}
    print(f"  {numel / 1e6:7.0f}M bf16 master+states{' stochastic' if stochastic else '':11s} "
          f"{t * 1e3:8.2f} ms   {row['ours_GBps']:7.0f} GB/s = "
          f"{100 * row['fraction_of_copy_bw']:.0f}% of copy", flush=True)
    RESULTS["timings"].append(row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100M only, fewer repeats")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    if args.cpu_dry_run:
        global DEVICE
        DEVICE = "cpu"
        for _name, fn in [("fused adam", lambda: check_fused_adam(None)),
                         ("mixed adam", check_mixed_adam),
                         ("flatten", lambda: check_flatten(None)), ("quantize", check_quantize),
                         ("training", check_training)]:
            fn()
        print(f"dry run: {len(RESULTS['checks']) - len(FAILED)} of {len(RESULTS['checks'])} "
              "checks passed")
        sys.exit(1 if FAILED else 0)
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run it on a GPU machine")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    ext = build_kernels()
    for name, fn in [("fused adam", lambda: check_fused_adam(ext)),
                     ("mixed adam", check_mixed_adam),
                     ("flatten", lambda: check_flatten(ext)), ("quantize", check_quantize),
                     ("streams", check_streams),
                     ("training", check_training)]:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - one broken part must not hide the rest
            import traceback
            traceback.print_exc()
            check(f"{name} (raised)", False, repr(err))
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    repeats = 5 if args.quick else 20
    for numel, pieces in [(100_000_000, 1), (100_000_000, 40)] + \
            ([] if args.quick else [(1_000_000_000, 8)]):
        for low in (False, True):
            time_adam(numel, pieces, low, bandwidth, repeats)
            torch.cuda.empty_cache()
    for stochastic in (False, True):
        time_mixed(100_000_000, stochastic, bandwidth, repeats)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    print(f"{len(RESULTS['checks']) - len(FAILED)} of {len(RESULTS['checks'])} checks passed"
          + (f"; FAILED: {', '.join(FAILED)}" if FAILED else ""))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
