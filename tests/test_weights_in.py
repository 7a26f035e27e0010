"""Weights in: ``initialize(model, config, weights=...)`` and meta-device models, against plain
PyTorch on the same data. A model built on the meta device (FSDP2's recipe) is materialised
from safetensors files read by parameter name (at stage 3 each rank reads only its slices),
or by each module's own reset_parameters() under a seed that does not depend on the world
size or the stage; ordinary models given weights= load them the same way."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from zeroengine import WeightsError
from zeroengine.checkpoint.weights.weight_files import WeightFiles
from zeroengine.testing import run_ranks

VOCAB, WIDTH = 37, 24


class TinyLM(nn.Module):
    """Embedding tied to the output head, norms, a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(WIDTH),
                                                    nn.Linear(WIDTH, 2 * WIDTH),
                                                    nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
                                      for _ in range(3)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def loss_of(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def batches(world: int, steps: int = 3):
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (2 * world, 9), generator=gen) for _ in range(steps)]


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def save_reference(tmp, sharded: bool = False, dtype=torch.float32) -> dict:
    """A TinyLM's state dict written as save_pretrained would (tied head left out), one
    file or an index over two; returns the values."""
    torch.manual_seed(5)
    state = {k: v.to(dtype).contiguous() for k, v in TinyLM().state_dict().items()
             if k != "head.weight"}
    if not sharded:
        save_file(state, os.path.join(tmp, "model.safetensors"))
        return state
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, os.path.join(tmp, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return state


def reference_run(state: dict, world: int, steps: int = 3):
    """Plain PyTorch, one process: first loss and parameters after AdamW steps on the whole
    batch (the mean over ranks' halves, which is what the engine's averaging computes)."""
    model = TinyLM()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    first = None
    for ids in batches(world, steps):
        loss = sum(loss_of(model, ids[2 * r:2 * r + 2]) for r in range(world)) / world
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
        opt.zero_grad()
    return first, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_run(stage: int, weights: str | None, on_meta: bool, steps: int = 3, seed: int = 3):
    import zeroengine
    zeroengine.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(seed)
    if on_meta:
        with torch.device("meta"):
            model = TinyLM()
    else:
        model = TinyLM()
    engine = zeroengine.initialize(model, config(stage), weights=weights)
    first = None
    for ids in batches(world, steps):
        loss = loss_of(engine, ids[2 * rank:2 * rank + 2])
        if first is None:
            first = loss.detach().clone()
            torch.distributed.all_reduce(first)
            first = first.item() / world
        engine.backward(loss)
        engine.step()
    state = engine.consolidated_state_dict()
    engine.close()
    return first, state


def max_error(state: dict, reference: dict) -> float:
    return max((state[k].float() - reference[k].float()).abs().max().item() for k in reference)


# -- the file reader ---------------------------------------------------------------------------
def test_reader_reads_exact_element_ranges(tmp_path):
    values = {"a": torch.randn(5, 7), "b": torch.randn(3, 4).bfloat16(), "i": torch.arange(10)}
    save_file(values, str(tmp_path / "model.safetensors"))
    files = WeightFiles.open(str(tmp_path))
    for key, value in values.items():
        assert torch.equal(files.read_full(key), value)
    for begin, n in ((0, 35), (4, 9), (34, 1), (13, 0)):
        out = torch.empty(n)
        files.read("a", begin, out)
        assert torch.equal(out, values["a"].reshape(-1)[begin:begin + n])
    out = torch.empty(5)  # bf16 on disk, read into fp32
    assert torch.equal(files.read("b", 3, out), values["b"].float().reshape(-1)[3:8])


def test_reader_refuses_damaged_and_missing_files(tmp_path):
    save_file({"w": torch.randn(64)}, str(tmp_path / "model.safetensors"))
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:-10])
    with pytest.raises(WeightsError, match="truncated or damaged"):
        WeightFiles.open(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        WeightFiles.open(str(tmp_path))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_reference(str(sharded), sharded=True)
    os.remove(sharded / "model-00002-of-00002.safetensors")
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors.*lacks"):
        WeightFiles.open(str(sharded))
    with pytest.raises(WeightsError, match="no such file"):
        WeightFiles.open(str(tmp_path / "nowhere"))


# -- single process ----------------------------------------------------------------------------
def _single(fn, *args):
    return run_ranks(1, fn, *args)[0]


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "indexed"])
def test_meta_model_with_weights_matches_plain_pytorch(tmp_path, sharded):
    state = save_reference(str(tmp_path), sharded=sharded)
    first_ref, after_ref = reference_run(state, 1)
    first, after = _single(engine_run, 3, str(tmp_path), True)
    assert abs(first - first_ref) <= 1e-6
    assert max_error(after, after_ref) <= 2e-4
    assert torch.equal(after["head.weight"], after["embed.weight"])  # still tied


