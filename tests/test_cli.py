"""The `zeroengine` console script's check-config and estimate, and the estimate's formulas
against the ZeRO paper and against what the engine really holds."""
from __future__ import annotations

import glob
import json
import os

import pytest

from zeroengine.testing import run_ranks
from zeroengine.tools.cli import main
from zeroengine.tools.estimate import gpt_num_params, model_state_bytes, states_per_param

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))),
                         ids=os.path.basename)
def test_check_config_accepts_and_resolves_every_shipped_config(path, capsys):
    assert main(["check-config", path, "--world", "2"]) == 0
    out = capsys.readouterr()
    resolved = json.loads(out.out)
    assert resolved["job"]["model"]["dim"] > 0 and "zero_optimization" in resolved
    if resolved["train_micro_batch_size_per_gpu"]:
        assert resolved["train_batch_size"] == 2 * resolved["train_micro_batch_size_per_gpu"] \
            * resolved["gradient_accumulation_steps"]
    assert "valid" in out.err


@pytest.mark.parametrize("text,message", [
    ('{"zero_optimization": {"stage": 5}}', "zero_optimization.stage: 5 is out of range"),
    ('{"job": {"model": {"dim": 100, "heads": 3}}}', "job.model.heads (3) must divide"),
    ('{"zero_optimizaton": {}}', "did you mean 'zero_optimization'"),
    ('{"stage": 2,}', "not valid JSON"),
])
def test_check_config_names_the_problem(tmp_path, capsys, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_estimate_gives_the_papers_numbers():
    """Mixed-precision Adam, P parameters, N ranks: 16P, 4P + 12P/N, 2P + 14P/N, 16P/N."""
    P, N = 7.5e9, 64
    expected = [16 * P, 4 * P + 12 * P / N, 2 * P + 14 * P / N, 16 * P / N]
    for stage, bytes_ in enumerate(expected):
        e = model_state_bytes(P, stage, N, "bf16", states=2)
        assert e.device_total == pytest.approx(bytes_) and e.host_total == 0
    # the paper's example: 7.5B at stage 3 on 64 GPUs is 1.9 GB per device
    assert model_state_bytes(P, 3, N, "bf16").device_total / 1e9 == pytest.approx(1.875)


def test_estimate_offload_moves_states_to_the_host():
    P, N = 1e9, 8
    plain = model_state_bytes(P, 2, N, "bf16")
    off = model_state_bytes(P, 2, N, "bf16", offload_optimizer=True)
    assert off.optimizer_states == 0 and off.host_optimizer_states == plain.optimizer_states
    assert off.host_grads == 4 * P / N and off.params == plain.params
    both = model_state_bytes(P, 3, N, "bf16", offload_optimizer=True, offload_param=True)
    assert both.params == 0 and both.host_params == 2 * P / N
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        model_state_bytes(P, 2, N, offload_param=True)
    assert states_per_param("SGD", momentum=0) == 0 and states_per_param("AdamW") == 2


def test_estimate_cli(capsys):
    assert main(["estimate", "--params", "7.5e9", "--stage", "3", "--world", "64"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 ")]
    assert row and "1.746" in row[0]  # 16 * 7.5e9 / 64 bytes in GiB
    assert main(["estimate", "--config", os.path.join(ROOT, "configs", "zero3.json"),
                 "--world", "2"]) == 0
    assert "built-in GPT" in capsys.readouterr().out
    # NVMe: the optimizer's 12 bytes and stage 3's 2 parameter bytes per shard element go to
    # the drive; only the bf16 gradient shard stays
    assert main(["estimate", "--params", "7.5e9", "--stage", "3", "--world", "64",
                 "--offload-optimizer", "nvme", "--offload-param", "nvme"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| 64 ")][0]
    assert "NVMe total" in out and row.endswith("| 0.218 | 0.000 | 1.528 |"), row
    assert main(["estimate", "--config", os.path.join(ROOT, "configs", "zero3_nvme.json"),
                 "--world", "2"]) == 0
    assert "offload optimizer nvme, params nvme" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="do not model NVMe"):
        main(["estimate", "--params", "1e9", "--stage", "2", "--offload-optimizer", "nvme",
              "--time"])


def test_gpt_parameter_count_formula():
    from zeroengine.examples.gpt import GPT, GPTConfig, num_params
    cfg = GPTConfig(context=32, layers=3, heads=2, dim=24)
    assert gpt_num_params(cfg.vocab, cfg.context, cfg.layers, cfg.dim) == num_params(GPT(cfg))


def measured_states(cases, path):
    import torch

    import zeroengine
    from zeroengine.examples.gpt import GPT, GPTConfig, num_params
    out = []
    for stage, precision, offload, *keys in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(context=32, layers=2, heads=4, dim=128))
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        if offload == "nvme":  # optimizer and parameters on the drive
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
            zero["offload_param"] = {"device": "nvme", "nvme_path": path}
        elif offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        cfg = {"optimizer": {"type": "AdamW"}, "zero_optimization": zero,
               "bf16": {"enabled": precision == "bf16", **(keys[0] if keys else {})}}
        engine = zeroengine.initialize(model, cfg)
        tokens = torch.randint(0, 256, (2, 33))
        engine.backward(model.loss(tokens[:, :-1], tokens[:, 1:]))
        engine.step()  # optimizer state exists from the first step
        out.append((engine.memory_report(), num_params(model)))
        engine.close()
    return out


def test_estimate_matches_what_the_engine_holds(tmp_path):
    """Per category within 5% (padding, and torch's per-chunk step tensors, are the rest); on
    the drive within 25% (each segment's region starts on a 4096-element boundary)."""
    low = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    cases = [(s, p, False) for s in (0, 1, 2, 3) for p in ("fp32", "bf16")] + \
        [(2, "bf16", True), (3, "bf16", "nvme"), (2, "bf16", False, low),
         (3, "bf16", True, low), (1, "bf16", False, {"store_param_remainders": True}),
         (3, "bf16", True, {"store_param_remainders": True}),
         (2, "bf16", False, {"bf16_optimizer_states": True})]
    results = run_ranks(2, measured_states, cases, str(tmp_path))[0]
    for (stage, precision, offload, *keys), (report, n) in zip(cases, results):
        keys = keys[0] if keys else {}
        master = "remainder" if keys.get("store_param_remainders") else (
            "low" if keys.get("bf16_master_weights_and_grads") else "fp32")
        e = model_state_bytes(n, stage, 2, precision, 2, offload_optimizer=offload,
                              offload_param="nvme" if offload == "nvme" else False,
                              master=master,
                              state_bytes=2 if keys.get("bf16_optimizer_states") else 4)
        pairs = [("params", e.params), ("grads", e.grads),
                 ("optimizer_states", e.optimizer_states),
                 ("host_optimizer_states", e.host_optimizer_states)]
        if offload == "nvme":  # in memory only the tiles and the cache (buffers): not states
            assert e.host_total == 0 and report["host_grads"] == 0
            pairs = pairs[:3]
            for key in ("nvme_params", "nvme_optimizer_states"):
                assert getattr(e, key) > 0
                assert getattr(e, key) <= report[key] <= 1.25 * getattr(e, key), \
                    (key, report[key], getattr(e, key))
        for key, estimate in pairs:
            assert report[key] == pytest.approx(estimate, rel=0.05, abs=1024), \
                (stage, precision, offload, key, report[key], estimate)


# -- the scale model ------------------------------------------------------------------------------
def test_scale_model_memory_is_the_formula_plus_buffers_and_comm_is_the_papers_volume():
    from zeroengine.tools.scale_model import Hardware, Job, predict
    P, N = 7e9, 64
    for stage, volume in [(0, 2), (1, 2), (2, 2), (3, 3)]:
        pred = predict(Job(P, stage, N, reduce_bucket_size=10**8, prefetch_bucket_size=10**8))
        formula = model_state_bytes(P, stage, N, "bf16", 2).device_total
        assert pred.model_states == formula and 0 < pred.buffers < 0.05 * formula + 2 * 10**9
        assert pred.comm_bytes == pytest.approx(volume * 2 * P * (N - 1) / N)
    # one rank: nothing to communicate; offload moves the optimizer to the host
    alone = predict(Job(P, 0, 1))
    assert alone.comm_bytes == 0 and alone.exposed_comm_s == 0
    off = predict(Job(P, 3, N, offload_optimizer=True), Hardware())
    assert off.host > 0 and off.model_states < predict(Job(P, 3, N)).model_states


def test_scale_model_hides_communication_behind_enough_compute():
    from zeroengine.tools.scale_model import Hardware, Job, predict
    hw = Hardware(flops=1e15, bandwidth=1e11, latency=0.0)
    many_tokens = predict(Job(1e9, 3, 8, tokens_per_rank=10**6), hw)
    few_tokens = predict(Job(1e9, 3, 8, tokens_per_rank=10), hw)
    assert many_tokens.exposed_comm_s < 0.05 * many_tokens.comm_s
    assert few_tokens.exposed_comm_s > 0.5 * few_tokens.comm_s
    assert few_tokens.step_s < many_tokens.step_s


def test_recommend_picks_the_least_sharding_that_fits():
    from zeroengine.tools.scale_model import Hardware, recommend
    roomy = Hardware(device_memory=10**15)
    job, pred = recommend(1e9, 8, roomy)
    assert job.stage == 0 and pred.fits(roomy)
    tight = Hardware(device_memory=40 * 2**30)
    job, pred = recommend(70e9, 64, tight)
    assert job.stage == 3 and pred.fits(tight)
    job, _ = recommend(70e9, 8, tight)  # 16 bytes x 8.75e9 per rank: only offload fits
    assert job is not None and job.offload_optimizer
    assert recommend(1e12, 1, tight) == (None, None)


def test_estimate_recommend_prints_a_row_per_world_size(capsys):
    assert main(["estimate", "--params", "70e9", "--recommend", "--world", "64", "1024"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 64 ", "| 1024 "))]
    assert len(rows) == 4 and all("| 3 |" in row for row in rows[2:]), out


@pytest.mark.parametrize("text,message", [
    ('{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}',
     "max_grad_norm"),
    ('{"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}', "not supported"),
    ('{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": '
     '"WarmupDecayLR", "params": {"total_num_steps": "auto"}}}', "total_num_steps: 'auto'"),
])
def test_check_config_valid_means_initialize_accepts_it(tmp_path, capsys, text, message):
    """What initialize() would refuse without seeing the model, check-config refuses too."""
    path = tmp_path / "ds.json"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_check_config_reports_how_each_key_is_read(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "zero_optimization": {"stage": 3, "max_live_parameters": 5,
                              "contiguous_gradients": True,
                              "zero_quantized_nontrainable_weights": False},
        "prescale_gradients": False, "cuda_visible_devices": "0"}))
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    rows = {line.split()[0]: line.split(None, 1)[1] for line in err.splitlines()
            if line.startswith("  ")}
    assert rows["zero_optimization.stage"] == "used"
    assert rows["zero_optimization.max_live_parameters"] == \
        "used (as stage3_max_live_parameters)"
    assert rows["zero_optimization.contiguous_gradients"].startswith("accepted, no effect")
    assert rows["zero_optimization.zero_quantized_nontrainable_weights"] == \
        "accepted: the feature is off"
    assert rows["prescale_gradients"].startswith("accepted, no effect here")
    assert rows["cuda_visible_devices"] == "ignored: unknown top-level key"
