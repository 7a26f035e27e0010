"""Code written for plain PyTorch / DDP, run unchanged on the engine (issue 16): every pattern
gives DDP's numbers against a single-process reference of DDP semantics (mean over ranks, sum
over micro-steps), or fails at once with an error naming the parameter and the fix."""
from __future__ import annotations

import itertools
import re
from contextlib import nullcontext

import pytest
import torch
from harness import batch, loss_fn, make_model, make_optimizer, max_relative_error, param_groups

from zeroengine.testing import run_ranks

STEPS = 3


def ddp_reference(world: int, accumulation: int, clip: float, steps: int = STEPS):
    """What DDP computes for the plain loop below: each micro-step's loss divided by the
    accumulation count by the user, gradients averaged over ranks and summed over micro-steps,
    torch's clip_grad_norm_ on the result. Returns (state, clip norms)."""
    model = make_model(0)
    opt = make_optimizer("adamw", param_groups(model))
    norms = []
    for step in range(steps):
        for micro in range(accumulation):
            for rank in range(world):
                tokens, targets = batch(step, micro, rank)
                (loss_fn(model(tokens), targets) / (accumulation * world)).backward()
        for p in model.parameters():  # the engine counts an absent gradient as zero
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}, norms


def plain_loop(cases):
    """On every rank: nanoGPT's loop shape on the engine - several loss.backward() per step,
    torch.nn.utils.clip_grad_norm_, optimizer.step(), optimizer.zero_grad()."""
    import zeroengine
    out = []
    for c in cases:
        model = make_model(0)
        opt = make_optimizer("adamw", param_groups(model))
        engine = zeroengine.initialize(model, {
            "gradient_accumulation_steps": c["config_accumulation"],
            "zero_optimization": {"stage": c["stage"], "reduce_bucket_size": 40,
                                  "stage3_param_persistence_threshold": c.get("persist", 0)}},
            optimizer=opt)
        rank = engine.comm.rank
        norms = []
        for step in range(STEPS):
            for micro in range(c["accumulation"]):
                tokens, targets = batch(step, micro, rank)
                last = micro == c["accumulation"] - 1
                with engine.no_sync() if c.get("no_sync") and not last else nullcontext():
                    (loss_fn(model(tokens), targets) / c["accumulation"]).backward()
            if c["clip"]:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                  c["clip"])))
            opt.step()
            opt.zero_grad()
        out.append((engine.consolidated_state_dict(), norms))
        engine.close()
    return out


ACCUMULATION_CASES = [dict(stage=s, accumulation=a, config_accumulation=ca, clip=0.0)
                      for s, (a, ca) in itertools.product((0, 1, 2, 3), ((3, 1), (2, 2), (3, 2)))]
NO_SYNC_CASES = [dict(stage=s, accumulation=3, config_accumulation=1, clip=0.05, no_sync=True)
                 for s in (0, 1, 2, 3)]
CLIP_CASES = [dict(stage=s, accumulation=a, config_accumulation=1, clip=0.05)
              for s, a in itertools.product((0, 1, 2, 3), (1, 2))]


def _check(results, cases, world):
    for i, c in enumerate(cases):
        expected, expected_norms = ddp_reference(world, c["accumulation"], c["clip"])
        for rank in range(world):
            state, norms = results[rank][i]
            err, where = max_relative_error(state, expected)
            assert err <= 1e-5, f"{c} rank {rank}: max relative error {err:.2e} at {where}"
            for got, want in zip(norms, expected_norms, strict=True):
                assert abs(got - want) <= 1e-5 * want, f"{c} rank {rank}: norm {got} != {want}"


@pytest.mark.parametrize("world", [2, 3])
def test_plain_loop_accumulation_matches_ddp(world):
    """Several loss.backward() before optimizer.step(), whatever the config's
    gradient_accumulation_steps (fewer, equal, or a count that is no multiple of it)."""
    _check(run_ranks(world, plain_loop, ACCUMULATION_CASES), ACCUMULATION_CASES, world)


