"""Optimizer masters and states in 2 bytes (bf16/fp16 sections' master/state keys): the fp32
master kept as bf16 weight + remainder (bitwise today's fp32-master run), bf16/fp16 masters
and bf16 Adam states (against a plain PyTorch AdamW whose master and moments are bf16 and
whose update is computed in fp32 and rounded), stochastic rounding, and what each costs."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from harness import train_engine

import zeroengine
from zeroengine import ConfigError
from zeroengine.config import parse_config, resolve_auto
from zeroengine.core.layout.master_bits import join_master, split_master
from zeroengine.core.optim.precision import OptimizerPrecision
from zeroengine.testing import run_ranks

STEPS = 6


def bf16_config(stage: int, offload: bool = False, **bf16) -> dict:
    cfg = {"gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "bf16": {"enabled": True, **bf16},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                 "stage3_param_persistence_threshold": 0}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def master_state_bytes(engine) -> int:
    report = engine.memory_report()
    return report["optimizer_states"] + report["host_optimizer_states"]


def weights(engine) -> dict[str, torch.Tensor]:
    """The bf16 weights the model computes with (gathered at stage 3)."""
    params = list(engine.module.parameters())
    with zeroengine.gathered_parameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


# -- remainders ------------------------------------------------------------------------------
@pytest.mark.parametrize("extension", [True, False], ids=["c++", "pytorch"])
def test_remainders_rebuild_every_fp32_value_except_even_ties(monkeypatch, extension):
    from zeroengine.core.layout import master_bits
    if not extension:  # the PyTorch path (a GPU's)
        monkeypatch.setattr(master_bits, "_ext", None)
    else:
        assert master_bits._on_cpu(torch.zeros(1))
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31, (200_000,), dtype=torch.int64, generator=g)
    values = bits.to(torch.int32).view(torch.float32)
    values = values[torch.isfinite(values)].clone()
    halves = values.view(torch.int16).view(-1, 2)
    halves[:2000, 0] = -0x8000  # exactly halfway between two bf16 values: both parities
    weight = torch.empty(len(values), dtype=torch.bfloat16)
    remainder = torch.empty(len(values), dtype=torch.int16)
    split_master(values, weight, remainder)
    # the weight is what .to(bfloat16) gives: round to nearest, ties to even
    assert torch.equal(weight.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
    rebuilt = torch.empty_like(values)
    join_master(weight, remainder, rebuilt)
    differs = rebuilt.view(torch.int32) != values.view(torch.int32)
    even_ties = (halves[:, 0] == -0x8000) & ((halves[:, 1] & 1) == 0)
    assert even_ties.sum() > 500
    assert torch.equal(differs, even_ties)
    # those move one fp32 ulp toward their weight, which they still round to
    step = rebuilt.view(torch.int32)[differs].long() - values.view(torch.int32)[differs].long()
    assert set(step.tolist()) == {-1}
    assert torch.equal(rebuilt.to(torch.bfloat16), weight)


def _fp32_vs_remainders(stage: int, offload: bool, optimizer: str, window: int | None = None):
    from zeroengine.core.optim import sharded_optimizer
    if window is not None:  # sub-groups of a few segments: masters rebuilt a window at a time
        sharded_optimizer.REMAINDER_WINDOW = window
    out = []
    for remainders in (False, True):
        engine, losses = train_engine(bf16_config(stage, offload,
                                                  store_param_remainders=remainders),
                                      optimizer, STEPS, 2)
        if remainders and window is not None:
            assert len(engine.optimizer.sub_groups) > 3, engine.optimizer.sub_groups
        out.append((engine.consolidated_state_dict(), weights(engine), losses,
                    master_state_bytes(engine)))
        engine.close()
    return out


@pytest.mark.parametrize("stage,offload,optimizer,window", [
    (1, False, "adamw", None), (2, False, "adamw", 40), (3, False, "adamw", None),
    (2, True, "adamw", None), (3, True, "adamw", 40), (2, False, "sgd", None),
    (3, False, "muon", None)])
def test_remainders_are_bitwise_the_fp32_master_run(stage, offload, optimizer, window):
    """Any optimizer (SGD; Muon, tensor-wise, on whole gathered matrices) steps the exact fp32
    master rebuilt from the weight and its remainder, whole or a window at a time."""
    for rank, ((master, weight, losses, nbytes), (r_master, r_weight, r_losses, r_nbytes)) in \
            enumerate(run_ranks(2, _fp32_vs_remainders, stage, offload, optimizer, window)):
        assert r_losses == losses, rank
        for name in master:
            assert torch.equal(r_master[name], master[name]), (rank, name)
        for name in weight:
            assert r_weight[name].dtype == torch.bfloat16
            assert torch.equal(r_weight[name], weight[name]), (rank, name)
        if not offload and optimizer == "adamw":  # 2 bytes of remainder + 8 of Adam, not 4 + 8
            assert r_nbytes <= 0.85 * nbytes, (r_nbytes, nbytes)
        else:  # host: bf16 weights + remainders in place of the fp32 master
            assert r_nbytes <= nbytes


# -- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bf16,why", [
    ({"store_param_remainders": True, "bf16_master_weights_and_grads": True}, "contradict"),
    ({"stochastic_rounding": True}, "rounds bf16 master"),
])
def test_contradictory_master_keys_are_refused(bf16, why):
    with pytest.raises(ConfigError, match=why):  # at parsing: `zeroengine check-config` says it
        parse_config({"bf16": {"enabled": True, **bf16}})


def test_master_keys_need_their_precision():
    with pytest.raises(ConfigError, match="needs bf16.enabled"):
        parse_config({"bf16": {"store_param_remainders": True}})
    with pytest.raises(ConfigError, match="needs fp16.enabled"):
        parse_config({"fp16": {"fp16_master_weights_and_grads": True}})
    # with bf16.enabled "auto" the rule waits for the model's dtype (resolve_auto)
    cfg = parse_config({"bf16": {"enabled": "auto", "bf16_optimizer_states": True}})
    assert OptimizerPrecision.from_config(resolve_auto(copy.deepcopy(cfg), 1, "bfloat16")) \
        .states == torch.bfloat16
    with pytest.raises(ConfigError, match="needs bf16.enabled"):
        resolve_auto(cfg, 1, "float32")


def test_checkpoint_words_for_exact_masters_are_the_engines():
    from zeroengine.checkpoint.sharded import EXACT_MASTERS
    from zeroengine.core.optim.precision import FP32_MASTER, REMAINDER_MASTER
    assert EXACT_MASTERS == (FP32_MASTER, REMAINDER_MASTER)


def test_nvme_offload_with_bf16_masters_is_refused_by_name():
    with pytest.raises(ConfigError, match="offload_optimizer.device 'nvme' is not supported"):
        parse_config({"bf16": {"enabled": True, "bf16_optimizer_states": True},
                      "zero_optimization": {"stage": 3, "offload_optimizer": {
                          "device": "nvme", "nvme_path": "/tmp"}}})


# -- bf16/fp16 masters and bf16 states against plain PyTorch -----------------------------------
SHAPES = [(7, 5), (13,), (3, 3, 3), (1,), (41,)]
LR = 0.01


class Probe(torch.nn.Module):
    """Parameters of sizes that divide no world size, in [1, 2), with a loss linear in them:
    each step's gradient is that step's input, whatever the weights, so the engine and the
    reference see bitwise the same gradients and differ only in how they step."""

    def __init__(self, init: float = 1.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(init + torch.rand(s, generator=g)) for s in SHAPES)

    def forward(self, inputs):
        return sum((w * x).sum() for w, x in zip(self.weights, inputs))


def probe_inputs(step: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def probe_groups(model):
    ws = list(model.weights)
    return [{"params": ws[:3], "weight_decay": 0.1}, {"params": ws[3:], "weight_decay": 0.0}]


def reference_adamw_16bit(steps: int, states: torch.dtype, dtype=torch.bfloat16):
    """Plain PyTorch: the weights are the master (``dtype``), moments in ``states``; each
    update computed in fp32 as torch.optim.AdamW computes it, then rounded to nearest."""
    model = Probe().to(dtype)
    moments = {id(p): (torch.zeros_like(p, dtype=states), torch.zeros_like(p, dtype=states))
               for p in model.parameters()}
    for step in range(1, steps + 1):
        for group in probe_groups(model):
            for p, x in ((p, x) for p, x in zip(model.weights, probe_inputs(step - 1))
                         if any(p is q for q in group["params"])):
                m, v = moments[id(p)]
                p32, m32, v32, g32 = p.detach().float(), m.float(), v.float(), x.float()
                p32.mul_(1 - LR * group["weight_decay"])
                m32.lerp_(g32, 0.1)
                v32.mul_(0.999).addcmul_(g32, g32, value=0.001)
                denom = (v32.sqrt() / (1 - 0.999 ** step) ** 0.5).add_(1e-8)
                p32.addcdiv_(m32, denom, value=-LR / (1 - 0.9 ** step))
                with torch.no_grad():
                    p.copy_(p32)
                m.copy_(m32)
                v.copy_(v32)
    return [p.detach().clone() for p in model.weights]


def probe_config(stage: int, offload: bool = False, fp16: bool = False, **bf16) -> dict:
    cfg = {"communication_data_type": "fp32",
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 16,
                                 "stage3_param_persistence_threshold": 0}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "fp16_master_weights_and_grads": True,
                       "initial_scale_power": 4}
    else:
        cfg["bf16"] = {"enabled": True, **bf16}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def train_probe(config: dict, steps: int, engine=None, start: int = 0, init: float = 1.0):
    """``steps`` steps of the probe (every rank the same inputs); returns the engine."""
    if engine is None:
        model = Probe(init)
        engine = zeroengine.initialize(
            model, config, optimizer=torch.optim.AdamW(probe_groups(model), lr=LR))
    dtype = engine.precision.compute
    for step in range(start, start + steps):
        engine.backward(engine(probe_inputs(step, dtype)))
        engine.step()
    return engine


def probe_weights(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with zeroengine.gathered_parameters(params):
        return [p.detach().clone() for p in params]


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of the last place of b's precision (at b's magnitude)."""
    a, b = a.float(), b.float()
    ulp = torch.ldexp(torch.ones_like(b), torch.frexp(b)[1] - 8)  # bf16: 8 significant bits
    return ((a - b).abs() / ulp).max().item()


