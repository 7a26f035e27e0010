"""Hugging Face Transformers: a `transformers` causal LM built from a small config (nothing
downloaded) trains through `zeroengine.initialize` unchanged at stages 1-3, to plain PyTorch's
numbers, and its consolidated checkpoint loads back with `from_pretrained`. Needs the `hf` extra
(CI installs it)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the optional `hf` extra is not "
                                   "installed (pip install 'zeroengine[hf]')")

from harness import max_relative_error  # noqa: E402

import zeroengine  # noqa: E402
from zeroengine.testing import run_ranks  # noqa: E402
from zeroengine.tools.cli import main as cli  # noqa: E402

WORLD, STEPS, VOCAB = 2, 3, 64


def make_lm(seed: int = 0):
    """A 2-layer Llama with tied input/output embeddings. (Not GPT-2: the gradient of its
    attention *key* bias is zero in exact arithmetic, so Adam turns rounding noise into full-size
    updates and no two summation orders agree on it.)"""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def reference(steps: int) -> dict[str, torch.Tensor]:
    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(WORLD):
            ids = tokens(step, rank)
            (model(input_ids=ids, labels=ids).loss / WORLD).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# stage 3 runs with the bucket sizes of HF's ds_config_zero3.json: "auto", filled from the
# model's config.hidden_size (32) as transformers fills them for DeepSpeed
HF_AUTO_BUCKETS = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                   "stage3_param_persistence_threshold": "auto"}


def train_ranks(stage: int, save_dir: str | None) -> dict[str, torch.Tensor]:
    model = make_lm()
    zero = {"stage": stage, **(HF_AUTO_BUCKETS if stage == 3 else {
        "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0})}
    engine = zeroengine.initialize(model, {"zero_optimization": zero},
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    if stage == 3:
        z = engine.config.zero_optimization
        assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size,
                z.stage3_param_persistence_threshold) == (32 * 32, int(0.9 * 32 * 32), 320)
        assert engine.fetcher.prefetch_numel == int(0.9 * 32 * 32)
    for step in range(STEPS):
        ids = tokens(step, engine.comm.rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)  # the model's own loss
        engine.step()
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return engine.consolidated_state_dict()


@pytest.fixture(scope="module")
def expected():
    return reference(STEPS)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_transformers_model_trains_like_plain_pytorch(stage, expected, tmp_path):
    save = str(tmp_path / "ckpt") if stage == 3 else None
    state = run_ranks(WORLD, train_ranks, stage, save)[0]
    err, where = max_relative_error(state, {k: v.float() for k, v in expected.items()
                                            if k in state})
    assert err < 1e-5, (err, where)
    if save is None:
        return
    # Consolidate the sharded checkpoint; the directory loads with from_pretrained as it is.
    out = str(tmp_path / "hf")
    assert cli(["consolidate", save, out]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    reference_model = make_lm()
    reference_model.load_state_dict(expected)
    ids = tokens(99, 0)
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, reference_model(input_ids=ids).logits
    assert type(loaded) is transformers.LlamaForCausalLM
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


def trainer_on_engine_model(stage: int, out_dir: str) -> str | None:
    """The HF Trainer given the engine's model under a 2-process run: it wraps the model in
    its own DistributedDataParallel, which would reduce every gradient twice."""
    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zeroengine.initialize(model, {"zero_optimization": {"stage": stage}}, optimizer=opt)
    data = [{"input_ids": tokens(i, 0)[0], "labels": tokens(i, 0)[0]} for i in range(4)]
    args = transformers.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2,
                                          max_steps=1, use_cpu=True, report_to=[],
                                          save_strategy="no", logging_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=(opt, None))
    try:
        trainer.train()
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("stage", [0, 3])
def test_hf_trainer_wrapping_the_engine_model_in_ddp_is_refused(stage, tmp_path):
    for message in run_ranks(WORLD, trainer_on_engine_model, stage, str(tmp_path)):
        assert message is not None and "DistributedDataParallel" in message, message
        assert "Hugging Face Trainer" in message
