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

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs")
CONFIGS = sorted(f for f in os.listdir(HERE) if f.endswith(".json") and f != "SOURCES.json")
# Refused, and the feature the refusal names.
REFUSED = {
    # DeepSpeed refuses it too: clipping belongs in "gradient_clipping"
    "deepspeedexamples__bing_bert_deepspeed_bsz4096_adam_config.json": "max_grad_norm",
    "deepspeedexamples__cifar_ds_config.json": "fp16 master weights",
    "deepspeedexamples__cifar_ds_config_lamb.json": "LAMB",
    "llama_factory__ds_z2_autotp_config.json": "tensor parallelism",
}


def _all_auto(section) -> bool:
    params = (section or {}).get("params", {})
    return bool(params) and all(v == "auto" for v in params.values())


def train_two_steps(name: str):
    """On every rank: initialize with the config as it is; two optimizer steps."""
    import warnings

    import zeroengine
    from zeroengine.config import ConfigError
    with open(os.path.join(HERE, name)) as f:
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
    for _ in range(2 * engine.gradient_accumulation_steps):
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
    return [train_two_steps(name) for name in names]


@pytest.fixture(scope="module")
def outcomes():
    per_rank = run_ranks(2, train_each, CONFIGS, timeout=600)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(CONFIGS)}


def test_sources_are_recorded():
    with open(os.path.join(HERE, "SOURCES.json")) as f:
        sources = {s["file"]: s for s in json.load(f)}
    assert sorted(sources) == CONFIGS and len(CONFIGS) >= 20
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
        assert steps == 2 and moved and finite, (steps, moved, finite)


def test_two_thirds_train(outcomes):
    trained = [n for n, r in outcomes.items() if r[0][0] == "trained"]
    assert len(trained) >= 2 * len(outcomes) / 3, (len(trained), len(outcomes))
