"""Config validation: every refusal names the key and the fix; 'auto' and batch sizes resolve."""
from __future__ import annotations

import glob
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

import zeroengine
from zeroengine import ConfigError
from zeroengine.config import parse_config, resolve_auto
from zeroengine.config.reference import reference_markdown
from zeroengine.core.optim.factory import optimizer_from_config
from zeroengine.core.optim.schedulers import scheduler_from_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def refused(cfg, *fragments):
    with pytest.raises(ConfigError) as info:
        resolve_auto(parse_config(cfg), 1, "float32")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def test_misspelt_section_is_refused_with_suggestion():
    refused({"zero_optimisation": {"stage": 2}}, "'zero_optimisation'",
            "did you mean 'zero_optimization'")


def test_nested_typo_names_full_path():
    refused({"zero_optimization": {"reduce_bucket_sise": 10}},
            "zero_optimization.reduce_bucket_sise", "did you mean 'reduce_bucket_size'")


def test_unknown_key_without_near_match_lists_valid_keys():
    refused({"fp16": {"colour": 1}}, "fp16.colour", "valid keys here:", "loss_scale")


def test_wrong_type_names_path_and_range():
    refused({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage",
            "expected an integer", "0..3", '"two"')


def test_out_of_range_names_allowed_range():
    refused({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "out of range",
            "0..3")
    refused({"gradient_clipping": -1}, "gradient_clipping", ">= 0.0")


def test_bool_is_not_an_int_and_int_is_not_a_bool():
    refused({"zero_optimization": {"overlap_comm": 1}}, "zero_optimization.overlap_comm",
            "a boolean")
    refused({"steps_per_print": True}, "steps_per_print", "an integer")


def test_choices_are_listed():
    refused({"zero_optimization": {"offload_optimizer": {"device": "disk"}}},
            "offload_optimizer.device", "'none', 'cpu', 'nvme'")


def test_integral_floats_accepted_for_sizes():
    cfg = parse_config({"zero_optimization": {"reduce_bucket_size": 5e8}})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    refused({"zero_optimization": {"reduce_bucket_size": 2.5}}, "reduce_bucket_size")


def test_unsupported_deepspeed_keys_say_so():
    refused({"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
            "'zero_optimization.zero_quantized_nontrainable_weights': quantized non-trainable",
            "does not implement", "remove it")


def test_no_effect_keys_are_accepted():
    cfg = parse_config({"wall_clock_breakdown": False,
                        "zero_optimization": {"contiguous_gradients": True,
                                              "round_robin_gradients": False}})
    assert cfg.zero_optimization.contiguous_gradients is True


def test_comment_keys_are_skipped():
    assert parse_config({"_comment": "x", "zero_optimization": {"_comment_a": 1, "stage": 1}}) \
        .zero_optimization.stage == 1


def test_fp16_and_bf16_together_refused():
    refused({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled",
            "bf16.enabled", "at most one")


def test_auto_resolved_from_what_the_engine_knows():
    cfg = resolve_auto(parse_config({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"}, "zero_optimization": {"reduce_bucket_size": "auto"}}),
        world_size=2, param_dtype_name="bfloat16")
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)
    assert cfg.bf16.enabled is True and cfg.fp16.enabled is False
    assert cfg.zero_optimization.reduce_bucket_size == 5_000_000


def test_auto_refused_by_name_where_unknowable():
    refused({"steps_per_print": "auto"}, "steps_per_print", "'auto' is not accepted")


def test_inconsistent_batch_sizes():
    with pytest.raises(ConfigError, match="inconsistent batch sizes.*must equal"):
        resolve_auto(parse_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
                                   "gradient_accumulation_steps": 2}), 2)
    with pytest.raises(ConfigError, match="not a multiple of train_micro_batch_size_per_gpu"):
        resolve_auto(parse_config({"train_batch_size": 10,
                                   "train_micro_batch_size_per_gpu": 3}), 2)


@settings(max_examples=examples(200), deadline=None)
@given(mbs=st.integers(1, 16), gas=st.integers(1, 8), world=st.integers(1, 8),
       given_keys=st.sampled_from([("tbs", "mbs"), ("tbs", "gas"), ("mbs", "gas"),
                                   ("tbs", "mbs", "gas")]))
def test_any_two_batch_keys_determine_the_third(mbs, gas, world, given_keys):
    values = {"tbs": mbs * gas * world, "mbs": mbs, "gas": gas}
    names = {"tbs": "train_batch_size", "mbs": "train_micro_batch_size_per_gpu",
             "gas": "gradient_accumulation_steps"}
    cfg = resolve_auto(parse_config({names[k]: values[k] for k in given_keys}), world)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
           cfg.gradient_accumulation_steps)
    assert got == (values["tbs"], mbs, gas)


def test_not_json_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(ConfigError, match=r"not valid JSON.*line 2, column"):
        parse_config(str(path))
    with pytest.raises(ConfigError, match="config file not found"):
        parse_config(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))))