def _probe_runs(cases, steps):
    out = []
    for cfg in cases:
        engine = train_probe(cfg, steps)
        out.append((probe_weights(engine), master_state_bytes(engine)))
        engine.close()
    return out


LOW_CASES = [(stage, offload) for stage in (1, 2, 3) for offload in (False, True)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bf16_master_and_states_step_as_rounded_fp32_adamw(world):
    """bf16_master_weights_and_grads + bf16_optimizer_states, at stages 1-3 with and without
    CPU offload: within 2 bf16 ulps of the plain PyTorch AdamW whose master and moments are
    bf16 (the rest is the kernel's float32 arithmetic, one ulp from torch's, crossing a
    rounding boundary), at most half the fp32-master run's master + state bytes."""
    steps = 6
    cases = [probe_config(s, o, bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
             for s, o in LOW_CASES] + [probe_config(2, False), probe_config(2, True)]
    results = run_ranks(world, _probe_runs, cases, steps)
    reference = reference_adamw_16bit(steps, torch.bfloat16)
    for per_rank in results:
        fp32_bytes = {False: per_rank[-2][1], True: per_rank[-1][1]}
        for (stage, offload), (got, nbytes) in zip(LOW_CASES, per_rank):
            for w, ref in zip(got, reference):
                assert w.dtype == torch.bfloat16
                assert bf16_ulps(w, ref) <= 2, (stage, offload, bf16_ulps(w, ref))
            # 2 (host copy of the weights, offload only) + 4 bytes of moments, against 4 + 8
            assert nbytes <= 0.55 * fp32_bytes[offload], (stage, offload, nbytes)
        assert any(not torch.equal(w, r) for w, r in zip(per_rank[-2][0], reference))


def _fp16_and_states_runs(steps):
    cases = [probe_config(2, False, fp16=True), probe_config(2, True, fp16=True),
             probe_config(3, False, bf16_optimizer_states=True),
             probe_config(1, True, bf16_optimizer_states=True)]
    return _probe_runs(cases, steps)


def test_fp16_master_and_bf16_states_alone_step_as_their_references():
    steps = 5
    results = run_ranks(2, _fp16_and_states_runs, steps)[0]
    fp16_ref = reference_adamw_16bit(steps, torch.float32, torch.float16)
    for got, _ in results[:2]:  # fp16 master, fp32 moments (loss scaling unscaled in the pass)
        for w, ref in zip(got, fp16_ref):
            assert w.dtype == torch.float16
            diff = ((w.float() - ref.float()).abs() / ref.float().abs()).max().item()
            assert diff <= 2 * 2.0 ** -10, diff
    # bf16 moments beside an fp32 master: the weights are the fp32 master rounded
    states_ref = _fp32_master_reference(steps, torch.bfloat16)
    for got, _ in results[2:]:
        for w, ref in zip(got, states_ref):
            assert bf16_ulps(w, ref) <= 2, bf16_ulps(w, ref)


def _fp32_master_reference(steps: int, states: torch.dtype) -> list[torch.Tensor]:
    """fp32 master, moments in ``states``, the weights its bf16 rounding."""
    model = Probe()
    moments = {id(p): (torch.zeros_like(p, dtype=states), torch.zeros_like(p, dtype=states))
               for p in model.parameters()}
    for step in range(1, steps + 1):
        for group in probe_groups(model):
            for p, x in zip(model.weights, probe_inputs(step - 1)):
                if not any(p is q for q in group["params"]):
                    continue
                m, v = moments[id(p)]
                m32, v32, g32 = m.float(), v.float(), x.float()
                with torch.no_grad():
                    p.mul_(1 - LR * group["weight_decay"])
                    m32.lerp_(g32, 0.1)
                    v32.mul_(0.999).addcmul_(g32, g32, value=0.001)
                    denom = (v32.sqrt() / (1 - 0.999 ** step) ** 0.5).add_(1e-8)
                    p.addcdiv_(m32, denom, value=-LR / (1 - 0.9 ** step))
                m.copy_(m32)
                v.copy_(v32)
    return [p.detach().to(torch.bfloat16) for p in model.weights]


def test_other_optimizers_are_refused_by_name_with_bf16_masters():
    model = Probe()
    with pytest.raises(ValueError, match="SGD would compute in bf16"):
        zeroengine.initialize(model, probe_config(1, bf16_master_weights_and_grads=True),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


# -- stochastic rounding -----------------------------------------------------------------------
def _stochastic_adam(use_extension: bool, shards: list[tuple[int, int]] | None, base: int = 1000):
    """Three CPUAdam steps over one 1000-element bf16 master with bf16 moments, stochastic:
    whole (``shards`` None) or as separate tensors, one per (first, count), with their runs."""
    from zeroengine.ops import CPUAdam
    g = torch.Generator().manual_seed(1)
    values = 1 + torch.rand(1000, generator=g)
    grads = [torch.randn(1000, generator=g) for _ in range(3)]
    pieces = shards or [(0, 1000)]
    params = [values[a:a + n].to(torch.bfloat16).clone() for a, n in pieces]
    opt = CPUAdam([{"params": params}], lr=1e-3, weight_decay=0.1,
                  use_extension=use_extension, state_dtype=torch.bfloat16,
                  stochastic_rounding=True, rounding_seed=7)
    for grad in grads:
        opt.step(grads={p: grad[a:a + n].clone() for p, (a, n) in zip(params, pieces)},
                 index_runs={p: torch.tensor([[0, n, base + a]]) for p, (a, n) in
                             zip(params, pieces)})
    out = [torch.cat(t) for t in (params, [opt.state[p]["exp_avg"] for p in params],
                                   [opt.state[p]["exp_avg_sq"] for p in params])]
    return out


def test_stochastic_rounding_of_a_shard_is_the_rounding_of_the_whole_tensor():
    from zeroengine.ops.cpu_adam import using_extension
    assert using_extension()
    whole = _stochastic_adam(True, None)
    split = _stochastic_adam(True, [(0, 333), (333, 1), (334, 666)])
    for a, b in zip(whole, split):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # another model index draws other bits: the rounding is not the same
    moved = _stochastic_adam(True, None, base=5000)
    assert not torch.equal(moved[0], whole[0])


def test_stochastic_rounding_bits_are_the_kernels_in_pytorch():
    """The PyTorch path (other devices) draws the kernel's bits: the same roundings, except
    where the two float32 computations differ by an ulp across a rounding boundary."""
    for base in (1000, 2 ** 32 - 300):  # (the kernel hoists the index's upper half: crossing)
        _same_roundings(_stochastic_adam(True, None, base), _stochastic_adam(False, None, base))


def _same_roundings(kernel, torch_path):
    for a, b in zip(kernel, torch_path):
        same = (a.view(torch.int16) == b.view(torch.int16)).float().mean().item()
        assert same >= 0.995, same
        apart = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()
        assert apart <= 1, apart  # neighbouring bf16 values


class LeastSquares(torch.nn.Module):
    """Issue 42's problem: 64 weights in [1, 2), each to move by 0.05."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        start = 1 + torch.rand(64, generator=g)
        self.w = torch.nn.Parameter(start.clone())
        self.register_buffer("target", start + 0.05)

    def forward(self):
        return (self.w.float() - self.target).square().sum()


def mean_error(bf16: dict, steps: int = 1000) -> float:
    model = LeastSquares()
    engine = zeroengine.initialize(model, {"bf16": {"enabled": True, **bf16},
                                           "zero_optimization": {"stage": 1}},
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    for _ in range(steps):
        engine.backward(engine())
        engine.step()
    state = engine.consolidated_state_dict()
    engine.close()
    return (state["w"] - model.target.float()).abs().mean().item()


def test_stochastic_rounding_keeps_the_updates_nearest_rounding_loses():
    fp32 = mean_error({})
    nearest = mean_error({"bf16_master_weights_and_grads": True,
                          "bf16_optimizer_states": True})
    stochastic = mean_error({"bf16_master_weights_and_grads": True,
                             "bf16_optimizer_states": True, "stochastic_rounding": True})
    assert fp32 < 0.02  # AdamW at lr 1e-4 gets most of the way in 1000 steps
    assert nearest > 0.045  # every update is under half a bf16 step: no weight moves
    assert stochastic < fp32 + 0.01, (stochastic, fp32)


def _stochastic_runs(save_dir: str, world_stage: str):
    cfg = probe_config(3 if world_stage == "stage3" else 1, bf16_master_weights_and_grads=True,
                       bf16_optimizer_states=True, stochastic_rounding=True,
                       stochastic_rounding_seed=11)
    straight = train_probe(cfg, 6)
    out = {"straight": probe_weights(straight)}
    straight.close()
    first = train_probe(cfg, 3)
    first.save_checkpoint(save_dir, tag=world_stage)
    first.close()
    model = Probe(init=5.0)  # other values: the checkpoint must bring everything back
    resumed = zeroengine.initialize(model, cfg,
                                    optimizer=torch.optim.AdamW(probe_groups(model), lr=LR))
    resumed.load_checkpoint(save_dir, tag=world_stage)
    train_probe(cfg, 3, engine=resumed, start=3)
    out["resumed"] = probe_weights(resumed)
    resumed.close()
    return out


def test_stochastic_runs_are_reproducible_resumable_and_world_size_free(tmp_path):
    one = run_ranks(1, _stochastic_runs, str(tmp_path / "w1"), "stage1")[0]
    two = run_ranks(2, _stochastic_runs, str(tmp_path / "w2"), "stage3")
    reference = one["straight"]
    assert any(not torch.equal(w, r) for w, r in
               zip(reference, reference_adamw_16bit(6, torch.bfloat16)))  # not nearest
    for run in [one] + two:
        for key in ("straight", "resumed"):
            for w, r in zip(run[key], reference):
                assert torch.equal(w.view(torch.int16), r.view(torch.int16)), key


# -- checkpoints across master formats ---------------------------------------------------------
def _across_formats(save_dir: str):
    low = probe_config(2, bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    fp32 = probe_config(3)
    remainder = probe_config(1, True, store_param_remainders=True)
    engine = train_probe(low, 3)
    saved = probe_weights(engine)
    engine.save_checkpoint(save_dir, tag="low")
    engine.close()
    out = {"saved": saved}
    for name, cfg in (("fp32", fp32), ("remainder", remainder)):
        model = Probe(init=5.0)
        engine = zeroengine.initialize(model, cfg,
                                       optimizer=torch.optim.AdamW(probe_groups(model), lr=LR))
        engine.load_checkpoint(save_dir, tag="low")
        out[name] = engine.consolidated_state_dict()
        engine.save_checkpoint(save_dir, tag=name)
        engine.close()
    model = Probe(init=5.0)
    engine = zeroengine.initialize(model, low,
                                   optimizer=torch.optim.AdamW(probe_groups(model), lr=LR))
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(save_dir, tag="fp32")
    out["warned"] = [str(w.message) for w in caught if "rounds" in str(w.message)]
    out["back"] = probe_weights(engine)
    engine.close()
    from zeroengine.checkpoint.consolidate import consolidated_state_dict
    out["consolidated"] = consolidated_state_dict(os.path.join(save_dir, "low"))
    return out


def test_checkpoints_move_between_bf16_fp32_and_remainder_masters(tmp_path):
    results = run_ranks(2, _across_formats, str(tmp_path))
    for rank, out in enumerate(results):
        for name in ("fp32", "remainder"):  # upcast: the bf16 values exactly
            for i, w in enumerate(out["saved"]):
                assert torch.equal(out[name][f"weights.{i}"], w.float()), (name, i)
        for w, back in zip(out["saved"], out["back"]):
            assert torch.equal(w, back)  # bf16 -> fp32 -> bf16 is exact
        for i, w in enumerate(out["saved"]):  # from the files alone (zeroengine consolidate)
            assert torch.equal(out["consolidated"][f"weights.{i}"], w.float())
        if rank == 0:
            assert out["warned"] and "fp32 master weights to bfloat16" in out["warned"][0]
            assert "fp32 optimizer states to bfloat16" in out["warned"][0]


def test_offloaded_gradients_stay_bf16_beside_a_bf16_master():
    """bf16_master_weights_and_grads: the optimizer reads the gradient as reduced (bf16), so
    offload keeps no fp32 host copy of it (here the reduced bf16 gradient is already in host
    memory and is read in place; an fp32 master's step needs its fp32 copy)."""
    held = {}
    for name, keys in (("fp32", {}), ("bf16", {"bf16_master_weights_and_grads": True})):
        cfg = probe_config(2, True, **keys)
        del cfg["communication_data_type"]  # reduced in bf16, the default
        engine = train_probe(cfg, 2)
        held[name] = engine.memory_report()["host_grads"]
        engine.close()
    assert held["fp32"] >= 4 * sum(p.numel() for p in Probe().parameters())
    assert held["bf16"] == 0
