"""Tensor-wise optimizers (Muon, Adafactor, LAMB, a user's own): classified at initialize, each
parameter stepped whole on its owner, equal to plain single-process PyTorch at every stage."""
from __future__ import annotations

import math

import pytest
import torch
from harness import (
    TOLERANCE,
    batch,
    fp32_muon,
    loss_fn,
    make_model,
    param_groups,
    precision_config,
    reference_train,
    relative_deviation,
    train_engine,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

import zeroengine
from zeroengine.core.layout.partition import FlatLayout
from zeroengine.core.optim.kind import (
    ELEMENTWISE,
    TENSORWISE,
    OptimizerKindError,
    optimizer_kind,
)
from zeroengine.core.optim.owner_partition import OwnerPartition
from zeroengine.ops import CPUAdam, Lamb
from zeroengine.testing import run_ranks

STEPS = 5


# -- optimizers written for the tests ----------------------------------------------------------
class NormalizedSGD(torch.optim.Optimizer):
    """p -= lr * g / ||g||, per tensor: on flat chunks each chunk would be normalised by its
    own norm instead - what zeroengine did, silently, before it probed optimizers."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=group["lr"])


class GlobalNormSGD(torch.optim.Optimizer):
    """Normalises by the norm of *all* gradients: couples parameters, so neither path fits."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad / norm, alpha=group["lr"])


class NoisySGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad + 0.01 * torch.randn_like(p), alpha=group["lr"])


