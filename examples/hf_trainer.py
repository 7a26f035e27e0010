"""The Hugging Face Trainer on zeroengine: a small Llama (built from a config, nothing
downloaded) trained on random tokens with ZeRO-3 from a Hugging Face style DeepSpeed config.

    torchrun --nproc_per_node 2 examples/hf_trainer.py      # or: python examples/hf_trainer.py

The one change from a DeepSpeed run: ``Trainer(..., args=TrainingArguments(...,
deepspeed="ds.json"))`` becomes ``ZeroTrainer(..., args=TrainingArguments(...),
zero_config="ds.json")``. Needs ``pip install 'zeroengine[hf]'``.
"""
from __future__ import annotations

import os
import sys

import torch
import transformers

from zeroengine.integrations.hf import ZeroTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def main(out_dir: str = "runs/hf_trainer") -> None:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (256, 32), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=20, learning_rate=3e-3, warmup_steps=4, logging_steps=5, save_steps=10,
        report_to=[], use_cpu=not torch.cuda.is_available())
    trainer = ZeroTrainer(model=model, args=args, train_dataset=data[:224],
                          eval_dataset=data[224:],
                          zero_config=os.path.join(HERE, "hf_zero3_auto.json"))
    trainer.train()
    print(trainer.evaluate())
    trainer.save_model(os.path.join(out_dir, "final"))  # loads with from_pretrained


if __name__ == "__main__":
    main(*sys.argv[1:])
