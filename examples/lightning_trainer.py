"""Lightning on zeroengine: a small GPT (zeroengine's example model) trained on random bytes
with the "zeroengine_stage_3" strategy, its weights built sharded in configure_model.

    python examples/lightning_trainer.py            # Lightning launches 2 CPU processes itself

The one change from a DDP / DeepSpeed run: ``strategy="ddp"`` (or "deepspeed_stage_3") becomes
``strategy="zeroengine_stage_3"`` after ``import zeroengine.integrations.lightning``. Needs
``pip install 'zeroengine[lightning]'``.
"""
from __future__ import annotations

import lightning.pytorch as L
import torch

import zeroengine.integrations.lightning  # noqa: F401  (registers the strategy names)
from zeroengine.examples.gpt import GPT, GPTConfig

CFG = GPTConfig(context=64, layers=2, heads=4, dim=128)


class LitGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.gpt = None

    def configure_model(self) -> None:
        if self.gpt is None:  # under the strategy: built directly sharded at stage 3
            self.gpt = GPT(CFG)

    def training_step(self, batch, batch_idx):
        (window,) = batch
        loss = self.gpt.loss(window[:, :-1], window[:, 1:])
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20), "interval": "step"}}


def main() -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, CFG.vocab, (640, CFG.context + 1),
                                                        generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="zeroengine_stage_3",
                        max_steps=20, accumulate_grad_batches=2, gradient_clip_val=1.0,
                        logger=False, default_root_dir="runs/lightning")
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