class AdamWSubclass(torch.optim.AdamW):
    """A subclass of a known elementwise class whose step is not elementwise any more: the
    known list must not vouch for it (it is probed)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(p.grad.norm().clamp_min(1e-12))
        return super().step(closure)


# -- classification ------------------------------------------------------------------------------
def kind_of(optimizer):
    return optimizer_kind(optimizer, optimizer.param_groups[0])


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax",
                                  "NAdam", "RAdam", "Rprop", "ASGD", "Adadelta"])
def test_torch_elementwise_optimizers_pass_the_probe(name):
    """The known list and the probe agree on every elementwise torch optimizer."""
    from zeroengine.core.optim.kind import probe_kind
    params = [torch.zeros(4, 3), torch.zeros(5)]
    opt = getattr(torch.optim, name)(params, lr=0.01)
    assert kind_of(opt) == ELEMENTWISE
    assert probe_kind(type(opt), opt.defaults, opt.param_groups[0]) == ELEMENTWISE


def test_tensorwise_optimizers_are_recognised():
    from zeroengine.core.optim.kind import probe_kind
    matrix = [torch.zeros(4, 3)]
    for opt in (torch.optim.Muon(matrix), torch.optim.Adafactor(matrix + [torch.zeros(5)]),
                Lamb(matrix), NormalizedSGD(matrix), AdamWSubclass(matrix)):
        assert kind_of(opt) == TENSORWISE, type(opt).__name__
        # the probe alone reaches the same verdict for the known ones
        assert probe_kind(type(opt), opt.defaults, opt.param_groups[0]) == TENSORWISE


def test_unshardable_optimizers_are_refused_by_name():
    with pytest.raises(OptimizerKindError, match="GlobalNormSGD.*depends on the other"):
        kind_of(GlobalNormSGD([torch.zeros(3, 2), torch.zeros(4)]))
    with pytest.raises(OptimizerKindError, match="NoisySGD.*different results.*declare_"):
        kind_of(NoisySGD([torch.zeros(3, 2)]))
    with pytest.raises(OptimizerKindError, match="LBFGS.*line search"):
        kind_of(torch.optim.LBFGS([torch.zeros(3)]))


def test_declared_optimizers_skip_the_probe():
    class Declared(NoisySGD):
        zeroengine_update = "tensorwise"
    assert kind_of(Declared([torch.zeros(3, 2)])) == TENSORWISE

    class Registered(NoisySGD):
        pass
    zeroengine.declare_optimizer(Registered, "elementwise")
    assert kind_of(Registered([torch.zeros(3, 2)])) == ELEMENTWISE
    with pytest.raises(ValueError, match="kind must be one of"):
        zeroengine.declare_optimizer(Registered, "rowwise")


def test_probe_leaves_the_random_stream_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    kind_of(NormalizedSGD([torch.zeros(3, 2)]))
    assert torch.equal(torch.rand(3), expected)


# -- the owner partition -----------------------------------------------------------------------
@settings(max_examples=examples(150), deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1,
                       max_size=12),
       world=st.integers(1, 5), bucket=st.integers(1, 200))
def test_owner_partition_covers_every_parameter_once(shapes, world, bucket):
    layout = FlatLayout(shapes, world, bucket, align=2)
    part = OwnerPartition.of_layout(layout)
    numels = [s.numel for s in layout.slots]
    owned = sorted(i for rank in part.owned for i, _ in rank)
    assert owned == list(range(len(numels)))
    assert sum(part.owned_numel) == sum(numels)
    # balanced: greedy list scheduling's bound
    assert max(part.owned_numel) <= max(sum(numels) / world + max(numels), layout.shard_numel)
    # every element of every parameter reaches its owner exactly once (local or sent)
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(world):
        pieces = list(part.local[rank]) + [p for o in range(world) for p in part.sends[rank][o]]
        for p in pieces:
            seen[p.param][p.param_offset:p.param_offset + p.numel] += 1
        for o in range(world):
            assert all(part.owner[p.param] == o for p in part.sends[rank][o])
        assert all(part.owner[p.param] == rank for p in part.local[rank])
    assert all(bool((s == 1).all()) for s in seen)
    sent = sum(part.moved_numel(r)[0] for r in range(world))
    assert sent == sum(part.moved_numel(r)[1] for r in range(world))


# -- training equals plain PyTorch ---------------------------------------------------------------
OPTIMIZERS = ("muon", "adafactor", "lamb")


def fp32_config(stage: int) -> dict:
    return {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                  "stage3_param_persistence_threshold": 0}}


def train_cases(cases):
    out = []
    with fp32_muon():
        for config, optimizer in cases:
            engine, _ = train_engine(config, optimizer, STEPS, 2)
            out.append((engine.consolidated_state_dict(), engine.optimizer.inner_name))
            engine.close()
    return out


def fp32_reference(name: str, world: int) -> dict:
    with fp32_muon():
        return reference_train(name, world, STEPS, 2, 0.5)


def max_rel_error(state: dict, reference: dict) -> float:
    return max(((state[k] - v).norm() / v.norm().clamp_min(1e-12)).item()
               for k, v in reference.items())


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_equals_single_process(world):
    """<= 1e-5 relative after 5 steps (accumulation 2, clipping 0.5 engaged, two param groups,
    tied, frozen and unused parameters), stages 0-3, Muon (+AdamW), Adafactor, LAMB."""
    cases = [(fp32_config(stage), name) for stage in (0, 1, 2, 3) for name in OPTIMIZERS]
    results = run_ranks(world, train_cases, cases)
    for index, (config, name) in enumerate(cases):
        reference = fp32_reference(name, world)
        initial = make_model().state_dict()
        moved = max_rel_error(initial, {k: v for k, v in reference.items()})
        for rank in range(world):
            state, inner = results[rank][index]
            err = max_rel_error(state, reference)
            stage = config["zero_optimization"]["stage"]
            assert err <= 1e-5, f"{name} stage {stage} rank {rank}: {err:.2e}"
        assert moved > 1e-3  # training moved the weights: the comparison means something
        if name == "muon":
            assert inner == "Muon+AdamW"


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_tracks_fp32(world):
    """bf16 compute with fp32 masters, within test_precision's tracking tolerance of the fp32
    single-process run (measured: <= 0.007 at world 2)."""
    cases = [(precision_config("bf16", stage, clip=0.5), name)
             for stage in (1, 2, 3) for name in OPTIMIZERS]
    results = run_ranks(world, train_cases, cases)
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    for index, (config, name) in enumerate(cases):
        reference = fp32_reference(name, world)
        for rank in range(world):
            deviation = relative_deviation(results[rank][index][0], reference, initial)
            assert deviation < TOLERANCE, f"{name} {config['zero_optimization']}: {deviation}"


def stock_muon_and_offload(cases):
    out = []
    for config, optimizer in cases:
        engine, _ = train_engine(config, optimizer, STEPS, 2)
        out.append(engine.consolidated_state_dict())
        engine.close()
    return out


def test_stock_muon_and_offload():
    """torch's own Muon (bf16 Newton-Schulz) tracks the reference as closely as bf16 allows,
    and the CPU-offloaded step (optimizer state and stage-3 parameters in host memory) gives
    the same numbers as the plain one."""
    offload = {"offload_optimizer": {"device": "cpu"}}
    cases = [(fp32_config(2), "muon"),
             (dict(fp32_config(2), zero_optimization={**fp32_config(2)["zero_optimization"],
                                                      **offload}), "adafactor"),
             (dict(fp32_config(3), zero_optimization={
                 **fp32_config(3)["zero_optimization"], **offload,
                 "offload_param": {"device": "cpu"}}), "lamb")]
    results = run_ranks(2, stock_muon_and_offload, cases)
    stock = reference_train("muon", 2, STEPS, 2, 0.5)
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    assert relative_deviation(results[0][0], stock, initial) < 0.02
    for index in (1, 2):
        reference = reference_train(cases[index][1], 2, STEPS, 2, 0.5)
        assert max_rel_error(results[0][index], reference) <= 1e-5


# -- the deliberately tensor-wise custom optimizer -----------------------------------------------
def custom_optimizer_run(declare_elementwise: bool):
    if declare_elementwise:  # what zeroengine did before: trust it to be elementwise
        zeroengine.declare_optimizer(NormalizedSGD, "elementwise")
    model = make_model()
    engine = zeroengine.initialize(model, fp32_config(2),
                                   optimizer=NormalizedSGD(param_groups(model)))
    for step in range(3):
        for micro in range(2):
            tokens, targets = batch(step, micro, engine.comm.rank)
            engine.backward(loss_fn(engine(tokens), targets))
            engine.step()
    return engine.consolidated_state_dict(), engine.optimizer.parts[0].kind


def custom_reference():
    model = make_model()
    opt = NormalizedSGD(param_groups(model))
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        for micro in range(2):
            for rank in range(2):
                tokens, targets = batch(step, micro, rank)
                (loss_fn(model(tokens), targets) / 4).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.5)
        opt.step()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def test_custom_tensorwise_optimizer_is_probed_and_trains_right():
    reference = custom_reference()
    probed = run_ranks(2, custom_optimizer_run, False)
    assert probed[0][1] == TENSORWISE
    assert max_rel_error(probed[0][0], reference) <= 1e-5
    # on flat chunks (declared elementwise, i.e. the old behaviour) it is silently wrong
    flat = run_ranks(2, custom_optimizer_run, True)
    assert max_rel_error(flat[0][0], reference) > 1e-2


# -- memory and communication against the partition's formula ---------------------------------
def accounting_run():
    model = make_model()
    engine = zeroengine.initialize(model, fp32_config(2),
                                   optimizer=torch.optim.Adafactor(model.parameters(), lr=0.01))
    for micro in range(2):
        tokens, targets = batch(0, micro, engine.comm.rank)
        engine.backward(loss_fn(engine(tokens), targets))
        engine.step()
    comm = engine.comm_report()
    rank = engine.comm.rank
    (fi, owned), = engine.optimizer.owned.items()
    part = owned.partition
    expected_state = 0
    for i, _ in part.owned[rank]:
        shape = engine.flat_groups[fi].layout.slots[i].shape
        if len(shape) >= 2:  # Adafactor: a row and a column factor (fp32), and the step
            expected_state += (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:])) * 4
        else:
            expected_state += math.prod(shape) * 4
        expected_state += 4  # step, a float32 scalar tensor
    sent, received = part.moved_numel(rank)
    a2a = {k: v for k, v in comm.get("all_to_all", {}).items() if k != "exposed_s"}
    return (engine.memory_report(), engine.optimizer.state_nbytes(), expected_state,
            a2a, sent, received, part.owned_numel, rank)


def test_state_and_exchange_bytes_follow_the_partition():
    for memory, state, expected_state, a2a, sent, received, _owned_numel, _rank in \
            run_ranks(2, accounting_run):
        assert state == expected_state
        assert memory["optimizer_states"] == state  # fp32: the master is the parameters
        # masters there and back (fp32) + gradients (fp32 here): 3 exchanges of the pieces
        assert a2a == {"sent_bytes": 4 * (2 * sent + received),
                       "recv_bytes": 4 * (2 * received + sent), "calls": 3}


def test_config_lamb_and_cpu_adam_kinds():
    """DeepSpeed's "Lamb" config type builds zeroengine's LAMB; CPUAdam stays elementwise."""
    from zeroengine.config import OptimizerConfig
    from zeroengine.core.optim.factory import optimizer_from_config
    model = make_model()
    opt = optimizer_from_config(OptimizerConfig(type="Lamb", params={"lr": 1e-3}),
                                model.parameters())
    assert isinstance(opt, Lamb) and kind_of(opt) == TENSORWISE
    assert kind_of(CPUAdam([torch.zeros(3)], lr=0.1)) == ELEMENTWISE


# -- checkpoints: save, reshard, resume ----------------------------------------------------------
def ckpt_config(stage: int, offload: bool = False) -> dict:
    cfg = fp32_config(stage)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def train_then_save(root: str, name: str, stage: int, steps: int):
    with fp32_muon():
        engine, _ = train_engine(ckpt_config(stage), name, steps, 2)
        return engine.save_checkpoint(root), engine.consolidated_state_dict()


def resume_and_train(root: str, name: str, stage: int, offload: bool, steps: int):
    from harness import run_step
    with fp32_muon():
        engine, _ = train_engine(ckpt_config(stage, offload), name, 0, 2)
        engine.load_checkpoint(root)
        for step in range(engine.global_steps, engine.global_steps + steps):
            run_step(engine, step, 2)
        return engine.consolidated_state_dict()


@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_checkpoint_reshards_and_resumes_exactly(tmp_path, name):
    """Saved at world 2 (stage 2) after 2 steps; resumed at world 3 stage 3, and at world 1
    stage 1 with the optimizer offloaded, for 3 more steps: both equal plain PyTorch over the
    same batches (<= 1e-5). Each parameter's whole state is saved by name in its owner's file,
    so whichever rank owns it after resharding finds it."""
    root = str(tmp_path / "ckpt")
    path, saved = run_ranks(2, train_then_save, root, name, 2, 2)[0]
    # the files alone consolidate to the weights the engine held (no engine, no world size)
    from zeroengine.checkpoint.consolidate import consolidated_state_dict
    assert max_rel_error(consolidated_state_dict(path), saved) == 0.0
    # a resumed run at world W reads W ranks' batches: its reference takes the same ones
    for world, stage, offload in ((3, 3, False), (1, 1, True)):
        state = run_ranks(world, resume_and_train, root, name, stage, offload, 3)[0]
        reference = resumed_reference(name, root_steps=2, world_before=2, world_after=world)
        assert max_rel_error(state, reference) <= 1e-5, (world, stage)


def resumed_reference(name: str, root_steps: int, world_before: int, world_after: int) -> dict:
    """Single-process: root_steps steps on world_before ranks' batches, then 5 - root_steps
    on world_after ranks' batches (what the resumed engines see)."""
    from harness import make_optimizer as make
    with fp32_muon():
        model = make_model()
        made = make(name, param_groups(model))
        opts = made if isinstance(made, list) else [made]
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        for step in range(STEPS):
            world = world_before if step < root_steps else world_after
            for opt in opts:
                opt.zero_grad(set_to_none=False)
            for micro in range(2):
                for rank in range(world):
                    tokens, targets = batch(step, micro, rank)
                    (loss_fn(model(tokens), targets) / (world * 2)).backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                           0.5)
            for opt in opts:
                opt.step()
        return {k: v.detach().float() for k, v in model.state_dict().items()}