def test_clip_grad_norm_in_the_loop_clips_by_the_global_norm():
    """torch.nn.utils.clip_grad_norm_(model.parameters(), max) returns the true global norm
    on every rank and clips by it, at every stage (the clip is active: 0.05 < the norms)."""
    _check(run_ranks(2, plain_loop, CLIP_CASES), CLIP_CASES, 2)


def load_other_ranks_optimizer_state(_):
    import zeroengine
    model = make_model(0)
    opt = make_optimizer("adamw", param_groups(model))
    engine = zeroengine.initialize(model, {"zero_optimization": {"stage": 1}}, optimizer=opt)
    tokens, targets = batch(0, 0, engine.comm.rank)
    loss_fn(model(tokens), targets).backward()
    opt.step()
    states = engine.comm.all_gather_object(opt.state_dict())  # every rank's shard
    opt.load_state_dict(states[engine.comm.rank])  # its own: fine
    try:
        opt.load_state_dict(states[0])  # nanoGPT's resume: rank 0's file on every rank
    except ValueError as err:
        return str(err)
    return None


def test_loading_another_ranks_optimizer_shard_is_refused():
    messages = run_ranks(2, load_other_ranks_optimizer_state, None)
    assert messages[0] is None
    assert "rank 1 was given the optimizer state of rank 0" in messages[1]
    assert "engine.load_checkpoint" in messages[1]


# -- modules with buffers / recurrent state, trained by a plain loop ------------------------------
class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 8, 3, bias=False)  # BN cancels a bias: its grad is noise
        self.bn = torch.nn.BatchNorm1d(8)
        self.lstm = torch.nn.LSTM(8, 6, batch_first=True)
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))  # (batch, 8, length)
        y, _ = self.lstm(h.transpose(1, 2))
        return self.out(y[:, -1])


