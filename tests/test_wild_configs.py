"""DeepSpeed configs from public projects, kept verbatim in tests/ds_configs/ (where each came
from: SOURCES.json), used as a user would use them with zeroengine.initialize: each trains two
optimizer steps at world size 2 with a small model, or is refused naming a feature zeroengine
does not implement. Where a config leaves its optimizer (or scheduler) to the caller - no section,
or a section of "auto" values meant for the Hugging Face Trainer - the optimizer (scheduler) is
passed in code, as such a user would."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

from zeroengine.testing import run_ranks

TESTS = os.path.dirname(os.path.abspath(__file__))
# ds_configs: the configs collected while the policy was written; ds_configs_heldout: a second
# set collected afterwards and first run as it is (issue 18's held-out measure)
SETS = ("ds_configs", "ds_configs_heldout")
CONFIGS = sorted(f"{d}/{f}" for d in SETS for f in os.listdir(os.path.join(TESTS, d))
                 if f.endswith(".json") and f != "SOURCES.json")
# Refused, and the feature the refusal names.
REFUSED = {
    # DeepSpeed refuses it too: clipping belongs in "gradient_clipping"
    "ds_configs/deepspeedexamples__bing_bert_deepspeed_bsz4096_adam_config.json": "max_grad_norm",
    "ds_configs/llama_factory__ds_z2_autotp_config.json": "tensor parallelism",
    "ds_configs_heldout/internvl__segmentation_adam_zero1_amp.json": "apex AMP is not supported",
    # an "auto" only the Hugging Face Trainer can fill: the message says what to pass instead
    "ds_configs_heldout/internvl__zero_stage1_config.json": "or pass an optimizer object",
    "ds_configs_heldout/internvl__zero_stage3_config.json": "or pass an optimizer object",
    "ds_configs_heldout/open_assistant__zero3_config_sft.json": "or pass lr_scheduler=",
}


def _all_auto(section) -> bool:
    params = (section or {}).get("params", {})
    return bool(params) and all(v == "auto" for v in params.values())


def train_three_steps(name: str):
    """On every rank: initialize with the config as it is; three optimizer steps (DeepSpeed's
    warm-up schedules hold their start lr, often 0, for the first two)."""
    import warnings

    import zeroengine
    from zeroengine import ConfigError
    with open(os.path.join(TESTS, name)) as f:
        raw = json.load(f)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = scheduler = None
    if raw.get("optimizer") is None or _all_auto(raw.get("optimizer")):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if _all_auto(raw.get("scheduler")):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the notices of no-effect keys
            engine = zeroengine.initialize(model, raw, optimizer=optimizer,
                                           lr_scheduler=scheduler)
    except (ConfigError, TypeError) as err:
        return "refused", str(err)
    losses = []
    g = torch.Generator().manual_seed(engine.comm.rank)
    for _ in range(3 * engine.gradient_accumulation_steps()):
        x = torch.randn(4, 16, generator=g).to(engine.precision.compute)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.consolidated_state_dict()
    moved = any(not torch.equal(state[k].float(), b.float())
                for k, b in zip(state, before))
    steps = engine.global_steps
    engine.close()
    return "trained", (steps, moved, all(torch.isfinite(torch.tensor(losses))))


def train_each(names: list[str]) -> list:
    """On every rank, one process for all configs (spawning ranks costs more than training)."""
    return [train_three_steps(name) for name in names]


@pytest.fixture(scope="module")
def outcomes():
    per_rank = run_ranks(2, train_each, CONFIGS, timeout=600)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(CONFIGS)}


@pytest.mark.parametrize("directory,least", [("ds_configs", 20), ("ds_configs_heldout", 10)])
def test_sources_are_recorded(directory, least):
    with open(os.path.join(TESTS, directory, "SOURCES.json")) as f:
        sources = {f"{directory}/{s['file']}": s for s in json.load(f)}
    assert sorted(sources) == [c for c in CONFIGS if c.startswith(directory + "/")]
    assert len(sources) >= least
    assert all(s["repository"] and s["path"] and len(s["commit"]) == 40
               for s in sources.values())


@pytest.mark.parametrize("name", CONFIGS)
def test_public_config_trains_or_names_the_missing_feature(outcomes, name):
    results = outcomes[name]
    outcome, detail = results[0]
    assert all(r[0] == outcome for r in results), results
    if name in REFUSED:
        assert outcome == "refused" and REFUSED[name] in detail, (outcome, detail)
        return
    assert outcome == "trained", detail
    for steps, moved, finite in (r[1] for r in results):
        assert steps == 3 and moved and finite, (steps, moved, finite)


@pytest.mark.parametrize("directory", SETS)
def test_two_thirds_train(outcomes, directory):
    """Issue 18's measure, per set: the held-out set (first run: 9 of 18 trained) now 14."""
    mine = {n: r for n, r in outcomes.items() if n.startswith(directory + "/")}
    trained = [n for n, r in mine.items() if r[0][0] == "trained"]
    assert len(trained) >= 2 * len(mine) / 3, (len(trained), len(mine))
