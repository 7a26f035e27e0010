"""A small model with every awkward feature the engine must handle, its data, and the
single-process plain-PyTorch reference training loop the engine is compared against."""
from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HIDDEN = 11, 9, 17


class AwkwardNet(nn.Module):
    """Tied embedding/head, a frozen layer, a layer that never gets a gradient, a buffer,
    and sizes that divide no world size."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.unused = nn.Linear(3, 5)  # never called: its gradient is absent (counts as zero)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, tokens):
        h = self.embed(tokens) * self.scale
        h = h + self.frozen(h)
        return self.head(self.norm(self.body(h)))


def make_model(seed: int = 0) -> AwkwardNet:
    torch.manual_seed(seed)
    return AwkwardNet()


def batch(step: int, micro: int, rank: int, size: int = 4, length: int = 5):
    g = torch.Generator().manual_seed(1_000_000 + step * 10_000 + micro * 100 + rank)
    tokens = torch.randint(0, VOCAB, (size, length), generator=g)
    targets = torch.randint(0, VOCAB, (size, length), generator=g)
    return tokens, targets


def global_batch(step: int, world: int, rank: int):
    """Rank ``rank``'s part of step ``step``'s batch of 8 samples (two ``batch`` calls), the
    same 8 at every world size that divides them: runs of other engines at world 2 and ours
    at world 1 or 2 see one global batch."""
    parts = [batch(step, 0, r) for r in range(2)]
    tokens = torch.cat([p[0] for p in parts])
    targets = torch.cat([p[1] for p in parts])
    size = tokens.shape[0] // world
    return tokens[rank * size:(rank + 1) * size], targets[rank * size:(rank + 1) * size]


def load_refused(engine, root: str) -> str:
    """``engine.load_checkpoint(root)``'s CheckpointError message, asserting it changed none
    of the engine's values ("loaded" if it did not refuse)."""
    from zeroengine import CheckpointError
    before = engine.consolidated_state_dict()
    try:
        engine.load_checkpoint(root)
    except CheckpointError as err:
        after = engine.consolidated_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "half-loaded"
        return str(err)
    return "loaded"


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def param_groups(model, lr=0.01):
    """Two groups with their own hyperparameters: matrices decay, vectors do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad]
    other = [p for p in model.parameters() if p.dim() < 2 and p.requires_grad]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": other, "weight_decay": 0.0, "lr": lr * 2}]


def make_optimizer(name: str, params, lr=0.01):
    """The named optimizer over ``params`` (param_groups' two groups); "muon" is a list:
    torch's Muon on the matrices, AdamW on the rest (Muon takes only 2-D parameters)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr)
    if name == "lamb":
        from zeroengine.ops import Lamb
        return Lamb(params, lr=lr, weight_decay=0.01)
    if name == "muon":
        groups = [g for g in params if isinstance(g, dict)] or [{"params": list(params)}]
        matrices = [dict(g, params=[p for p in g["params"] if p.dim() == 2]) for g in groups]
        rest = [dict(g, params=[p for p in g["params"] if p.dim() != 2]) for g in groups]
        return [torch.optim.Muon([g for g in matrices if g["params"]], lr=lr * 2),
                torch.optim.AdamW([g for g in rest if g["params"]], lr=lr)]
    raise ValueError(name)


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """Muon's orthogonalisation (quintic Newton-Schulz) in fp32. torch's runs it in bf16, where
    the last-bit differences of any two summation orders of the same gradient (a DDP run vs a
    single process, or two stages) grow to ~1e-3; exactness tests swap this one in."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@contextlib.contextmanager
def fp32_muon():
    """torch's Muon with fp32_newton_schulz inside, until the block ends."""
    import torch.optim._muon as muon
    stock = muon._zeropower_via_newtonschulz
    muon._zeropower_via_newtonschulz = fp32_newton_schulz
    try:
        yield
    finally:
        muon._zeropower_via_newtonschulz = stock


def reference_train(optimizer_name: str, world_size: int, steps: int, accumulation: int,
                    clip: float, seed: int = 0, lr_gamma: float | None = None):
    """Plain single-process training on the same global batches: per step, the gradient is the
    mean over all ranks' and micro-steps' batches."""
    model = make_model(seed)
    made = make_optimizer(optimizer_name, param_groups(model))
    opts = made if isinstance(made, list) else [made]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, lr_gamma) for o in opts] if lr_gamma else []
    # A parameter that gets no gradient counts as a zero gradient (as in DeepSpeed), not as
    # "skip this parameter" (torch's meaning of grad None): give every trainable one a tensor.
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=False)
        for micro in range(accumulation):
            for rank in range(world_size):
                tokens, targets = batch(step, micro, rank)
                loss = loss_fn(model(tokens), targets) / (world_size * accumulation)
                loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                           clip)
        for opt in opts:
            opt.step()
        for sched in scheds:
            sched.step()
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def train_engine(config: dict, optimizer: str | None, steps: int, accumulation: int = 1,
                 drop_in: bool = False, each_step=None, seed: int = 0):
    """The engine side of every comparison with ``reference_train``: make_model(seed) under
    zeroengine.initialize(config) with the named optimizer on param_groups (None: the config's
    own), then ``steps`` optimizer steps of ``run_step`` on this rank's batches, calling
    ``each_step(engine)`` after each. Returns (engine, losses); the caller reads what it
    compares and closes the engine."""
    import zeroengine
    model = make_model(seed)
    opt = make_optimizer(optimizer, param_groups(model)) if optimizer else None
    engine = zeroengine.initialize(model, config, optimizer=opt)
    losses = []
    for step in range(steps):
        losses += run_step(engine, step, accumulation, drop_in)
        if each_step is not None:
            each_step(engine)
    return engine, losses


