"""Weights out: ``engine.save_pretrained(dir, max_shard_size, dtype)`` writes the Hugging Face
layout, streamed (each rank its own files), and the result equals the engine's
``consolidated_state_dict()`` bitwise (fp32) and loads with ``from_pretrained``; one file and
several plus an index; stages 0-3 at world sizes 1-3."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from zeroengine.checkpoint.weights.hf_export import plan_files
from zeroengine.checkpoint.weights.weight_files import WeightFiles
from zeroengine.testing import run_ranks

VOCAB = 64


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True))


def config(stage: int, bf16: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def export_runs(root: str, stages, bf16: bool = False):
    """On every rank, for each stage: two steps, then save_pretrained twice (one file; 8 KB
    files), and the consolidated state to compare with."""
    import zeroengine
    zeroengine.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for stage in stages:
        engine = zeroengine.initialize(llama(), config(stage, bf16))
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (2 * world, 10), generator=gen)[2 * rank:2 * rank + 2]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        one = engine.save_pretrained(os.path.join(root, f"{stage}-one"))
        many = engine.save_pretrained(os.path.join(root, f"{stage}-many"), max_shard_size="8KB")
        out[stage] = (engine.consolidated_state_dict(), one, many)
        engine.close()
    return out


def check(root: str, stage: int, state: dict, dtype=torch.float32):
    for layout in ("one", "many"):
        path = os.path.join(root, f"{stage}-{layout}")
        files = WeightFiles.open(path)
        assert set(files.entries) == set(state), (layout, set(files.entries) ^ set(state))
        for key, value in state.items():
            assert torch.equal(files.read_full(key), value.to(dtype)), (stage, layout, key)
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        for key, value in loaded.state_dict().items():
            assert torch.equal(value, state[key].to(dtype)), (stage, layout, key)
    index = json.load(open(os.path.join(root, f"{stage}-many", "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    assert index["metadata"]["total_size"] == sum(
        v.numel() * torch.empty(0, dtype=dtype).element_size() for v in state.values())
    assert not os.path.exists(os.path.join(root, f"{stage}-one", "model.safetensors.index.json"))
    assert os.path.exists(os.path.join(root, f"{stage}-one", "config.json"))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_save_pretrained_equals_the_consolidated_state_and_loads(tmp_path, world):
    llama().config.save_pretrained(str(tmp_path / "cfg"))  # transformers imported, warmed
    results = run_ranks(world, export_runs, str(tmp_path), (0, 1, 2, 3))
    for stage in (0, 1, 2, 3):
        state = results[0][stage][0]
        check(str(tmp_path), stage, state)
        # each rank wrote its own files: file k by rank k mod world
        many = [set(os.path.basename(p) for p in r[stage][2] if "-of-" in p) for r in results]
        assert all(many), many  # every rank wrote some (there are more files than ranks)
        assert not set.intersection(*many) if world > 1 else True


def test_save_pretrained_writes_the_training_dtype(tmp_path):
    results = run_ranks(2, export_runs, str(tmp_path), (3,), True)
    state = results[0][3][0]
    files = WeightFiles.open(str(tmp_path / "3-one"))
    assert {e.dtype for e in files.entries.values()} == {torch.bfloat16}
    check(str(tmp_path), 3, state, torch.bfloat16)


def test_plan_packs_names_in_order():
    assert plan_files([("a", 4), ("b", 4), ("c", 10), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_files([], 8) == [[]]
