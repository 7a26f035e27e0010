"""Property and fuzz tests (hypothesis): random configs either initialise or raise ConfigError
(never another exception); random model shapes and world sizes train the same at every stage;
random byte corruptions of a checkpoint's files are always refused by name."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import typing

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zeroengine import CheckpointError, ConfigError
from zeroengine.config import Config, parse_config
from zeroengine.config.fields import declared_type
from zeroengine.testing import run_ranks


# -- configs ---------------------------------------------------------------------------------------
def _value_in_schema(f: dataclasses.Field, t: type):
    """A value the field's documentation allows (ranges, choices)."""
    meta = f.metadata
    if meta.get("choices"):
        return st.sampled_from(list(meta["choices"]))
    if t is bool:
        return st.booleans()
    if t is int:
        lo = meta.get("lo") if meta.get("lo") is not None else 0
        return st.integers(lo, meta["hi"] if meta.get("hi") is not None else lo + 1000)
    if t is float:
        lo = meta.get("lo") if meta.get("lo") is not None else 0.0
        return st.floats(lo, meta["hi"] if meta.get("hi") is not None else lo + 1000.0,
                         allow_nan=False)
    if f.name.endswith("_path"):  # a directory: missing, the working one, or not a path
        return st.sampled_from(["", ".", "no_such_dir", "a\x00b"])
    if t is str:
        return st.text(max_size=8)
    return st.none()


def schema_configs(cls=Config, depth: int = 0):
    """Dicts of random subsets of a config section's keys, each with an allowed value ("auto"
    too where the key's type admits it)."""
    hints = typing.get_type_hints(cls)
    entries = {}
    for f in dataclasses.fields(cls):
        t, _, auto = declared_type(hints[f.name])
        if f.name in ("optimizer", "scheduler"):
            continue  # built from their own schemas elsewhere (tests/test_config.py)
        if dataclasses.is_dataclass(t):
            entries[f.name] = schema_configs(t, depth + 1)
        else:
            value = _value_in_schema(f, t)
            entries[f.name] = st.one_of(value, st.just("auto")) if auto else value
    return st.fixed_dictionaries({}, optional=entries)


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4),
                                                                      st.integers(), max_size=2))
KEYS = [f.name for f in dataclasses.fields(Config)] + \
    ["zero_optimization", "fp16", "bf16", "unknown_key", "zero_optimization.stage",
     "zero_optimization.offload_optimizer", "amp", "fp32_allreduce", "_comment"]


@st.composite
def mutated_configs(draw):
    """A schema config with some values replaced by junk of any type (or junk keys added)."""
    config = draw(schema_configs())
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS))
        if "." in key:
            section, sub = key.split(".")
            if isinstance(config.get(section), dict):
                config[section][sub] = draw(JUNK)
            continue
        config[key] = draw(JUNK)
    return config


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def initialize_or_config_error(config: dict) -> str:
    """Inside a fresh working directory: whatever the config makes (logs, swap files) stays
    out of the checkout."""
    with tempfile.TemporaryDirectory() as cwd, contextlib.chdir(cwd):
        return _initialize_or_config_error(config)


def _initialize_or_config_error(config: dict) -> str:
    import zeroengine
    model = tiny_model()
    try:
        engine = zeroengine.initialize(model, config,
                                       optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    except ConfigError:
        return "ConfigError"
    dtype = next(model.parameters()).dtype  # bf16/fp16 configs: the model computes in it
    loss = model(torch.randn(2, 4, dtype=dtype)).float().square().mean()
    engine.backward(loss)
    engine.step()  # a valid config also trains a step
    engine.close()
    return "ok"


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=schema_configs())
# every case hypothesis has found so far (kept here so that each run checks them):
@example(config={"compile": {"enabled": True, "backend": ""}})  # torch's InvalidBackend
@example(config={"compile": {"enabled": True, "backend": "inductor "}})
@example(config={"tensorboard": {"enabled": True, "output_path": "", "job_name": ""}})
@example(config={"csv_monitor": {"enabled": True, "output_path": "", "job_name": ""}})
@example(config={"csv_monitor": {"enabled": True, "job_name": "a\x00b"}})  # makedirs' NUL
@example(config={"zero_optimization": {"offload_optimizer": {  # created a directory
    "device": "nvme", "nvme_path": "no_such_dir"}}})