def bn_data(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(7_000 + 100 * step + 10 * micro + rank)
    return torch.randn(4, 3, 9, generator=g) * (1 + rank), torch.randn(4, 2, generator=g)


def bn_loop(stage: int, accumulation: int = 2):
    import zeroengine
    torch.manual_seed(0)
    model = ConvBN()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine = zeroengine.initialize(model, {"zero_optimization": {
        "stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0}},
        optimizer=opt)
    for step in range(STEPS):
        for micro in range(accumulation):
            x, y = bn_data(step, micro, engine.comm.rank)
            (torch.nn.functional.mse_loss(model(x), y) / accumulation).backward()
        opt.step()
        opt.zero_grad()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    state = engine.consolidated_state_dict()
    engine.close()
    return state, buffers


def bn_reference(world: int, accumulation: int = 2):
    """DDP: before every forward each rank takes rank 0's buffers; gradients as usual."""
    torch.manual_seed(0)
    model = ConvBN()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rank0 = {k: v.clone() for k, v in model.named_buffers()}
    last = {}
    for step in range(STEPS):
        for micro in range(accumulation):
            for rank in range(world):
                model.load_state_dict({**model.state_dict(), **rank0})
                x, y = bn_data(step, micro, rank)
                (torch.nn.functional.mse_loss(model(x), y) / (accumulation * world)).backward()
                last[rank] = {k: v.clone() for k, v in model.named_buffers()}
            rank0 = last[0]  # the ranks ran this micro-step side by side
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}, last


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_batchnorm_and_lstm_follow_ddp_buffer_semantics(stage):
    results = run_ranks(2, bn_loop, stage)
    expected, buffers = bn_reference(2)
    for rank, (state, got_buffers) in enumerate(results):
        trained = {k: v for k, v in state.items() if k in dict(ConvBN().named_parameters())}
        err, where = max_relative_error(
            trained, {k: expected[k] for k in trained})
        assert err <= 1e-5, f"stage {stage} rank {rank}: {err:.2e} at {where}"
        for k, v in buffers[rank].items():
            assert torch.allclose(got_buffers[k].float(), v.float(), rtol=1e-5, atol=1e-7), \
                f"stage {stage} rank {rank}: buffer {k}"


# -- parameters replaced after initialize ----------------------------------------------------------
def replaced(how: str):
    import zeroengine
    from zeroengine import ParameterReplacedError, ShardedParameterAccessError
    model = make_model(0)
    opt = make_optimizer("adamw", param_groups(model))
    engine = zeroengine.initialize(model, {"zero_optimization": {
        "stage": 3 if how.startswith("stage3") else 1, "stage3_param_persistence_threshold": 0}},
        optimizer=opt)
    try:
        if how in ("to", "stage3-to"):
            model.to("cpu:0")  # what the HF Trainer and accelerate do under torchrun on CPU
        elif how in ("half", "stage3-half"):
            model.half()
        elif how == "new-parameter":
            model.body[0].weight = torch.nn.Parameter(model.body[0].weight.detach().clone())
        elif how == "new-values":
            model.body[0].weight.data = model.body[0].weight.detach() + 1
        for step in range(STEPS):
            tokens, targets = batch(step, 0, engine.comm.rank)
            loss_fn(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
    except (ParameterReplacedError, ShardedParameterAccessError) as err:
        return str(err)
    return engine.consolidated_state_dict()


def test_parameters_replaced_after_initialize_are_rebound_or_refused_by_name():
    expected, _ = ddp_reference(2, 1, 0.0)
    for how in ("to", "stage3-to"):
        for rank, state in enumerate(run_ranks(2, replaced, how)):
            err, where = max_relative_error(state, expected)  # re-bound: trains as before
            assert err <= 1e-5, f"{how} rank {rank}: {err:.2e} at {where}"
    for how, words in (("half", ["'embed.weight'", "torch.float16", "bf16"]),
                       ("new-parameter", ["'body.0.weight'", "another Parameter object"]),
                       ("new-values", ["'body.0.weight'", "gathered_parameters"]),
                       ("stage3-half", ["'embed.weight'", "stage 3", "half()"])):
        for message in run_ranks(2, replaced, how):
            assert isinstance(message, str), f"{how}: not refused"
            for word in words:
                assert word in message, (how, message)


# -- the model wrapped in torch DDP on top of the engine (what the HF Trainer does) ---------------
def wrapped_in_ddp(_):
    import zeroengine
    model = make_model(0)
    engine = zeroengine.initialize(model, {"zero_optimization": {"stage": 2}},
                                   optimizer=make_optimizer("adamw", param_groups(model)))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    try:
        ddp(batch(0, 0, engine.comm.rank)[0])
    except RuntimeError as err:
        return str(err)
    return None


def test_outer_ddp_wrapper_is_refused():
    for message in run_ranks(2, wrapped_in_ddp, None):
        assert message is not None and "DistributedDataParallel" in message
        assert "without DDP" in message


# -- stage 3 outside forward -----------------------------------------------------------------------
def stage3_reads(_):
    import copy

    import zeroengine
    from zeroengine import ShardedParameterAccessError
    model = make_model(0)
    opt = make_optimizer("adamw", param_groups(model))
    engine = zeroengine.initialize(model, {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}, optimizer=opt)
    tokens, targets = batch(0, 0, engine.comm.rank)
    loss_fn(model(tokens), targets).backward()
    opt.step()
    w = model.body[0].weight
    refused = {}
    reads = {"sum": lambda: w.sum(), "clone": lambda: w.clone(), "norm": lambda: w.norm(),
             "numpy": lambda: w.detach().numpy(), "deepcopy": lambda: copy.deepcopy(model),
             "to-float64": lambda: w.to(torch.float64), "state_dict": lambda: model.state_dict(),
             "print": lambda: repr(w), "data": lambda: w.data.sum()}
    for what, read in reads.items():
        try:
            read()
        except ShardedParameterAccessError as err:
            refused[what] = str(err)
    with zeroengine.gathered_parameters(model.parameters()):
        inside = w.detach().clone()
        ema = copy.deepcopy(model)  # the EMA pattern, where the values are there
    ema(tokens).sum().backward()  # the copy is a plain model: no engine hooks ride along
    full = engine.consolidated_state_dict()
    metadata = (tuple(w.shape), w.dtype, w.requires_grad, w.grad is None,
                isinstance(w, torch.nn.Parameter))
    return refused, list(reads), inside, full["body.0.weight"], \
        ema.body[0].weight.detach().clone(), metadata


def test_stage3_reads_outside_forward_raise_by_name_or_give_true_values():
    for refused, reads, inside, full, ema, metadata in run_ranks(2, stage3_reads, None):
        assert sorted(refused) == sorted(reads), f"not refused: {set(reads) - set(refused)}"
        for what, message in refused.items():
            assert re.search(r"parameter '[\w.]+' is partitioned", message), (what, message)
            assert "gathered_parameters" in message and "consolidated_state_dict" in message
        assert torch.equal(inside, full) and torch.equal(ema, full)
        assert metadata == ((17, 9), torch.float32, True, True, True)


# -- modules that use a child's parameters without calling the child ------------------------------
class AttentionNet(torch.nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.embed = torch.nn.Embedding(11, dim)
        self.attn = torch.nn.MultiheadAttention(dim, 4, batch_first=True)
        self.head = torch.nn.Linear(dim, 11)
        self.scale = torch.nn.Parameter(torch.ones(dim))  # read by the root's own forward

    def forward(self, tokens):
        h = self.embed(tokens)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((h + a) * self.scale)


def sgd_reference(model_class, world: int = 2) -> dict:
    """Single-process DDP semantics with SGD-momentum; a parameter no rank used gets a zero
    gradient (the engine's rule)."""
    torch.manual_seed(0)
    model = model_class()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for rank in range(world):
            tokens, targets = batch(step, 0, rank)
            (loss_fn(model(tokens), targets) / world).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def attention_loop(stage: int, unit: int | None = None):
    import zeroengine
    torch.manual_seed(0)
    model = AttentionNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grouping = {} if unit is None else {"stage3_fetch_unit_size": unit}
    engine = zeroengine.initialize(model, {"zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500,
        **grouping}}, optimizer=opt)
    for step in range(STEPS):
        tokens, targets = batch(step, 0, engine.comm.rank)
        loss_fn(model(tokens), targets).backward()
        opt.step()
        opt.zero_grad()
    state = engine.consolidated_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("unit", [None, 500], ids=["default-units", "grouped-units"])
def test_multihead_attention_at_stage3_without_annotation(unit):
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj; the root reads
    its own parameter: both are gathered on demand, in forward and backward - also when
    out_proj shares a fetch unit with modules that run. (SGD: the key bias's true gradient is
    zero, and Adam would turn its rounding noise into steps.)"""
    expected = sgd_reference(AttentionNet)
    for rank, state in enumerate(run_ranks(2, attention_loop, 3, unit)):
        err, where = max_relative_error(state, expected)
        assert err <= 1e-5, f"rank {rank}: {err:.2e} at {where}"


# -- rank-divergent work at stage 3 ----------------------------------------------------------------
def diverge(pattern: str):
    import time

    import zeroengine
    from zeroengine import RankDivergenceError
    model = make_model(0)
    opt = make_optimizer("adamw", param_groups(model))
    engine = zeroengine.initialize(model, {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}, optimizer=opt)
    rank = engine.comm.rank
    start = time.monotonic()
    try:
        for step in range(2):
            if step == 1 and rank == 0:  # nanoGPT: `if master_process: estimate_loss()`
                model.eval()
                with torch.no_grad():
                    model(batch(9, 0, 0)[0])
                    if pattern == "generate":
                        model(batch(9, 1, 0)[0])
                model.train()
            tokens, targets = batch(step, 0, rank)
            loss_fn(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
    except RankDivergenceError as err:
        return str(err), time.monotonic() - start
    return None, None


@pytest.mark.parametrize("pattern", ["estimate_loss", "generate"])
def test_rank_divergence_at_stage3_fails_fast_on_every_rank(pattern):
    for rank, (message, seconds) in enumerate(run_ranks(2, diverge, pattern, timeout=120)):
        assert message is not None, f"rank {rank} did not notice"
        assert "rank 0:" in message and "without gradients" in message and "rank 1:" in message
        assert "a forward" in message and seconds < 30


class Experts(torch.nn.Module):
    """Each input runs through one expert chosen by its data: ranks run different experts."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(9, 9) for _ in range(3))

    def forward(self, h, choice: int):
        return self.experts[choice](h)


class MoENet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 9)
        self.moe = Experts()
        self.head = torch.nn.Linear(9, 11)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.moe(h, int(tokens[0, 0]) % 3))


def moe_loop(leaf: bool):
    import zeroengine
    from zeroengine import RankDivergenceError
    torch.manual_seed(0)
    model = MoENet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = zeroengine.initialize(model, {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0,
        "stage3_leaf_modules": ["Experts"] if leaf else []}}, optimizer=opt)
    try:
        for step in range(STEPS):
            tokens, targets = batch(step, 0, engine.comm.rank)
            loss_fn(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
    except RankDivergenceError as err:
        return str(err)
    return engine.consolidated_state_dict()


def test_moe_experts_on_some_ranks_need_leaf_modules_and_then_match():
    expected = sgd_reference(MoENet)
    for rank, state in enumerate(run_ranks(2, moe_loop, True)):
        err, where = max_relative_error(state, expected)
        assert err <= 1e-5, f"rank {rank}: {err:.2e} at {where}"
    for message in run_ranks(2, moe_loop, False):  # without the setting: a named failure
        assert isinstance(message, str) and "moe.experts" in message, message
        assert "stage3_leaf_modules" in message


def test_stage3_says_when_the_persistence_threshold_keeps_the_model_whole(monkeypatch):
    import warnings

    import zeroengine
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    with pytest.warns(UserWarning, match="stage3_param_persistence_threshold=100,000"):
        zeroengine.initialize(make_model(0), config).close()
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        zeroengine.initialize(make_model(0), config).close()


# -- nanoGPT's train.py loop, two lines changed ----------------------------------------------------
def nano_model():
    from zeroengine.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=32, context=8, layers=2, heads=2, dim=16))