def test_shipped_configs_parse(path):
    cfg = resolve_auto(parse_config(path), 2)
    assert cfg.optimizer is not None


def test_generated_reference_is_up_to_date():
    from zeroengine.tools.job_config import reference_markdown as job_reference
    for name, text in (("config.md", reference_markdown()), ("job.md", job_reference())):
        with open(os.path.join(ROOT, "docs", name)) as f:
            assert f.read() == text, f"run `make docs` and commit docs/{name}"


# -- optimizers and schedulers named in the config --------------------------------------------
def _opt(section, params=None):
    cfg = parse_config({"optimizer": section}).optimizer
    return optimizer_from_config(cfg, params or [torch.nn.Parameter(torch.zeros(3))])


def test_deepspeed_adam_means_decoupled_decay_unless_told():
    assert type(_opt({"type": "Adam", "params": {"lr": 1e-3}})) is torch.optim.AdamW
    assert type(_opt({"type": "Adam", "params": {"adam_w_mode": False}})) is torch.optim.Adam
    assert type(_opt({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}})) is torch.optim.SGD
    assert type(_opt({"type": "RMSprop", "params": {"lr": 0.1}})) is torch.optim.RMSprop


def test_deepspeed_adam_defaults_and_switches():
    """DeepSpeed's Adam/AdamW default weight_decay is its FusedAdam's, 0.0; with torch_adam
    DeepSpeed builds torch's class with the section's params, so torch's default holds (AdamW:
    0.01; tests/test_ds_scripts.py runs DeepSpeed beside us). bias_correction (true) is
    accepted."""
    for kind in ("Adam", "AdamW"):
        opt = _opt({"type": kind, "params": {"lr": 1e-3, "bias_correction": True}})
        assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.0
        opt = _opt({"type": kind, "params": {"lr": 1e-3, "torch_adam": True}})
        assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.01
    opt = _opt({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}})
    assert type(opt) is torch.optim.Adam and opt.defaults["weight_decay"] == 0.0
    assert _opt({"type": "AdamW", "params": {"weight_decay": 0.1}}).defaults["weight_decay"] \
        == 0.1
    assert _opt({"type": "SGD", "params": {"lr": 0.1}}).defaults["weight_decay"] == 0



@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_deepspeed_adam_without_bias_correction(adam_w_mode):
    """bias_correction: false (BERT's configs) is DeepSpeed's FusedAdam without the moments'
    bias correction: checked against the update written out by hand."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.98), 1e-6, 0.1
    opt = _opt({"type": "Adam", "params": {"lr": lr, "betas": [b1, b2], "eps": eps,
                                           "weight_decay": wd, "bias_correction": False,
                                           "adam_w_mode": adam_w_mode}}, [p])
    ref, m, v = p.detach().clone().double(), torch.zeros(5).double(), torch.zeros(5).double()
    for _ in range(3):
        g = torch.randn(5)
        p.grad = g.clone()
        opt.step()
        g = g.double()
        if adam_w_mode:
            ref *= 1 - lr * wd
        else:
            g = g + wd * ref
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        ref -= lr * m / (v.sqrt() + eps)
    assert torch.allclose(p.detach().double(), ref, rtol=1e-6, atol=1e-7)
    corrected = _opt({"type": "Adam", "params": {"lr": lr, "betas": [b1, b2], "eps": eps}},
                     [torch.nn.Parameter(torch.zeros(5))])
    assert type(corrected) is torch.optim.AdamW  # the default keeps torch's class


def test_optimizer_auto_params_take_the_trainers_defaults(notices):
    opt = _opt({"type": "AdamW", "params": {"lr": 2e-4, "betas": "auto", "eps": "auto",
                                            "weight_decay": "auto"}})
    assert (opt.defaults["betas"], opt.defaults["eps"], opt.defaults["weight_decay"]) == \
        ((0.9, 0.999), 1e-8, 0.0)
    assert sum("'auto' resolved" in n for n in notices()) == 3
    with pytest.raises(ConfigError, match="optimizer.params.lr is 'auto'.*give a number"):
        _opt({"type": "AdamW", "params": {"lr": "auto"}})


@pytest.mark.parametrize("section,fragment", [
    ({"type": "Adamm"}, "not a torch.optim optimizer; use one of"),
    ({"type": "OneBitLamb"}, "1-bit LAMB compresses communication"),
    ({"type": "LBFGS"}, "cannot be sharded"),
    ({"type": "AdamW", "params": {"betass": [0.9, 0.99]}}, "optimizer.params.betass is not an "
                                                           "argument of AdamW"),
])
def test_bad_optimizer_sections(section, fragment):
    with pytest.raises((ConfigError, TypeError), match=fragment):
        _opt(section)


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
                  "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_num_steps": 3}),  # max: the optimizer's lr
    ("WarmupDecayLR", {"total_num_steps": 6, "warmup_max_lr": 0.1, "warmup_num_steps": 2,
                       "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 9, "warmup_min_lr": 0.001, "warmup_max_lr": 0.1,
                       "warmup_num_steps": 3}),
    ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 3}),
    ("WarmupCosineLR", {"total_num_steps": 6, "warmup_min_ratio": 0.1, "warmup_num_steps": 2,
                        "cos_min_ratio": 0.01, "warmup_type": "linear"}),
]


@pytest.mark.parametrize("kind,params", SCHEDULES)
def test_warmup_schedulers_equal_deepspeeds_own(monkeypatch, kind, params):
    """The lr of every step is what DeepSpeed's own scheduler class gives (DeepSpeed is a test
    dependency): its iteration starts at -1, so the start lr holds for two steps."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import lr_schedules

    def lrs(make, steps=10):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=0.5)
        sched = make(opt)
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    ours = lrs(lambda opt: scheduler_from_config(parse_config(
        {"scheduler": {"type": kind, "params": params}}).scheduler, opt))
    theirs = lrs(lambda opt: getattr(lr_schedules, kind)(opt, **params))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15), (ours, theirs)


