"""The Hugging Face Trainer on zeroengine (zeroengine.integrations.hf.ZeroTrainer), checked
against the Trainer's own data-parallel run (DDP over gloo, 2 processes) on the same data:
stages 0-3 end with its parameters (SGD and AdamW, accumulation, clipping, warm-up schedule),
its gradient norms, losses and evaluation; bf16 / fp16 track it; checkpoints every N steps resume
to the uninterrupted run's numbers, at another world size too; save_model() writes what
from_pretrained loads (stage 3 included). Needs the `hf` extra (CI installs it)."""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the optional `hf` extra is not "
                                   "installed (pip install 'zeroengine[hf]')")

from harness import TOLERANCE, max_relative_error  # noqa: E402 - after the importorskip

from zeroengine import ConfigError  # noqa: E402
from zeroengine.testing import run_ranks  # noqa: E402

VOCAB, STEPS = 64, 5
# HF's own ds_config_zero2/3 style: everything the Trainer knows is "auto"
HF_AUTO = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"},
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}


def make_lm():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def dataset(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, VOCAB, (n, 12), generator=g)]


def training_args(out: str, **overrides):
    kw = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_steps=STEPS, learning_rate=1e-2, warmup_steps=2, lr_scheduler_type="linear",
              max_grad_norm=0.5, use_cpu=True, report_to=[], save_strategy="no",
              logging_strategy="steps", logging_steps=1, seed=0, disable_tqdm=True)
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def run(out: str, stage: int | None, optim: str = "adamw_torch", precision: str = "fp32",
        **overrides) -> dict:
    """One training run on every rank: the plain Trainer (stage None: its DDP) or ZeroTrainer."""
    from zeroengine.integrations.hf import ZeroTrainer
    model = make_lm()
    args = training_args(out, optim=optim, bf16=precision == "bf16", fp16=precision == "fp16",
                         **overrides)
    common = dict(model=model, args=args, train_dataset=dataset(40, 7),
                  eval_dataset=dataset(8, 8))
    if stage is None:
        trainer = transformers.Trainer(**common)
    else:
        zero = {**HF_AUTO, "zero_optimization": {**HF_AUTO["zero_optimization"],
                                                 "stage": stage}}
        trainer = ZeroTrainer(**common, zero_config=zero)
    trainer.train()
    state = trainer.engine.consolidated_state_dict() if stage is not None else \
        {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    dtype = str(next(model.parameters()).dtype)
    result = dict(state=state, eval_loss=trainer.evaluate()["eval_loss"], dtype=dtype,
                  grad_norms=[e["grad_norm"] for e in logs], losses=[e["loss"] for e in logs],
                  lrs=[e["learning_rate"] for e in logs], steps=trainer.state.global_step,
                  engine_steps=trainer.engine.global_steps if stage is not None else None)
    if stage is not None:
        trainer.engine.close()
    return result


NUMBER_CASES = [(None, "adamw_torch", "fp32")] + [(s, "adamw_torch", "fp32") for s in range(4)] \
    + [(None, "sgd", "fp32")] + [(s, "sgd", "fp32") for s in range(4)] \
    + [(2, "adamw_torch", "bf16"), (3, "adamw_torch", "fp16")]


HF_TEST_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs",
                              "hf_transformers__ds_config_zero3.json")


def run_hf_test_config(out: str) -> dict:
    """transformers' own ZeRO-3 test config, verbatim (fp16, optimizer and parameters offloaded,
    its AdamW and WarmupLR sections), with the TrainingArguments it agrees with."""
    from zeroengine.integrations.hf import ZeroTrainer
    model = make_lm()
    args = training_args(out, fp16=True, learning_rate=3e-5, adam_beta1=0.8,
                         weight_decay=3e-7, warmup_steps=500)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=dataset(40, 7),
                          zero_config=HF_TEST_CONFIG)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    engine = trainer.engine
    result = dict(lrs=[e["learning_rate"] for e in logs], losses=[e["loss"] for e in logs],
                  dtype=str(next(model.parameters()).dtype), stage=engine.stage,
                  offload=(engine.offload_optimizer, engine.offload_param),
                  inner=type(engine.optimizer.inner).__name__, steps=trainer.state.global_step)
    engine.close()
    return result


def run_cases(out: str, cases: list) -> list:
    return [run(out, *case) for case in cases] + [run_hf_test_config(out)]