def nano_optimizer(model):
    # nanoGPT's groups (decay on matrices). eps=1e-3: the attention key bias's true gradient is
    # zero, and Adam with a tiny eps turns its rounding noise into full-size steps.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": other, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-3)


def nano_batch(it: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(5_000 + 100 * it + 10 * micro + rank)
    x = torch.randint(0, 32, (2, 9), generator=g)
    return x[:, :-1], x[:, 1:]


NANO_ITERS, NANO_ACCUMULATION = 4, 2


def nano_lr(it: int) -> float:
    return 1e-2 * (1 - it / (2 * NANO_ITERS))  # nanoGPT sets the lr by hand every iteration


def nanogpt_loop(stage: int, out_dir: str):
    import os

    import zeroengine
    model = nano_model()
    optimizer = nano_optimizer(model)
    engine = zeroengine.initialize(model, {"zero_optimization": {  # was: DDP(model)
        "stage": stage, "stage3_param_persistence_threshold": 0}}, optimizer=optimizer)
    master_process = engine.comm.rank == 0
    norms, evals = [], []
    for it in range(NANO_ITERS):
        for param_group in optimizer.param_groups:
            param_group["lr"] = nano_lr(it)
        if it == 2 and (master_process or stage == 3):  # stage 3: every rank evaluates
            model.eval()
            with torch.no_grad():
                evals.append(model.loss(*nano_batch(99, 0, 0)).item())
            model.train()
        for micro in range(NANO_ACCUMULATION):
            x, y = nano_batch(it, micro, engine.comm.rank)
            (model.loss(x, y) / NANO_ACCUMULATION).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if master_process and stage < 3:  # nanoGPT's checkpoint: rank 0, model.state_dict()
        torch.save({"model": model.state_dict()}, os.path.join(out_dir, "ckpt.pt"))
    return engine.consolidated_state_dict(), norms, evals


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nanogpt_train_loop_matches_ddp(stage, tmp_path):
    model = nano_model()
    optimizer = nano_optimizer(model)
    norms, evals = [], []
    for it in range(NANO_ITERS):
        for param_group in optimizer.param_groups:
            param_group["lr"] = nano_lr(it)
        if it == 2:
            model.eval()
            with torch.no_grad():
                evals.append(model.loss(*nano_batch(99, 0, 0)).item())
            model.train()
        for micro in range(NANO_ACCUMULATION):
            for rank in range(2):
                x, y = nano_batch(it, micro, rank)
                (model.loss(x, y) / (NANO_ACCUMULATION * 2)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    expected = {k: v.detach().float() for k, v in model.state_dict().items()}
    results = run_ranks(2, nanogpt_loop, stage, str(tmp_path))
    for rank, (state, got_norms, got_evals) in enumerate(results):
        err, where = max_relative_error(state, expected)
        assert err <= 1e-5, f"stage {stage} rank {rank}: {err:.2e} at {where}"
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got_norms, norms, strict=True))
        assert all(n > 0.05 for n in norms)  # the clip was active
        if rank == 0 or stage == 3:
            assert got_evals == pytest.approx(evals, rel=1e-5)
    if stage < 3:
        saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
        err, where = max_relative_error({k: v.float() for k, v in saved.items()}, expected)
        assert err <= 1e-5, f"rank 0's torch.save(model.state_dict()): {err:.2e} at {where}"