# -- several ranks -----------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_meta_model_with_weights_at_two_ranks(tmp_path, stage):
    state = save_reference(str(tmp_path), sharded=True)
    first_ref, after_ref = reference_run(state, 2)
    for first, after in run_ranks(2, engine_run, stage, str(tmp_path), True):
        assert abs(first - first_ref) <= 1e-6, (first, first_ref)
        assert max_error(after, after_ref) <= 2e-4


def test_materialised_model_given_weights_loads_them(tmp_path):
    state = save_reference(str(tmp_path))
    first_ref, after_ref = reference_run(state, 2)
    for first, after in run_ranks(2, engine_run, 3, str(tmp_path), False):
        assert abs(first - first_ref) <= 1e-6
        assert max_error(after, after_ref) <= 2e-4


def _initial_state(stage: int, seed: int):
    import zeroengine
    zeroengine.init_distributed()
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = TinyLM()
    engine = zeroengine.initialize(model, config(stage))
    state = engine.consolidated_state_dict()
    engine.close()
    return state


def test_reset_parameters_values_do_not_depend_on_world_or_stage():
    one = run_ranks(1, _initial_state, 0, 7)[0]
    for stage in (1, 3):
        for state in run_ranks(2, _initial_state, stage, 7):
            assert max_error(state, one) == 0.0, stage
    other_seed = run_ranks(1, _initial_state, 0, 8)[0]
    assert max_error(other_seed, one) > 0  # the user's seed decides them
    plain = TinyLM().state_dict()
    for key, value in one.items():  # initialised as reset_parameters() does: not NaN, not 0
        assert torch.isfinite(value).all() and value.abs().sum() > 0 or "bias" in key, key
        assert value.shape == plain[key].shape


def _train_and_save(ckpt: str):
    import zeroengine
    zeroengine.init_distributed()
    torch.manual_seed(2)
    engine = zeroengine.initialize(TinyLM(), config(3))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for ids in batches(world, 2):
        engine.backward(loss_of(engine, ids[2 * rank:2 * rank + 2]))
        engine.step()
    engine.save_checkpoint(ckpt)
    state = engine.consolidated_state_dict()
    engine.close()
    return state


def test_weights_from_a_consolidated_checkpoint(tmp_path):
    """engine.save_checkpoint -> `zeroengine consolidate` -> a meta model at another world
    size starts from exactly those values."""
    from zeroengine.tools.cli import main
    trained = run_ranks(2, _train_and_save, str(tmp_path / "ckpt"))[0]
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    for _, state in run_ranks(1, engine_run, 3, str(tmp_path / "out"), True, 0):
        assert max_error(state, trained) == 0.0


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x) * self.scale


class HalfReset(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)

    def reset_parameters(self):  # forgets the bias
        nn.init.ones_(self.weight)


def _refused(model_cls, weights):
    import zeroengine
    zeroengine.init_distributed()
    with torch.device("meta"):
        model = model_cls()
    try:
        zeroengine.initialize(model, config(3), weights=weights)
    except WeightsError as e:
        return str(e)
    return None


def test_meta_parameters_nothing_covers_are_refused_by_name(tmp_path):
    for message in run_ranks(2, _refused, NoReset, None):
        assert message is not None and "'scale'" in message and "reset_parameters()" in message \
            and "weights=" in message, message
    save_file({"inner.weight": torch.zeros(4, 4)}, str(tmp_path / "part.safetensors"))
    message = run_ranks(1, _refused, NoReset, str(tmp_path / "part.safetensors"))[0]
    assert "holds no 'scale'" in message, message
    message = run_ranks(1, _refused, HalfReset, None)[0]
    assert "bias" in message and "left it" in message, message


def test_shape_mismatch_and_missing_files_refused_on_every_rank(tmp_path):
    state = {k: v for k, v in TinyLM().state_dict().items() if k != "head.weight"}
    state["norm.weight"] = torch.ones(WIDTH + 1)
    save_file(state, str(tmp_path / "model.safetensors"))
    for message in run_ranks(2, _refused, TinyLM, str(tmp_path)):
        assert "'norm.weight' has shape [25]" in message and "[24]" in message, message
    for message in run_ranks(2, _refused, TinyLM, str(tmp_path / "missing")):
        assert "no such file" in message, message


def _bytes_read_whole(path: str, stage: int):
    import zeroengine
    zeroengine.init_distributed()
    with torch.device("meta"):
        model = TinyLM()
    files = WeightFiles.open(path)
    engine = zeroengine.initialize(model, config(stage), weights=files)
    engine.close()
    return files.bytes_read


@pytest.mark.parametrize("stage", [0, 2])
def test_whole_parameters_are_read_once_per_rank(tmp_path, stage):
    """Stages 0-2 keep every parameter whole: each rank reads each tensor once, straight into
    its flat buffer (no second copy, no second read)."""
    state = save_reference(str(tmp_path))
    total = sum(v.numel() * v.element_size() for v in state.values())
    assert run_ranks(2, _bytes_read_whole, str(tmp_path), stage) == [total, total]
