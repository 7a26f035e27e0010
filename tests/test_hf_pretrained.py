"""``with zeroengine.zero_init(cfg): model = AutoModelForCausalLM.from_pretrained(dir)`` with
transformers 5, against the plain transformers model loaded the ordinary way: at stage 3 no
weight is read until initialize, and then each rank reads only its slices; stages 0-2 load
as transformers does. Tied embeddings, sharded checkpoints (an index), a base-model
checkpoint into a head model (the prefix), a key the checkpoint lacks (initialised by the
model's own _init_weights, only that one), dtype=, and the refusals."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
)

from zeroengine.testing import run_ranks

VOCAB = 64


def llama_config(**kw):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, tie_word_embeddings=True, **kw)


def gpt2_config():
    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


ARCHS = {"llama": (LlamaForCausalLM, llama_config), "gpt2": (GPT2LMHeadModel, gpt2_config)}


def save(tmp: str, arch: str, max_shard_size: str | None = None) -> str:
    cls, make = ARCHS[arch]
    torch.manual_seed(0)
    path = os.path.join(tmp, arch)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    cls(make()).save_pretrained(path, **kwargs)
    return path


def batches(world: int, steps: int = 3):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (2 * world, 12), generator=gen) for _ in range(steps)]


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def reference(path: str, world: int, steps: int = 3):
    """The plain transformers model, one process: first loss, parameters after AdamW steps
    on the whole batch (each rank's half weighted equally, as the engine averages)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    first = None
    for ids in batches(world, steps):
        loss = sum(model(input_ids=ids[2 * r:2 * r + 2], labels=ids[2 * r:2 * r + 2]).loss
                   for r in range(world)) / world
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
        opt.zero_grad()
    return first, {k: v.detach().clone() for k, v in model.state_dict().items()}


def zero_init_runs(path: str, stages, steps: int = 3):
    """On every rank, for each stage: from_pretrained under zero_init, how many parameters
    were still on the meta device after it, the first loss, the parameters after the steps."""
    import zeroengine
    zeroengine.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for stage in stages:
        with zeroengine.zero_init(config(stage)):
            model = AutoModelForCausalLM.from_pretrained(path)
        on_meta = sum(p.is_meta for p in model.parameters())
        model.train()
        engine = zeroengine.initialize(model, config(stage))
        first = None
        for ids in batches(world, steps):
            mine = ids[2 * rank:2 * rank + 2]
            loss = engine(input_ids=mine, labels=mine).loss
            if first is None:
                first = loss.detach().clone()
                torch.distributed.all_reduce(first)
                first = first.item() / world
            engine.backward(loss)
            engine.step()
        out[stage] = (on_meta, first, engine.consolidated_state_dict())
        engine.close()
    return out


def max_error(state: dict, ref: dict) -> tuple[float, str]:
    return max(((state[k].float() - v.float()).abs().max().item(), k) for k, v in ref.items()
               if v.is_floating_point())


@pytest.mark.parametrize("arch,world", [("llama", 2), ("llama", 3), ("gpt2", 2), ("gpt2", 3)])
def test_from_pretrained_under_zero_init_matches_plain_transformers(tmp_path, arch, world):
    path = save(str(tmp_path), arch, max_shard_size="20KB" if world == 2 else None)
    if world == 2:  # a sharded checkpoint (an index over several files)
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    first_ref, after_ref = reference(path, world)
    for rank_runs in run_ranks(world, zero_init_runs, path, (0, 1, 2, 3)):
        for stage, (on_meta, first, after) in rank_runs.items():
            # stage 3: nothing read at from_pretrained; 0-2: zero_init is not active
            expected_meta = sum(1 for _ in AutoModelForCausalLM.from_config(
                ARCHS[arch][1]()).parameters()) if stage == 3 else 0
            assert on_meta == expected_meta, (stage, on_meta)
            assert abs(first - first_ref) <= 1e-6, (stage, first, first_ref)
            err, key = max_error(after, after_ref)
            assert err <= 2e-4, (stage, key, err)


def _load_one(path: str, cls_name: str, seed: int, dtype=None):
    import transformers

    import zeroengine
    zeroengine.init_distributed()
    cls = getattr(transformers, cls_name)
    torch.manual_seed(seed)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with zeroengine.zero_init(config(3)):
        model = cls.from_pretrained(path, **kwargs)
    engine = zeroengine.initialize(model, config(3))
    state = engine.consolidated_state_dict()
    dtypes = {p.dtype for p in model.parameters()}
    engine.close()
    return state, dtypes


def test_base_checkpoint_into_head_model_and_a_missing_key(tmp_path):
    """A LlamaModel checkpoint (keys without the 'model.' prefix) into a sequence classifier:
    every body weight from the file, only the missing 'score' head initialised by the model's
    _init_weights (the same values as transformers gives it under the same seed)."""
    torch.manual_seed(0)
    base = LlamaModel(llama_config(num_labels=3))
    path = str(tmp_path / "base")
    base.save_pretrained(path)
    torch.manual_seed(9)
    plain = LlamaForSequenceClassification.from_pretrained(path)
    for state, _ in run_ranks(2, _load_one, path, "LlamaForSequenceClassification", 9):
        for key, value in plain.state_dict().items():
            assert torch.equal(state[key], value.float()), key
    assert plain.score.weight.abs().sum() > 0


def test_dtype_is_kept(tmp_path):
    path = save(str(tmp_path), "llama")
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for state, dtypes in run_ranks(2, _load_one, path, "AutoModelForCausalLM", 0,
                                   torch.bfloat16):
        assert dtypes == {torch.bfloat16}
        for key, value in plain.state_dict().items():
            assert torch.equal(state[key], value.float()), key


def _load_expecting(path: str, cls_name: str):
    import transformers

    import zeroengine
    zeroengine.init_distributed()
    try:
        with zeroengine.zero_init(config(3)):
            model = getattr(transformers, cls_name).from_pretrained(path)
        zeroengine.initialize(model, config(3))
    except zeroengine.WeightsError as e:
        return str(e)
    return None


def test_shape_mismatch_is_named_on_every_rank(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "wide")
    LlamaForCausalLM(llama_config()).save_pretrained(path)
    narrow = llama_config()
    narrow.intermediate_size = 48  # the same keys, other shapes
    narrow.save_pretrained(path)  # the config now disagrees with the weights
    for message in run_ranks(2, _load_expecting, path, "LlamaForCausalLM"):
        assert message is not None and "mlp" in message and "[32, 64]" in message \
            and "[32, 48]" in message, message


def _unexpected(path: str):
    import zeroengine
    zeroengine.init_distributed()
    with zeroengine.zero_init(config(3)):
        _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return sorted(info["unexpected_keys"])


def test_unexpected_keys_are_reported_as_transformers_reports_them(tmp_path):
    from safetensors.torch import load_file, save_file
    path = save(str(tmp_path), "llama")
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(state, file, metadata={"format": "pt"})
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == ["model.layers.0.extra.weight"]  # theirs
    assert run_ranks(1, _unexpected, path)[0] == ["model.layers.0.extra.weight"]  # ours


def _bytes_read(path: str):
    import zeroengine
    zeroengine.init_distributed()
    with zeroengine.zero_init(config(3)):
        model = AutoModelForCausalLM.from_pretrained(path)
    files = next(p._ze_source.files for p in model.parameters() if p.is_meta)
    assert files.bytes_read == 0  # from_pretrained read no weight
    engine = zeroengine.initialize(model, config(3))
    engine.close()
    return files.bytes_read


def test_stage3_ranks_read_only_their_slices(tmp_path):
    """Every byte of the checkpoint is read once over all ranks, none twice: each rank read
    only the elements it keeps."""
    from zeroengine.checkpoint.weights.weight_files import WeightFiles
    path = save(str(tmp_path), "llama", max_shard_size="20KB")
    entries = WeightFiles.open(path).entries.values()
    total = sum(e.numel * torch.empty(0, dtype=e.dtype).element_size() for e in entries)
    read = run_ranks(2, _bytes_read, path)
    assert sum(read) == total, (read, total)
    assert max(read) <= total * 0.6, (read, total)


LAZY = """
import torch, transformers
from transformers import AutoModelForCausalLM   # modeling_utils not imported yet
import zeroengine
cfg = dict(train_micro_batch_size_per_gpu=1, zero_optimization=dict(stage=3))
with zeroengine.zero_init(cfg):
    model = AutoModelForCausalLM.from_pretrained(PATH)
print("on meta:", sum(p.is_meta for p in model.parameters()))
"""


def test_zero_init_catches_from_pretrained_when_transformers_imported_lazily(tmp_path):
    """`from transformers import AutoModelForCausalLM` alone does not load transformers'
    modeling_utils; zero_init must still bind from_pretrained (it once read every weight
    whole then)."""
    import subprocess
    import sys
    path = save(str(tmp_path), "llama")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(__import__(
               "zeroengine.testing", fromlist=["x"]).free_port())}
    done = subprocess.run([sys.executable, "-c", f"PATH = {path!r}\n" + LAZY], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = sum(1 for _ in LlamaForCausalLM(llama_config()).parameters())
    assert f"on meta: {expected}" in done.stdout, done.stdout + done.stderr[-2000:]