def test_engine_no_sync_accumulates_like_ddp_no_sync():
    """DDP code's `with model.no_sync():` for all but the last micro-step becomes
    `with engine.no_sync():` and gives the same numbers, with or without clipping."""
    _check(run_ranks(2, plain_loop, NO_SYNC_CASES), NO_SYNC_CASES, 2)


# -- the clip_grad_norm_ redirect lives with the engines (issue 38) -------------------------------
def clip_redirect_lifetime(_):
    import torch.nn.utils as utils

    import zeroengine
    from zeroengine.core import registry
    from zeroengine.core.compat import drop_in
    torch_fn = drop_in._torch_clip_grad_norm_
    seen = {"import changes nothing": utils.clip_grad_norm_ is torch_fn}
    early = utils.clip_grad_norm_  # `from torch.nn.utils import clip_grad_norm_` at the top
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2}}
    first = zeroengine.initialize(make_model(0), cfg)
    second = zeroengine.initialize(make_model(1), cfg)
    seen["installed by the first engine"] = utils.clip_grad_norm_ is drop_in.clip_grad_norm_
    tokens, targets = batch(0, 0, 0)
    first.backward(loss_fn(first(tokens), targets))
    try:
        early(first.module.parameters(), 1.0)
        seen["early-bound copy refused"] = False
    except RuntimeError as err:
        seen["early-bound copy refused"] = "binds torch's own" in str(err)
    first.close()
    seen["kept while one engine is open"] = utils.clip_grad_norm_ is drop_in.clip_grad_norm_
    second.close()
    seen["torch's back after the last close"] = utils.clip_grad_norm_ is torch_fn and \
        torch.nn.utils.clip_grad._clip_grads_with_norm_ is drop_in._torch_clip_grads_with_norm_
    seen["registry empty"] = registry.held_count("optimizer") == 0 and \
        registry.held_count("whole") == 0
    return seen


def test_clip_grad_norm_redirect_is_installed_by_the_first_engine_and_removed_by_the_last():
    seen = run_ranks(1, clip_redirect_lifetime, None)[0]
    assert all(seen.values()), seen


def test_registry_is_keyed_by_the_parameter_and_holds_nothing_alive():
    import gc

    from zeroengine.core import registry

    class Holder:
        pass
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))  # equal values
    first, second = Holder(), Holder()
    registry.hold(a, optimizer=first)
    registry.hold(b, optimizer=second, fetcher=first)
    assert registry.held_by(a, "optimizer") is first and registry.held_by(b, "optimizer") is second
    assert registry.held_by(a, "fetcher") is None
    registry.let_go(b, "optimizer")
    assert registry.held_by(b, "optimizer") is None and registry.held_by(b, "fetcher") is first
    del first
    gc.collect()
    assert registry.held_by(a, "optimizer") is None  # the holder went: no entry keeps it alive
    before = len(registry._HOLDERS)
    del b
    gc.collect()
    assert len(registry._HOLDERS) == before - 1  # the parameter went: its entry with it
    registry.let_go(a, "optimizer")
