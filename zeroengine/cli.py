"""The ``zeroengine`` console script.

    zeroengine consolidate CKPT_DIR OUT [--tag TAG] [--pt]
"""
from __future__ import annotations

import argparse
import os
import sys


def _consolidate(args) -> int:
    from safetensors.torch import save_file

    from . import ckpt_format as fmt
    if args.tag is None and os.path.exists(os.path.join(args.checkpoint_dir, fmt.META)):
        path = args.checkpoint_dir  # given the checkpoint itself rather than its save_dir
    else:
        path = fmt.resolve(args.checkpoint_dir, args.tag)
    if path is None:
        raise fmt.CheckpointError(f"{os.path.join(args.checkpoint_dir, fmt.LATEST)} does not "
                                  "exist; name the checkpoint with --tag")
    state = fmt.consolidated_state_dict(path)
    os.makedirs(args.out, exist_ok=True)
    # safetensors refuses tensors sharing memory; every name gets its own contiguous copy
    state = {k: v.contiguous().clone() for k, v in state.items()}
    target = os.path.join(args.out, "model.safetensors")
    save_file(state, target, metadata={"format": "pt"})
    written = [target]
    if args.pt:
        import torch
        torch.save(state, os.path.join(args.out, "pytorch_model.pt"))
        written.append(os.path.join(args.out, "pytorch_model.pt"))
    numel = sum(v.numel() for v in state.values())
    print(f"{path}: {len(state)} tensors, {numel:,} elements (fp32) -> {', '.join(written)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroengine", description="zeroengine tools")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one fp32 state dict from a sharded checkpoint "
                       "(any world size), as model.safetensors")
    c.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint "
                   "(its latest tag is used), or one checkpoint directory in it")
    c.add_argument("out", help="output directory")
    c.add_argument("--tag", default=None, help="checkpoint tag (default: the latest)")
    c.add_argument("--pt", action="store_true", help="also write pytorch_model.pt")
    c.set_defaults(run=_consolidate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .ckpt_format import CheckpointError
    try:
        return args.run(args)
    except CheckpointError as err:
        print(f"zeroengine {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