@example(config={"zero_optimization": {"stage": 0, "mics_shard_size": 2}})  # ValueError
@example(config={"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 2}})
@example(config={"zero_optimization": {"stage": 1, "mics_shard_size": "auto"}})  # no launcher
def test_configs_from_the_schema_initialise_or_raise_config_error(config):
    initialize_or_config_error(config)  # any other exception fails the test


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=mutated_configs())
def test_junk_configs_raise_only_config_error(config):
    try:
        parse_config(config)
    except ConfigError:
        pass


# -- stage equivalence over random shapes and world sizes ----------------------------------------
def mlp(widths: list[int]) -> nn.Module:
    """Linear layers of the given widths with tanh between them, seeded."""
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def train_shapes(widths: list[int], stage: int, steps: int = 3) -> dict:
    """A random-width MLP, 3 steps at ``stage`` on this rank's slice of one global batch."""
    import zeroengine
    model = mlp(widths)
    engine = zeroengine.initialize(model, {
        "gradient_clipping": 1.0, "zero_optimization": {
            "stage": stage, "reduce_bucket_size": 37,
            "stage3_param_persistence_threshold": 0}},
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    rank, world = engine.comm.rank, engine.comm.world_size
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(6, widths[0], generator=gen)
        per = x.shape[0] // world
        loss = model(x[rank * per:(rank + 1) * per]).square().mean()
        engine.backward(loss)
        engine.step()
    state = engine.consolidated_state_dict()
    engine.close()
    return state


def reference_shapes(widths: list[int], world: int, steps: int = 3) -> dict:
    model = mlp(widths)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(6, widths[0], generator=gen)
        per = x.shape[0] // world
        # the mean over ranks of each rank's mean loss, as data parallelism computes it
        loss = sum(model(x[r * per:(r + 1) * per]).square().mean() for r in range(world)) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(widths=st.lists(st.integers(1, 13), min_size=2, max_size=4),
       world=st.sampled_from([2, 3]), stage=st.integers(0, 3))
def test_random_shapes_and_world_sizes_match_plain_pytorch(widths, world, stage):
    results = run_ranks(world, train_shapes, widths, stage)
    reference = reference_shapes(widths, world)
    for rank, state in enumerate(results):
        for k, v in reference.items():
            err = ((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-6)).item()
            assert err < 1e-5, f"rank {rank} {k}: {err:.2e} (widths {widths}, stage {stage})"


# -- checkpoint corruption ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    import zeroengine
    root = str(tmp_path_factory.mktemp("ckpt"))
    model = tiny_model()
    engine = zeroengine.initialize(model, {"zero_optimization": {"stage": 1}},
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    engine.backward(model(torch.randn(2, 4)).square().mean())
    engine.step()
    engine.save_checkpoint(root, tag="t")
    engine.close()
    files = sorted(os.listdir(os.path.join(root, "t")))
    return root, files


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_checkpoint_files_are_refused_by_name(saved_checkpoint, tmp_path_factory,
                                                        data):
    root, files = saved_checkpoint
    name = data.draw(st.sampled_from(files), label="file")
    work = str(tmp_path_factory.mktemp("corrupt"))
    shutil.copytree(root, work, dirs_exist_ok=True)
    path = os.path.join(work, "t", name)
    with open(path, "rb") as f:
        original = f.read()
    raw = bytearray(original)
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label="keep")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] ^= data.draw(st.integers(1, 255), label="xor")
    assume(bytes(raw) != original)  # two flips of one byte can cancel out
    load_altered(root, work, name, bytes(raw))


def same_json(a: bytes, b: bytes) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def load_altered(root: str, work: str, name: str, raw: bytes) -> None:
    """Write ``raw`` over ``name`` in ``work`` (a copy of the checkpoint at ``root``) and load
    it: bytes that leave meta.json's content as it was (JSON whitespace: meta.json's checksum
    is over its content) load the checkpoint as saved; any other change is a CheckpointError
    naming the file."""
    import zeroengine
    path = os.path.join(work, "t", name)
    with open(path, "rb") as f:
        original = f.read()
    with open(path, "wb") as f:
        f.write(raw)
    model = tiny_model()
    engine = zeroengine.initialize(model, {"zero_optimization": {"stage": 1}},
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    if name == "meta.json" and same_json(raw, original):
        engine.load_checkpoint(work)
        reference = tiny_model()
        reference_engine = zeroengine.initialize(
            reference, {"zero_optimization": {"stage": 1}},
            optimizer=torch.optim.AdamW(reference.parameters(), lr=0.01))
        reference_engine.load_checkpoint(root)
        for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
            assert torch.equal(a, b), k
        reference_engine.close()
    else:
        with pytest.raises(CheckpointError) as info:
            engine.load_checkpoint(work)
        assert name in str(info.value), str(info.value)
    engine.close()


def test_meta_json_whitespace_is_not_corruption(saved_checkpoint, tmp_path):
    """Found by the exploring profile: two flips of meta.json's byte 1 turned its newline into
    a space, which is the same JSON; the checkpoint loads as saved."""
    root, _ = saved_checkpoint
    shutil.copytree(root, str(tmp_path), dirs_exist_ok=True)
    with open(os.path.join(root, "t", "meta.json"), "rb") as f:
        raw = bytearray(f.read())
    assert raw[1:2] == b"\n", raw[:8]
    raw[1] ^= 254 ^ 212  # the falsifying draws: xor 254, then xor 212, at byte 1
    load_altered(root, str(tmp_path), "meta.json", bytes(raw))
