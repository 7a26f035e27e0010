"""Whole-parameter owners over a flat layout (pure math, no communication).

A tensor-wise optimizer (optim/kind.py) must step each parameter whole, so each parameter of
such a group gets one *owner* rank that keeps its optimizer state and steps it. Gradients and
master weights stay in the flat layout's chunks (layout/partition.py), where reduction,
checkpoints and stage 3 want them; at a step, the pieces of an owned parameter held in other
ranks' chunks travel to its owner and the updated values travel back (owner_step.py).

Assignment: a parameter lying wholly inside one rank's chunk is owned by that rank (nothing
moves for it); the others, largest first, go to the least-loaded rank, ties to the rank already
holding most of the parameter. Greedy list scheduling bounds the most-loaded rank by
``max(total / N + largest parameter, shard size)``: each rank steps and keeps state for about
1/N of the group, as ZeroRedundancyOptimizer's per-parameter partition does.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..layout.partition import FlatLayout, ShardPiece


@dataclass(frozen=True)
class OwnerPartition:
    owner: tuple[int, ...]  # per parameter (index into layout.slots): the rank that steps it
    world_size: int
    # per rank: the (owned parameter, offset of its first element in the rank's owned buffer)
    owned: tuple[tuple[tuple[int, int], ...], ...]
    owned_numel: tuple[int, ...]  # per rank: elements of the parameters it owns
    # sends[h][o]: pieces of rank h's shard belonging to parameters rank o owns, o != h
    sends: tuple[tuple[tuple[ShardPiece, ...], ...], ...]
    local: tuple[tuple[ShardPiece, ...], ...]  # per rank: pieces of its shard it owns itself

    @classmethod
    def of_layout(cls, layout: FlatLayout) -> "OwnerPartition":
        world = layout.world_size
        pieces = [layout.shard_pieces(r) for r in range(world)]
        held = [[0] * world for _ in layout.slots]  # held[param][rank]: elements in rank's chunk
        for r, rank_pieces in enumerate(pieces):
            for piece in rank_pieces:
                held[piece.param][r] += piece.numel
        owner = [-1] * len(layout.slots)
        load = [0] * world
        for i, slot in enumerate(layout.slots):
            whole_in = [r for r in range(world) if held[i][r] == slot.numel]
            if whole_in:
                owner[i] = whole_in[0]
                load[whole_in[0]] += slot.numel
        spanning = sorted((i for i in range(len(owner)) if owner[i] < 0),
                          key=lambda i: (-layout.slots[i].numel, i))
        for i in spanning:
            best = min(range(world), key=lambda r: (load[r], -held[i][r], r))
            owner[i] = best
            load[best] += layout.slots[i].numel
        owned = []
        for r in range(world):
            mine, offset = [], 0
            for i, o in enumerate(owner):
                if o == r:
                    mine.append((i, offset))
                    offset += layout.slots[i].numel
            owned.append(tuple(mine))
        sends = tuple(tuple(tuple(p for p in pieces[h] if owner[p.param] == o and o != h)
                            for o in range(world)) for h in range(world))
        local = tuple(tuple(p for p in pieces[r] if owner[p.param] == r) for r in range(world))
        return cls(tuple(owner), world, tuple(owned), tuple(load), sends, local)

    def owned_offset(self, rank: int) -> dict[int, int]:
        """Parameter index -> where its first element lies in ``rank``'s owned buffer."""
        return dict(self.owned[rank])

    def moved_numel(self, rank: int) -> tuple[int, int]:
        """(elements ``rank`` sends, elements it receives) in one chunks -> owners exchange;
        the owners -> chunks exchange moves the same amounts the other way."""
        sent = sum(p.numel for pieces in self.sends[rank] for p in pieces)
        received = sum(p.numel for h in range(self.world_size) for p in self.sends[h][rank])
        return sent, received