@pytest.fixture(scope="module")
def numbers(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_numbers"))
    results = run_ranks(2, run_cases, out, NUMBER_CASES, timeout=600)
    by_case = {case: [r[i] for r in results] for i, case in enumerate(NUMBER_CASES)}
    by_case["hf_test_config"] = [r[len(NUMBER_CASES)] for r in results]
    return by_case


@pytest.mark.parametrize("optim,tol", [("adamw_torch", 2e-4), ("sgd", 1e-5)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_trainer_ends_with_the_trainers_own_ddp_parameters(numbers, stage, optim, tol):
    ddp = numbers[(None, optim, "fp32")][0]
    for rank_result in numbers[(stage, optim, "fp32")]:
        err, where = max_relative_error(rank_result["state"], ddp["state"])
        assert err <= tol, (err, where)
        # what the Trainer logs: the same losses, pre-clip gradient norms and schedule
        assert rank_result["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-4)
        assert rank_result["losses"] == pytest.approx(ddp["losses"], rel=1e-4)
        assert rank_result["lrs"] == pytest.approx(ddp["lrs"], rel=1e-6)
        assert rank_result["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=1e-4)
        assert rank_result["steps"] == rank_result["engine_steps"] == STEPS  # one tick each
    assert max(ddp["grad_norms"]) > 0.5  # max_grad_norm 0.5: clipping was engaged
    assert len(set(ddp["lrs"])) > 2  # warm-up then decay: the schedule was exercised


@pytest.mark.parametrize("precision,dtype,stage", [("bf16", "torch.bfloat16", 2),
                                                   ("fp16", "torch.float16", 3)])
def test_zero_trainer_mixed_precision_tracks_fp32(numbers, precision, dtype, stage):
    """TrainingArguments(bf16=True / fp16=True) with the config's "auto": the engine trains in
    that dtype with fp32 masters and tracks the fp32 run (test_precision's tolerance)."""
    ddp = numbers[(None, "adamw_torch", "fp32")][0]
    initial = {k: v.float() for k, v in make_lm().state_dict().items()}
    for rank_result in numbers[(stage, "adamw_torch", precision)]:
        assert rank_result["dtype"] == dtype
        num = sum((rank_result["state"][k] - v).double().pow(2).sum()
                  for k, v in ddp["state"].items())
        den = sum((v - initial[k]).double().pow(2).sum() for k, v in ddp["state"].items())
        assert (num / den).sqrt().item() < TOLERANCE
        assert rank_result["steps"] == STEPS


# -- checkpoints, resume (another world size too) and save_model -------------------------------
def checkpointing_run(out: str) -> dict:
    """Stage 3: checkpoints every 2 steps to step 4 and the final model; then a fresh trainer
    resumes from checkpoint-2 to step 4."""
    from zeroengine.integrations.hf import ZeroTrainer

    def trainer(resume_dir: str):
        zero = {**HF_AUTO, "zero_optimization": {**HF_AUTO["zero_optimization"], "stage": 3}}
        return ZeroTrainer(model=make_lm(), args=training_args(
            resume_dir, max_steps=4, save_strategy="steps", save_steps=2),
            train_dataset=dataset(40, 7), zero_config=zero)

    first = trainer(out)
    first.train()
    first.save_model(os.path.join(out, "final"))
    uninterrupted = first.engine.consolidated_state_dict()
    first.engine.close()
    second = trainer(out)
    second.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed = second.engine.consolidated_state_dict()
    second.engine.close()
    return dict(uninterrupted=uninterrupted, resumed=resumed, steps=second.state.global_step)


def resume_at_world_1(out: str, checkpoint: str) -> dict:
    """One process resumes the 2-process run's checkpoint: what the engine holds when training
    starts is the checkpoint, resharded."""
    from zeroengine.integrations.hf import ZeroTrainer
    seen = {}

    class Capture(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["state"] = trainer.engine.consolidated_state_dict()
            seen["step"] = state.global_step

    zero = {**HF_AUTO, "zero_optimization": {**HF_AUTO["zero_optimization"], "stage": 2}}
    trainer = ZeroTrainer(model=make_lm(), args=training_args(out, max_steps=3),
                          train_dataset=dataset(40, 7), zero_config=zero, callbacks=[Capture()])
    trainer.train(resume_from_checkpoint=checkpoint)
    seen["steps"] = trainer.state.global_step
    trainer.engine.close()
    return seen


def test_checkpoints_resume_and_save_model(tmp_path):
    out = str(tmp_path / "run")
    results = run_ranks(2, checkpointing_run, out, timeout=600)
    for r in results:
        assert r["steps"] == 4
        err, where = max_relative_error(r["resumed"], r["uninterrupted"])
        assert err <= 1e-6, (err, where)
    # the HF-format model: whole (gathered from stage 3), loadable as it is
    loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    err, where = max_relative_error({k: v.float() for k, v in loaded.state_dict().items()},
                                    results[0]["uninterrupted"])
    assert err == 0.0, (err, where)
    # checkpoint-2 at world size 1: the engine starts from exactly what was saved there
    checkpoint = os.path.join(out, "checkpoint-2")
    saved = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    seen = run_ranks(1, resume_at_world_1, str(tmp_path / "w1"), checkpoint, timeout=300)[0]
    assert seen["step"] == 2 and seen["steps"] == 3
    err, where = max_relative_error(seen["state"], {k: v.float() for k, v in saved.items()})
    assert err == 0.0, (err, where)


# -- the config against TrainingArguments ---------------------------------------------------
def test_auto_values_resolve_from_training_args(tmp_path):
    from zeroengine.integrations.hf import resolve_training_args
    args = training_args(str(tmp_path), weight_decay=0.1, adam_beta2=0.95, warmup_steps=3)
    raw = {**HF_AUTO,
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                     "eps": "auto", "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupDecayLR", "params": {
               "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
               "total_num_steps": "auto"}}}
    cfg = resolve_training_args(raw, args, num_training_steps=40)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["train_batch_size"], cfg["gradient_clipping"]) == (2, 2, 4, 0.5)
    assert cfg["optimizer"]["params"] == {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                          "weight_decay": 0.1}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                          "warmup_num_steps": 3, "total_num_steps": 40}
    assert cfg["fp16"]["enabled"] is False and cfg["bf16"]["enabled"] is False
    assert raw["optimizer"]["params"]["lr"] == "auto"  # the caller's dict is left alone
    # a key the config leaves out follows TrainingArguments
    assert resolve_training_args({}, args, 40)["gradient_clipping"] == 0.5


def test_config_that_disagrees_with_training_args_stops_before_training(tmp_path):
    from zeroengine.integrations.hf import resolve_training_args
    args = training_args(str(tmp_path), bf16=True)
    with pytest.raises(ConfigError) as info:
        resolve_training_args({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                               "bf16": {"enabled": False}}, args, 10)
    message = str(info.value)
    for both in ("train_micro_batch_size_per_gpu=4 vs TrainingArguments "
                 "per_device_train_batch_size=2", "gradient_clipping=1.0 vs TrainingArguments "
                 "max_grad_norm=0.5", "bf16.enabled=false vs TrainingArguments bf16=true"):
        assert both in message, message


def test_unsupported_transformers_version_is_named(monkeypatch, tmp_path):
    from zeroengine.integrations import hf
    monkeypatch.setattr(hf.transformers, "__version__", "4.46.3")
    with pytest.raises(ImportError, match=r"supports transformers >= 5.0, < 6; found .*4.46.3"):
        hf.ZeroTrainer(model=make_lm(), args=training_args(str(tmp_path)), zero_config={})


def test_transformers_own_zero3_test_config_runs_as_written(numbers):
    """Its WarmupLR section (log warm-up over 500 steps to 3e-5) drives the lr, not the
    Trainer's linear schedule; fp16, stage 3 and both offloads are on."""
    import math
    for r in numbers["hf_test_config"]:
        assert (r["stage"], r["offload"], r["dtype"], r["steps"]) == \
            (3, (True, True), "torch.float16", STEPS)
        # DeepSpeed's log warm-up: its iteration starts at -1 (lr 0, the min), and the lr at
        # iteration t >= 0 is 3e-5 * log(t + 1) / log(500)
        expected = [0.0] + [3e-5 * math.log(t + 1) / math.log(500) for t in range(STEPS - 1)]
        assert r["lrs"] == pytest.approx(expected, rel=1e-6), r["lrs"]
        assert all(math.isfinite(x) for x in r["losses"])