def test_torch_scheduler_by_name_and_refusals():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = scheduler_from_config(parse_config({"scheduler": {
        "type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}}).scheduler, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for section, fragment in [({"type": "OneCycle"}, "not supported"),
                              ({"type": "Nope"}, "neither one of"),
                              ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
                               "cannot be resolved")]:
        with pytest.raises(ConfigError, match=fragment):
            scheduler_from_config(parse_config({"scheduler": section}).scheduler, opt)


# -- initialize() refusals ----------------------------------------------------------------------
def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_initialize_refusals():
    m = _model()
    adam = {"optimizer": {"type": "AdamW"}}
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        zeroengine.initialize("not a model", adam)
    with pytest.raises(ConfigError, match="no optimizer"):
        zeroengine.initialize(m, {})
    with pytest.raises(ConfigError, match="keep one of them"):
        zeroengine.initialize(m, adam, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="LBFGS cannot be sharded"):
        zeroengine.initialize(m, {}, optimizer=torch.optim.LBFGS(m.parameters()))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        zeroengine.initialize(m, {}, optimizer=torch.optim.SGD(_model().parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="offload_optimizer needs stage 1, 2 or 3"):
        zeroengine.initialize(m, {**adam, "zero_optimization": {
            "stage": 0, "offload_optimizer": {"device": "cpu"}}})
    frozen = _model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zeroengine.initialize(frozen, adam)


# Every rule across keys (zeroengine/config/rules.py), with the key it must name: refused when
# the config is read, before any model or rank is touched (and so by `zeroengine check-config`).
CROSS_KEY_RULES = [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable at most one"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer needs stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "offload_optimizer.nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "offload_param.nvme_path"),
    ({"aio": {"block_size": 1000}}, "aio.block_size"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
     "zero_quantized_weights .* the stage is 2"),
    ({"zero_optimization": {"stage": 0, "zero_quantized_gradients": True}},
     "zero_quantized_gradients .* stage 0"),
    ({"bf16": {"enabled": False, "bf16_optimizer_states": True}}, "needs bf16.enabled"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "needs fp16.enabled"),
    ({"bf16": {"enabled": True, "store_param_remainders": True,
               "bf16_master_weights_and_grads": True}}, "contradict"),
    ({"bf16": {"enabled": True, "stochastic_rounding": True}}, "keeps neither in bf16"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {
        "stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
     "bf16_optimizer_states' with zero_optimization.offload_optimizer.device 'nvme'"),
]


@pytest.mark.parametrize("config,names", CROSS_KEY_RULES,
                         ids=[str(i) for i in range(len(CROSS_KEY_RULES))])
def test_every_cross_key_rule_is_refused_when_the_config_is_read(config, names):
    with pytest.raises(ConfigError, match=names):
        parse_config(config)


# -- DeepSpeed's spellings and the policy for keys zeroengine does not implement ----------------
@pytest.fixture
def notices():
    """Every ConfigNotice raised in the test (each key is otherwise reported once per process)."""
    from zeroengine.config import policy as config_policy
    config_policy.forget_notices()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: [str(w.message) for w in caught
                       if issubclass(w.category, config_policy.ConfigNotice)]


def test_deepspeed_field_names_are_aliases(notices):
    cfg = parse_config({"zero_optimization": {
        "stage": 3, "max_live_parameters": 5, "max_reuse_distance": 7, "prefetch_bucket_size": 9,
        "param_persistence_threshold": 3, "gather_16bit_weights_on_model_save": True}})
    zero = cfg.zero_optimization
    assert (zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance,
            zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_gather_16bit_weights_on_model_save) == (5, 7, 9, 3, True)
    assert notices() == []
    cfg = parse_config({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert any("deprecated" in n for n in notices())
    refused({"zero_optimization": {"max_live_parameters": 5, "stage3_max_live_parameters": 6}},
            "given twice")


def test_auto_gradient_clipping_is_the_trainers_default(notices):
    cfg = resolve_auto(parse_config({"gradient_clipping": "auto"}), 2, "float32")
    assert cfg.gradient_clipping == 1.0
    assert any("1.0" in n for n in notices())


@pytest.mark.parametrize("raw", [
    {"prescale_gradients": False}, {"prescale_gradients": True},
    {"gradient_predivide_factor": 1.0}, {"zero_force_ds_cpu_optimizer": False},
    {"comms_logger": {"enabled": True}}, {"flops_profiler": {"enabled": False}},
    {"comet": {"enabled": True, "project": "x"}}, {"dataloader_drop_last": True},
    {"zero_optimization": {"stage3_module_granularity_threshold": 0, "sub_group_size": 0}},
    {"zero_optimization": {"stage3_model_persistence_threshold": 10}},
])
def test_knobs_without_effect_here_are_accepted_and_reported(notices, raw):
    parse_config(raw)
    if "sub_group_size" not in str(raw) or len(raw["zero_optimization"]) > 1:
        assert any("no effect" in n for n in notices()), notices()


@pytest.mark.parametrize("raw", [
    {"comms_config": {"verbose": False}}, {"cuda_visible_devices": "0,1"}, {"monitor_config": {}},
    {"some_project_specific_key": 3}])
def test_unknown_top_level_keys_close_to_nothing_are_reported_and_ignored(notices, raw):
    parse_config(raw)
    assert len(notices()) == 1


@pytest.mark.parametrize("raw,off", [
    ({"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
     {"zero_optimization": {"zero_quantized_nontrainable_weights": False}}),
    ({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}},
     {"zero_optimization": {"zeropp_loco_param": None}}),
    ({"tensor_parallel": {"autotp_size": 2}}, {"tensor_parallel": {"autotp_size": 1}}),
    ({"amp": {"enabled": True}}, {"amp": {"enabled": False}}),
    ({"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}}, {"zero_optimization": {}}),
    ({"sparse_gradients": True}, {"sparse_gradients": False}),
    ({"fp32_allreduce": True}, {"fp32_allreduce": False}),
])
def test_unimplemented_features_are_refused_by_name_unless_off(notices, raw, off):
    message = refused(raw, "'", "remove it from the config")
    assert "zeroengine does not implement" in message or "instead" in message \
        or "not supported" in message, message
    parse_config(off)  # the feature's off value is no reason to refuse the config


def test_deprecated_cpu_offload_reads_as_deepspeed_reads_it(notices):
    raw = {"zero_optimization": {"stage": 2, "cpu_offload": True,
                                 "cpu_offload_use_pin_memory": True}}
    cfg = parse_config(raw)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True
    assert "cpu_offload" in raw["zero_optimization"]  # the caller's dict is left alone
    assert any("deprecated" in n for n in notices())
    cfg = parse_config({"zero_optimization": {"stage": 3, "cpu_offload": False,
                                              "cpu_offload_param": True}})
    assert (cfg.zero_optimization.offload_optimizer.device,
            cfg.zero_optimization.offload_param.device) == ("none", "cpu")


def test_reduce_bucket_size_zero_is_one_parameter_per_bucket():
    assert parse_config({"zero_optimization": {"reduce_bucket_size": 0}}
                        ).zero_optimization.reduce_bucket_size == 0


def test_auto_sections_defer_to_what_initialize_is_given(notices):
    """An HF-style optimizer/scheduler section of "auto" values takes the objects passed to
    initialize(); without them, "auto" lr / warmup_num_steps are refused saying what to pass."""
    m = _model()
    auto = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    engine = zeroengine.initialize(m, auto, optimizer=opt, lr_scheduler=sched)
    assert engine.optimizer.base_class is torch.optim.SGD and engine.lr_scheduler is sched
    engine.close()
    assert sum("resolved from the" in n for n in notices()) == 2
    with pytest.raises(ConfigError, match="lr is 'auto'.*pass an optimizer object"):
        zeroengine.initialize(_model(), auto)
    m = _model()
    with pytest.raises(ConfigError, match="warmup_num_steps: 'auto'.*pass lr_scheduler="):
        zeroengine.initialize(m, auto, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def test_auto_bucket_sizes_follow_the_models_hidden_size(notices):
    """As transformers fills them for DeepSpeed: reduce h*h; at stage 3 prefetch 0.9*h*h and
    persistence 10*h - only for keys the config writes as "auto"; each value said once."""
    from types import SimpleNamespace

    from zeroengine.config import model_hidden_size
    hf_like = SimpleNamespace(config=SimpleNamespace(hidden_size=48))
    assert model_hidden_size(hf_like) == 48
    assert model_hidden_size(SimpleNamespace(config=SimpleNamespace(hidden_sizes=[8, 96]))) == 96
    assert model_hidden_size(SimpleNamespace(config=SimpleNamespace(
        text_config=SimpleNamespace(hidden_size=32)))) == 32
    assert model_hidden_size(torch.nn.Linear(2, 2)) is None
    raw = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    zero = resolve_auto(parse_config(raw), 2, "float32", 48).zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold) == (48 * 48, int(0.9 * 48 * 48), 480)
    said = notices()
    assert sum("2,304" in n and "hidden_size" in n for n in said) == 1, said
    # without a hidden size: zeroengine's own values, and the prefetch window stays the
    # engine's model-sized "auto"
    zero = resolve_auto(parse_config(raw), 2, "float32", None).zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold) == (5_000_000, "auto", 100_000)
    # not written as "auto": the defaults, whatever the hidden size
    zero = resolve_auto(parse_config({"zero_optimization": {"stage": 3}}), 2, "float32",
                        48).zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size) == (5_000_000, "auto")
    # below stage 3 only the reduce bucket follows h
    raw["zero_optimization"]["stage"] = 2
    zero = resolve_auto(parse_config(raw), 2, "float32", 48).zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_param_persistence_threshold) == (2304, 100_000)


def test_old_deepspeed_spellings_are_read_as_deepspeed_reads_them(notices):
    """From configs in the wild: Open-Assistant's "enabled": "true" (a string, which DeepSpeed's
    config models read as a boolean), Megatron-DeepSpeed's "bfloat16" section and
    communication_data_type "bfp16", trlx's fp16.opt_level (apex's, never read by DeepSpeed's
    fp16) and bf16.loss_scale."""
    cfg = parse_config({"fp16": {"enabled": "true", "opt_level": "O2"}})
    assert cfg.fp16.enabled is True
    assert parse_config({"fp16": {"enabled": "False"}}).fp16.enabled is False
    cfg = parse_config({"bfloat16": {"enabled": True, "loss_scale": 1.0},
                        "communication_data_type": "bfp16"})
    assert cfg.bf16.enabled is True and cfg.communication_data_type == "bf16"
    said = " | ".join(notices())
    for words in ("read as the boolean true", "opt_level", "bfloat16", "'bfp16'",
                  "bf16.loss_scale"):
        assert words in said, (words, said)
    refused({"fp16": {"enabled": "yes please"}}, "fp16.enabled", "a boolean")
    refused({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "given twice")


def test_the_train_jobs_section_is_the_jobs_not_the_engines(notices, tmp_path):
    """`job` is not in the engine's Config: `zeroengine train` splits it off; initialize()
    given the same file says it has no effect there."""
    from zeroengine.tools.job_config import split_job
    source = {"zero_optimization": {"stage": 2}, "job": {"steps": 7, "model": {"dim": 64}}}
    engine_part, job = split_job(source)
    assert "job" not in engine_part and "job" in source  # the caller's dict is left alone
    assert (job.steps, job.model.dim) == (7, 64)
    assert not hasattr(parse_config(engine_part), "job")
    parse_config(source)
    assert any("'job'" in m and "initialize() does not" in m for m in notices())
    with pytest.raises(ConfigError, match="job.stepz"):  # still checked by name, by the job
        split_job({"job": {"stepz": 1}})