def run_step(engine, step: int, accumulation: int, drop_in: bool = False) -> list[float]:
    """One optimizer step of the test loop on this rank's batches, through the engine's verbs
    or, with ``drop_in``, as a plain torch loop on the wrapped model (loss.backward();
    optimizer.step(); optimizer.zero_grad()). Returns the micro-steps' losses."""
    losses = []
    for micro in range(accumulation):
        tokens, targets = batch(step, micro, engine.comm.rank)
        loss = loss_fn(engine(tokens), targets)
        losses.append(loss.item())
        if drop_in:
            (loss / accumulation).backward()
        else:
            engine.backward(loss)
            engine.step()
    if drop_in:
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    return losses


def max_relative_error(a: dict, b: dict) -> tuple[float, str]:
    """Largest per-tensor max|a-b| / max|b| over a state dict, and where it is."""
    worst, where = 0.0, ""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in b:
        denom = b[k].abs().max().clamp_min(1e-12)
        err = ((a[k].float() - b[k].float()).abs().max() / denom).item()
        if err > worst:
            worst, where = err, k
    return worst, where


def clone_model(model):
    return copy.deepcopy(model)


def proc_status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0) and return it, so
    an earlier transient peak of this process cannot hide or inflate what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status_bytes("VmRSS")


# -- mixed precision against fp32 (test_precision.py and the stage/optimizer suites) ----------
PRECISION_STEPS = 4


def precision_config(name: str, stage: int, clip: float = 1.0, **fp16) -> dict:
    cfg = {"gradient_accumulation_steps": 2, "gradient_clipping": clip,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                 "stage3_param_persistence_threshold": 0}}
    if name.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if name.startswith("fp16"):
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, **fp16}
    if name.endswith("-fp32reduce"):
        cfg["communication_data_type"] = "fp32"
    if name == "fp16-static":
        cfg["fp16"]["loss_scale"] = 512
    return cfg


def train_precision_cases(cases, drop_in=False):
    """Each (precision, stage, optimizer, clip) case trained PRECISION_STEPS steps at 2-step
    accumulation: (consolidated state, skipped steps, loss scales, parameter dtypes)."""
    out = []
    for name, stage, opt, clip in cases:
        scales = []
        engine, _ = train_engine(precision_config(name, stage, clip), opt, PRECISION_STEPS, 2,
                                 drop_in, each_step=lambda e, scales=scales:
                                 scales.append(e.loss_scale))
        dtypes = {str(p.dtype) for p in engine.module.parameters()}
        out.append((engine.consolidated_state_dict(), engine.skipped_steps, scales, dtypes))
        engine.close()
    return out


def relative_deviation(state: dict, reference: dict, initial: dict) -> float:
    """|p - p_ref| over |p_ref - p_0|, over all trainable tensors: how far the mixed-precision
    trajectory strays from the fp32 one, relative to how far training moved the weights."""
    num = den = 0.0
    for k, ref in reference.items():
        if k.startswith("frozen") or k == "scale":  # not trained
            continue
        num += (state[k] - ref).double().pow(2).sum().item()
        den += (ref - initial[k]).double().pow(2).sum().item()
    return math.sqrt(num / den)


# Why 0.1: bf16 keeps 8 significant bits (unit roundoff 2^-9) and fp16 11; the matmuls round
# their inputs, so gradients are off by ~1% (bf16) relative. Adam normalises every element's
# step, so a 1% gradient error moves the update by ~1% - except where a gradient is within
# rounding of zero and its sign flips (up to 2 lr). Measured on this model (4 steps, 2 ranks):
# 0.044 for bf16 and 0.0011 for fp16 at every stage, with either reduce dtype. 0.1 leaves ~2x room
# for that noise, while a missed or doubled unscale (x1024 in the SGD cases), a stale master or
# updates lost on one rank's shard give deviations of order 1 or more.
TOLERANCE = 0.1


# -- checkpoints: training whose world size changes at a resume (test_checkpoint.py) ------------
def checkpoint_reference(worlds: list[int]) -> dict:
    """Single-process AdamW where step i averages the batches of worlds[i] ranks."""
    model = make_model()
    opt = make_optimizer("adamw", param_groups(model))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for step, world in enumerate(worlds):
        opt.zero_grad(set_to_none=False)
        for rank in range(world):
            tokens, targets = batch(step, 0, rank)
            (loss_fn(model(tokens), targets) / world).backward()
        opt.step()
        sched.step()
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


# -- the train job (zeroengine train): a config small enough for a test -------------------------
TINY_JOB = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
            "job": {"run_name": "tiny",
                    "model": {"layers": 1, "heads": 2, "dim": 32, "context": 16},
                    "steps": 4, "eval_interval": 2, "eval_batches": 1, "checkpoint_interval": 2}}
