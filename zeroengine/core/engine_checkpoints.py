"""A ZeroEngine's states and weights to and from files: ``save_checkpoint`` /
``load_checkpoint`` (checkpoint/sharded.py, or DCP's layout), ``save_pretrained`` and
``save_16bit_model`` (checkpoint/weights/hf_export.py), and ``consolidated_state_dict``. The
work is in checkpoint/; these are the engine's verbs for it."""
from __future__ import annotations

import torch

from .compat.compiled import uncompiled


class EngineCheckpoints:
    """Mixed into ZeroEngine; reads its flat groups, module and topology."""

    @property
    def plain_module(self) -> torch.nn.Module:
        """The model without torch.compile's wrapper: the module whose state_dict keys a
        checkpoint holds (what checkpoint/ reads, so that it needs nothing from core/)."""
        return uncompiled(self.module)

    def save_checkpoint(self, save_dir: str, tag: str | None = None,
                        client_state: dict | None = None, node_local: bool = False,
                        save_latest: bool = True, format: str = "zeroengine",
                        async_save: bool | None = None):
        """Collective: each rank writes its own shards of ``<save_dir>/<tag>`` (default tag
        ``global_step<N>``), atomically; ``latest`` then names it. Returns the path.
        ``node_local=True``: each rank's ``save_dir`` is its own (not shared); the checkpoint
        is the union of the ranks' directories, as Ray Train assembles it.
        ``format="dcp"``: a torch.distributed.checkpoint directory in FSDP2's layout
        ({"model": ..., "optim": ...}) that FSDP2/torchtitan load with ``dcp.load`` (no RNG
        states in it); ``load_checkpoint`` reads either.
        ``async_save=True`` (default: the config's checkpoint.async_save): return a
        ``concurrent.futures.Future`` of the path as soon as this rank's states are copied to
        host memory; the files are written and committed in the background (checkpoint/
        saver.py). Every save, synchronous or not, fails on every rank at once or on none:
        ``latest`` then still names the last complete checkpoint (checkpoint/commit.py)."""
        if format == "dcp":
            if async_save:
                raise NotImplementedError("save_checkpoint(format='dcp', async_save=True) is "
                                          "not supported: DCP's own save holds the loop; use "
                                          "the default format for asynchronous saves")
            from ..checkpoint.interop.dcp_save import save_dcp
            from ..checkpoint.sharded import checked_tag
            if node_local:
                raise ValueError("save_checkpoint(format='dcp', node_local=True): DCP writes "
                                 "one shared directory; leave node_local out")
            return save_dcp(self, save_dir, checked_tag(tag, self), client_state, save_latest)
        if format != "zeroengine":
            raise ValueError(f"save_checkpoint(format={format!r}): 'zeroengine' (default) or "
                             "'dcp'")
        from ..checkpoint.sharded import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, node_local, save_latest,
                               async_save)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **options):
        """Collective: restore from ``<load_dir>/<tag>`` (None: the latest), whatever world
        size, stage or offload it was saved with. Returns (path, client_state). Options:
        load_optimizer_states, load_lr_scheduler_states, load_module_only, missing_ok (return
        (None, None) instead of raising when nothing was saved yet: the resume pattern),
        load_rng_states (default True: each rank's torch/numpy/Python generators as saved)."""
        from ..checkpoint.restore import load_checkpoint
        return load_checkpoint(self, load_dir, tag, **options)

    def save_pretrained(self, save_dir: str, max_shard_size="5GB", dtype=None) -> list[str]:
        """Collective: the weights in the Hugging Face layout (``model.safetensors``, or
        ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``), with the
        model's config.json when it is a transformers model; ``from_pretrained`` loads it.
        Streamed: tensor by tensor, each rank writing its own files (file k: rank k mod
        world) in a thread while the next are gathered; a rank holds about one output file.
        ``dtype``: bf16/fp16/fp32 (default: the training dtype). Returns this rank's files."""
        from ..checkpoint.weights.hf_export import save_pretrained
        return save_pretrained(self, save_dir, max_shard_size, dtype)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """Collective: rank 0 writes the model's weights in the compute dtype (bf16/fp16, or
        fp32 when that is what it trains in) as one safetensors file. At stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save`` (as in DeepSpeed); without it nothing is
        written and False is returned."""
        from ..checkpoint.weights.hf_export import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: on every rank, the full fp32 state dict with model.state_dict()'s keys."""
        full_values: dict[int, torch.Tensor] = {}
        for fg in self.flat_groups:
            full = fg.full_fp32(self.topology.shard)
            for i, p in enumerate(fg.params):
                slot = fg.layout.slots[i]
                full_values[id(p)] = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        out = {}
        for name, t in self.plain_module.state_dict(keep_vars=True).items():
            value = full_values.get(id(t))
            if value is None:
                value = t.detach()
                value = value.float() if value.is_floating_point() else value
            out[name] = value.clone().cpu()
        return out