# -- a plain loop over two optimizers, each with its own scheduler -------------------------------
def two_optimizer_loop(engine_side: bool):
    """loss.backward(); muon.step(); adamw.step(); zero_grad both; a StepLR on Muon only. On the
    engine the loop is unchanged (drop-in): the first step() after a backward steps both."""
    from harness import make_optimizer as make
    world = 2
    with fp32_muon():
        model = make_model()
        muon, adamw = make("muon", param_groups(model))
        sched = torch.optim.lr_scheduler.StepLR(muon, 1, 0.5)
        if engine_side:
            runner = zeroengine.initialize(model, {"zero_optimization": {
                "stage": 2, "reduce_bucket_size": 40}}, optimizer=[muon, adamw])
            ranks = [runner.comm.rank]
        else:
            runner, ranks = model, range(world)
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        for step in range(3):
            for rank in ranks:
                tokens, targets = batch(step, 0, rank)
                (loss_fn(runner(tokens), targets) / (1 if engine_side else world)).backward()
            muon.step()
            adamw.step()
            muon.zero_grad(set_to_none=False)
            adamw.zero_grad(set_to_none=False)
            sched.step()
        state = runner.consolidated_state_dict() if engine_side else \
            {k: v.detach().float() for k, v in model.state_dict().items()}
        steps = runner.optimizer.steps if engine_side else 3
        return state, steps, [g["lr"] for g in muon.param_groups + adamw.param_groups]


def test_two_optimizers_in_a_plain_loop():
    reference, _, lrs = two_optimizer_loop(False)
    for state, steps, engine_lrs in run_ranks(2, two_optimizer_loop, True):
        assert steps == 3  # not 6: adamw.step() after muon.step() is the same step
        assert engine_lrs == lrs == [0.02 * 0.5 ** 3, 0.02]
        assert max_rel_error(state, reference) <= 1e-5
