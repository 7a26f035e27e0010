"""torch.compile at every stage: torch.compile(model) before initialize, engine.module.compile()
after it, and the config's compile section; the compiled runs equal plain PyTorch as the eager
ones do, the engine adds no graph break at stages 0-2, and compiled autograd is refused."""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from harness import (
    TOLERANCE,
    AwkwardNet,
    batch,
    loss_fn,
    make_model,
    make_optimizer,
    max_relative_error,
    param_groups,
    precision_config,
    reference_train,
    relative_deviation,
)

import zeroengine
from zeroengine.testing import run_ranks

STEPS = 3


class CheckpointedNet(AwkwardNet):
    """AwkwardNet with its body under activation checkpointing (recomputed in backward)."""

    def forward(self, tokens):
        h = self.embed(tokens) * self.scale
        h = h + self.frozen(h)
        h = torch.utils.checkpoint.checkpoint(self.body, h, use_reentrant=False)
        return self.head(self.norm(h))


def config(stage: int, precision: str = "fp32", offload: bool = False) -> dict:
    cfg = precision_config(precision, stage, clip=0.5) if precision != "fp32" else {
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                              "stage3_param_persistence_threshold": 0}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def compiled_run(cases):
    """Each case: (config, how, backend, checkpointed) trained STEPS optimizer steps; returns
    the consolidated state, the graph breaks dynamo counted, and the state dict's names."""
    from torch._dynamo.utils import counters
    out = []
    for cfg, how, backend, checkpointed in cases:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = CheckpointedNet() if checkpointed else AwkwardNet()
        if how == "pre":
            model = torch.compile(model, backend=backend)
        if how == "config":
            cfg = dict(cfg, compile={"disable": False, "backend": backend})
        engine = zeroengine.initialize(model, cfg,
                                       optimizer=make_optimizer("adamw", param_groups(model)))
        if how == "post":
            engine.module.compile(backend=backend)
        rank = engine.comm.rank
        for step in range(STEPS):
            for micro in range(2):
                tokens, targets = batch(step, micro, rank)
                engine.backward(loss_fn(engine(tokens), targets))
                engine.step()
        breaks = dict(counters["graph_break"])
        out.append((engine.consolidated_state_dict(), breaks, engine.is_compiled))
        engine.close()
    return out


# (stage, how, backend, checkpointed, precision, offload). aot_eager traces forward and
# backward exactly as inductor does (AOTAutograd) without generating kernels; inductor itself
# runs at stages 2 and 3.
CASES = [(0, "pre", "aot_eager", False, "fp32", False),
         (1, "post", "aot_eager", True, "fp32", False),
         (2, "config", "aot_eager", False, "fp32", False),
         (2, "pre", "inductor", False, "fp32", False),
         (2, "post", "aot_eager", False, "fp32", True),
         (3, "pre", "aot_eager", True, "fp32", False),
         (3, "post", "inductor", False, "fp32", False),
         (3, "config", "aot_eager", False, "fp32", True),
         (2, "pre", "aot_eager", False, "bf16", False),
         (3, "post", "aot_eager", True, "fp16", False)]


@pytest.fixture(scope="module")
def trained():
    cases = [(config(stage, precision, offload), how, backend, ckpt)
             for stage, how, backend, ckpt, precision, offload in CASES]
    return run_ranks(2, compiled_run, cases, timeout=900)


def _reference(checkpointed: bool) -> dict:
    # activation checkpointing recomputes the same values: the plain reference serves both
    return reference_train("adamw", 2, STEPS, 2, 0.5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}-{c[2]}"
                         f"{'-ckpt' if c[3] else ''}-{c[4]}{'-offload' if c[5] else ''}")
def test_compiled_equals_plain_pytorch(trained, case):
    index = CASES.index(case)
    stage, how, backend, ckpt, precision, offload = case
    reference = _reference(ckpt)
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    for rank in range(2):
        state, breaks, is_compiled = trained[rank][index]
        assert is_compiled
        assert set(state) == set(reference)  # no "_orig_mod." in the names
        if precision == "fp32":
            err, where = max_relative_error(state, reference)
            assert err <= 1e-5, f"{where}: {err:.2e}"
        else:
            assert relative_deviation(state, reference, initial) < TOLERANCE
        engine_breaks = {r: n for r, n in breaks.items() if "EngineHook" in r}
        if stage < 3:
            assert breaks == {}, breaks  # stages 0-2: the engine adds no graph break
        else:
            # stage 3: only the fetcher's module hooks break the graph (run eagerly)
            assert engine_breaks and set(engine_breaks) == set(breaks), breaks


def compiled_autograd_refused():
    from torch._dynamo import compiled_autograd
    model = make_model()
    engine = zeroengine.initialize(model, config(2),
                                   optimizer=make_optimizer("adamw", param_groups(model)))
    tokens, targets = batch(0, 0, 0)
    loss = loss_fn(engine(tokens), targets)
    with pytest.raises(RuntimeError, match="compiled autograd is on"):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            engine.backward(loss)
    with pytest.raises(ValueError, match="compiled autograd is not supported"):
        engine.compile(compiled_autograd_enabled=True)
    return True


def test_compiled_autograd_is_refused_by_name():
    assert run_ranks(1, compiled_autograd_refused) == [True]


def test_deepspeed_compile_sections():
    from zeroengine import ConfigError
    assert zeroengine.parse_config({"compile": {"disable": False}}).compile.on
    assert not zeroengine.parse_config({"compile": {"disable": True, "enabled": True}}).compile.on
    assert zeroengine.parse_config({"compile": {"enabled": True, "backend": "aot_eager",
                                                "kwargs": {"mode": "default"}}}).compile.on
    with pytest.raises(ConfigError, match="DeepCompile"):
        zeroengine.parse_config({"compile": {"deepcompile": True}})
    assert not zeroengine.parse_config({"compile": {"deepcompile": False}}).compile.on


class AttentionNet(torch.nn.Module):
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj: at stage 3 the
    engine learns that on the first (eager) forward; compiled forwards then find it gathered."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 20)

    def forward(self, x):
        h = self.embed(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.out(h + a)


def attention_run(how: str, root: str):
    torch.manual_seed(0)
    model = AttentionNet()
    if how == "pre":
        model = torch.compile(model, backend="aot_eager")
    engine = zeroengine.initialize(model, {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    if how == "post":
        engine.module.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(engine.comm.rank)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 20, (2, 6), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).reshape(-1, 20), x.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if how == "pre":  # a compiled run's checkpoint, named as the eager model names things
        engine.save_checkpoint(root)
    return losses, engine.consolidated_state_dict()


def eager_load(root: str):
    torch.manual_seed(1)
    engine = zeroengine.initialize(AttentionNet(), {
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    engine.load_checkpoint(root)
    return engine.consolidated_state_dict()


def test_stage3_attention_and_checkpoint_names(tmp_path):
    """Compiled (before and after initialize) equals eager at stage 3 on a model that reads a
    child's weight without calling the child; the compiled run's checkpoint loads into an eager
    engine at another stage and world size, by the same names."""
    root = str(tmp_path / "ckpt")
    eager_losses, eager_state = run_ranks(2, attention_run, "eager", root)[0]
    for how in ("pre", "post"):
        losses, state = run_ranks(2, attention_run, how, root)[0]
        assert losses == pytest.approx(eager_losses, rel=1e-6), how
        assert max_relative_error(state, eager_state)[0] <= 1e-5, how
    loaded = run_ranks(1, eager_load, root)[0]
    assert max_relative_error(loaded, eager_state)[0] <= 1e-5


def bucket_cut_run(split: bool):
    """Stage 2, a 6.3 MB stack of linears in 1.2 MB gradient buckets, compiled with a backend
    that counts the graphs it is handed; returns (graphs, the order in which the first bucket's
    reduction and the input's gradient happened, the trained weights)."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = split
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    engine = zeroengine.initialize(
        model, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 300_000},
                "compile": {"split_at_buckets": True}},  # on CPUs it is off by default
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    engine.module.compile(backend=counting)
    events = []
    start = engine.reducer._start_reduce

    def record_start(bucket):
        events.append("bucket")
        return start(bucket)

    engine.reducer._start_reduce = record_start
    rank = engine.comm.rank
    for step in range(2):
        events.clear()
        gen = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(4, 512, generator=gen, requires_grad=True)
        x.register_hook(lambda g: events.append("input grad"))
        engine.backward(engine(x).square().mean())
        engine.step()
    first = events.index("bucket") < events.index("input grad")
    state = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    engine.close()
    torch._dynamo.config.optimize_ddp = True
    return len(graphs), first, state


def test_compiled_stage2_reduces_buckets_during_backward():
    """One AOTAutograd backward would make every gradient ready at its end; the engine cuts the
    compiled graph at its buckets (as torch does for DDP), so the first bucket's reduction
    starts before backward reaches the model's input. Numbers are those of the uncut graph."""
    cut, whole = run_ranks(2, bucket_cut_run, True), run_ranks(2, bucket_cut_run, False)
    for rank in range(2):
        graphs, first, state = cut[rank]
        # backward order, 1.05 MB per linear: 1 MiB first bucket, then two linears per bucket
        assert graphs == 4, graphs
        assert first, "the first bucket was reduced only after the whole backward"
        graphs, first, uncut = whole[rank]
        assert graphs == 1 and not first
        err, where = max_relative_error(state, uncut)
        assert err <= 1e-6, f"{where}: {err:.2e}"


# -- compile settings checked at initialize ------------------------------------------------------
def tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3))


@pytest.mark.parametrize("backend,close", [("", None), ("nope", None),
                                           ("inductor ", "inductor"), ("aot_eagr", "aot_eager")])
def test_unknown_backend_is_a_config_error_naming_it(backend, close):
    from zeroengine import ConfigError
    with pytest.raises(ConfigError) as info:
        zeroengine.initialize(tiny(), {"compile": {"enabled": True, "backend": backend}})
    message = str(info.value)
    assert f"compile.backend = {backend!r}" in message and "inductor, " in message, message
    assert (f"did you mean {close!r}" in message) == (close is not None), message


@pytest.mark.parametrize("kwargs,named", [
    ({"mod": "default"}, "compile.kwargs.mod"),                    # did you mean 'mode'
    ({"mode": "fastest"}, "compile.kwargs.mode"),
    ({"options": {"max_autotun": True}}, "compile.kwargs.options.max_autotun"),
    ({"options": {"max_autotune": "yes"}}, "compile.kwargs.options"),
    ({"mode": "max-autotune", "options": {"max_autotune": True}}, "compile.kwargs.mode"),
    ({"fullgraph": "false"}, "compile.kwargs.fullgraph"),
    ({"dynamic": "no"}, "compile.kwargs.dynamic"),
    ({"backend": "eager"}, "compile.backend"),
])
def test_unknown_compile_arguments_are_config_errors_naming_the_key(kwargs, named):
    from zeroengine import ConfigError
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        zeroengine.initialize(tiny(), {"compile": {"enabled": True, "kwargs": kwargs}})


def test_registered_and_callable_backends_keep_working():
    """A backend the user registered by name, or passed as a callable, compiles and trains."""
    from torch._dynamo import register_backend
    calls = []

    def counting(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        return gm.forward

    register_backend(counting, name="zeroengine_test_counting")
    engine = zeroengine.initialize(tiny(), {
        "compile": {"enabled": True, "backend": "zeroengine_test_counting"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    assert calls, "the registered backend compiled nothing"
    engine.close()
    torch._dynamo.reset()  # else the graph compiled above is reused for the same code
    calls.clear()
    engine = zeroengine.initialize(tiny(), {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.compile(backend=counting)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    assert calls, "the callable backend compiled nothing"
    with pytest.raises(ValueError, match=r"backend = 'nope'"):
        engine.compile(backend="nope")
    engine.close()
