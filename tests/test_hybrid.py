"""Hybrid sharding (zero_optimization.mics_shard_size): 4 ranks as two "nodes" of two. The
states are sharded inside each pair and replicated across the pairs; training equals plain
PyTorch on the same global batches, each rank holds half the states instead of a quarter,
only the rank's shard of the gradient crosses groups, and checkpoints move between hybrid
and plain runs in both directions."""
from __future__ import annotations

import pytest
import torch
from harness import (
    TOLERANCE,
    make_model,
    max_relative_error,
    reference_train,
    relative_deviation,
    train_engine,
)

from zeroengine.distributed.topology import ranks_per_node, resolve_shard_size
from zeroengine.testing import run_ranks

STEPS, ACCUMULATION, CLIP = 3, 2, 0.5
WORLD = 4


def config(stage: int, shard_size=2, **zero) -> dict:
    return {"gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, "mics_shard_size": shard_size,
                                  "reduce_bucket_size": 40,
                                  "stage3_param_persistence_threshold": 0, **zero}}


def hybrid_cases(cases):
    """Per case (config, optimizer, env): the consolidated state, this rank's optimizer state
    bytes, the last step's comm report and the shard group's size."""
    import os
    out = []
    for cfg, optimizer, env in cases:
        saved_local = os.environ["LOCAL_RANK"]
        os.environ.update(env)
        if "LOCAL_WORLD_SIZE" in env:  # two "nodes": local ranks 0, 1, 0, 1
            os.environ["LOCAL_RANK"] = str(int(os.environ["RANK"]) % 2)
        engine, losses = train_engine(cfg, optimizer, STEPS - 1, ACCUMULATION)
        engine.comm_report(reset=True)
        from harness import run_step
        losses += run_step(engine, STEPS - 1, ACCUMULATION)
        report = engine.comm_report()
        held = sum(fg.layout.shard_numel for fg in engine.flat_groups)
        padded = sum(seg.numel for fg in engine.flat_groups for seg in fg.layout.segments)
        out.append((engine.consolidated_state_dict(), (engine.optimizer.state_nbytes(), held,
                                                       padded), report,
                    engine.topology.shard.world_size, losses))
        engine.close()
        for key in env:
            del os.environ[key]
        os.environ["LOCAL_RANK"] = saved_local
    return out


CASES = [  # (name, config, optimizer, env)
    ("stage1", config(1), "adamw", {}),
    ("stage2", config(2), "adamw", {}),
    ("stage3", config(3), "adamw", {}),
    ("stage2-auto", config(2, "auto"), "adamw", {"LOCAL_WORLD_SIZE": "2"}),
    ("stage3-offload", config(3, offload_optimizer={"device": "cpu"}), "adamw", {}),
    ("stage2-muon", config(2), "muon", {}),
    ("plain-stage2", config(2, -1), "adamw", {}),
    # ZeRO++: hpZ is exact; qwZ / qgZ are compared with the bf16 tracking tolerance
    ("hpz-stage3", config(3, -1, zero_hpz_partition_size=2), "adamw", {}),
    ("qwz-stage3", config(3, -1, zero_quantized_weights=True), "adamw", {}),
    ("qgz-stage2", config(2, -1, zero_quantized_gradients=True), "adamw", {}),
    # with the node size known, qgZ exchanges inside the node, then across (two hops)
    ("qgz2hop-stage3", config(3, -1, zero_quantized_gradients=True), "adamw",
     {"LOCAL_WORLD_SIZE": "2"}),
    ("hybrid-qwz-qgz-stage3", config(3, zero_quantized_weights=True,
                                     zero_quantized_gradients=True), "adamw", {}),
    # what "tracks the unquantized run" is measured against: bf16 against fp32
    ("plain-stage3", config(3, -1), "adamw", {}),
    ("plain-stage3-bf16", dict(config(3, -1), bf16={"enabled": True}), "adamw", {}),
]
QUANTIZED = ("qwz", "qgz", "hybrid-qwz")


@pytest.fixture(scope="module")
def trained():
    return run_ranks(WORLD, hybrid_cases, [c[1:] for c in CASES], timeout=900)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hybrid_equals_plain_pytorch(trained, case):
    index = CASES.index(case)
    reference = reference_train(case[2], WORLD, STEPS, ACCUMULATION, CLIP)
    plain = case[0].startswith(("plain", "hpz", "qwz", "qgz"))
    initial = {k: v.float() for k, v in make_model().state_dict().items()}
    for rank in range(WORLD):
        state, _, _, shard, _ = trained[rank][index]
        assert shard == (WORLD if plain else 2)
        if case[0].startswith(QUANTIZED) or "bf16" in case[0]:
            deviation = relative_deviation(state, reference, initial)
            assert 0 < deviation < TOLERANCE * (2 if case[0].startswith(QUANTIZED) else 1), \
                deviation
            # every rank trains the same (dequantized) weights
            assert all(torch.equal(v, trained[0][index][0][k]) for k, v in state.items())
        else:
            err, where = max_relative_error(state, reference)
            assert err <= 1e-5, f"rank {rank}, {where}: {err:.2e}"


def test_hybrid_holds_half_the_states_and_sends_a_shard_across(trained):
    names = [c[0] for c in CASES]
    hybrid, plain = trained[0][names.index("stage2")], trained[0][names.index("plain-stage2")]
    # each rank holds 1/2 of the flat states (Adam's moments with them), not 1/4
    (h_bytes, h_held, h_padded), (p_bytes, p_held, p_padded) = hybrid[1], plain[1]
    assert h_held * 2 == h_padded and p_held * 4 == p_padded
    assert h_bytes / p_bytes == pytest.approx(h_held / p_held, rel=0.02)
    cross = hybrid[2]["all_reduce@replica_group"]["sent_bytes"]
    inside = hybrid[2]["reduce_scatter"]["sent_bytes"]
    plain_rs = plain[2]["reduce_scatter"]["sent_bytes"]
    assert "all_reduce@replica_group" not in plain[2]
    # per micro-step (stage 2 reduces each), fp32: inside the group a 2-rank reduce-scatter
    # sends 1/2 of the gradient; across, the all-reduce of the rank's half between 2 groups
    # sends 2 x (1/2) x that half; plain ZeRO's 4-rank reduce-scatter sends 3/4 of it, all of
    # it potentially across nodes (here 1/2 of it would)
    assert inside == pytest.approx(h_padded * 4 * ACCUMULATION / 2, rel=0.01)
    assert cross == pytest.approx(h_padded * 4 * ACCUMULATION / 2, rel=0.01)
    assert plain_rs == pytest.approx(p_padded * 4 * ACCUMULATION * 3 / 4, rel=0.01)


@pytest.mark.parametrize("name", ["qwz-stage3", "qgz-stage2", "qgz2hop-stage3",
                                  "hybrid-qwz-qgz-stage3"])
def test_quantized_loss_tracks_unquantized_as_bf16_does(trained, name):
    """The loss curve of a quantized run strays from the exact one no more than a bf16 run's
    does (mean relative gap over the 6 micro-steps; the weights are checked against the
    bf16 tracking tolerance above)."""
    names = [c[0] for c in CASES]
    exact = trained[0][names.index("plain-stage3")][4]
    bf16 = trained[0][names.index("plain-stage3-bf16")][4]
    quantized = trained[0][names.index(name)][4]

    def mean_gap(losses):
        return sum(abs(a - b) / abs(b) for a, b in zip(losses, exact)) / len(exact)
    assert 0 < mean_gap(quantized) <= mean_gap(bf16), (mean_gap(quantized), mean_gap(bf16))


def test_zeropp_traffic(trained):
    """hpZ: after a segment's first gather in a step, every gather of it stays in the node;
    qwZ / qgZ: the collectives travel as int8 (+ scales)."""
    names = [c[0] for c in CASES]
    plain = trained[0][names.index("plain-stage2")][2]
    hpz = trained[0][names.index("hpz-stage3")][2]
    # the step's forward (2 micro-steps) gathers each segment once over the world; the second
    # micro-step and both backwards gather inside the node
    assert hpz["all_gather@node_group"]["calls"] > hpz["all_gather"]["calls"] > 0
    qwz = trained[0][names.index("qwz-stage3")][2]
    assert qwz["all_gather_int8"]["calls"] > 0 and "all_gather" not in qwz
    qgz = trained[0][names.index("qgz-stage2")][2]
    assert "reduce_scatter" not in qgz
    # fp32 -> int8 + one fp32 scale per 256 elements (at most: the test's buckets are small)
    assert qgz["reduce_scatter_int8"]["sent_bytes"] < 0.5 * plain["reduce_scatter"]["sent_bytes"]
    two_hops = trained[0][names.index("qgz2hop-stage3")][2]
    assert "reduce_scatter" not in two_hops
    # inside the node: (2 ranks) each sends 1 of 2 int8 pieces; across: 1 of 2 again
    inside = two_hops["reduce_scatter_int8@qgz_node_group"]["sent_bytes"]
    across = two_hops["reduce_scatter_int8@qgz_across_group"]["sent_bytes"]
    assert inside > 0 and across == pytest.approx(inside / 2, rel=0.1)
    both = trained[0][names.index("hybrid-qwz-qgz-stage3")][2]
    assert both["all_reduce@replica_group"]["calls"] > 0  # the cross-group sum stays exact


def test_shard_size_resolution():
    assert resolve_shard_size(-1, 8, 2) == 8
    assert resolve_shard_size(4, 8, 3) == 4
    assert resolve_shard_size("auto", 8, 1, {"LOCAL_WORLD_SIZE": "2"}) == 2
    assert resolve_shard_size("auto", 8, 1, {"SLURM_NTASKS_PER_NODE": "4(x2)"}) == 4
    assert ranks_per_node({}) is None
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        resolve_shard_size(3, 8, 2)
    with pytest.raises(ValueError, match="stage 0 shards nothing"):
        resolve_shard_size(2, 8, 0)
    with pytest.raises(ValueError, match="no launcher variable"):
        resolve_shard_size("auto", 8, 2, {})


def checkpoint_roundtrip(root: str):
    """hybrid stage 2 -> saved -> loaded by a plain stage 3 run, which saves it again -> loaded
    by a hybrid stage 3 run; each continues to the weights of the run that never stopped."""
    from harness import make_model, make_optimizer, param_groups, run_step

    import zeroengine
    hybrid, _ = train_engine(config(2), "adamw", 2, ACCUMULATION)
    hybrid.save_checkpoint(root, "hybrid")
    run_step(hybrid, 2, ACCUMULATION)
    expected = hybrid.consolidated_state_dict()
    hybrid.close()
    out = []
    for cfg, source in ((config(3, -1), "hybrid"), (config(3), "plain")):
        model = make_model()
        engine = zeroengine.initialize(model, cfg,
                                       optimizer=make_optimizer("adamw", param_groups(model)))
        engine.load_checkpoint(root, source)
        if source == "hybrid":
            engine.save_checkpoint(root, "plain")
        run_step(engine, 2, ACCUMULATION)
        out.append(max_relative_error(engine.consolidated_state_dict(), expected)[0])
        engine.close()
    return out


def test_checkpoints_reshard_between_hybrid_and_plain(tmp_path):
    for rank_errors in run_ranks(WORLD, checkpoint_roundtrip, str(tmp_path), timeout=600):
        assert max(rank_errors) <= 1e-6, rank_errors


def test_deepspeed_mics_key_is_read():
    import zeroengine
    cfg = zeroengine.parse_config({"zero_optimization": {"stage": 3, "mics_shard_size": 8}})
    assert cfg.zero_optimization.mics_shard_size == 8
    with pytest.warns(Warning, match="gathered inside the group"):
        zeroengine.parse_config({"zero_optimization": {
            "stage": 3, "mics_hierarchical_params_gather": True}})


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(1)


def disagreeing_auto():
    """Rank 3's launcher says 4 ranks per node, the others' 2: refused on every rank."""
    import os

    import zeroengine
    rank = int(os.environ["RANK"])
    os.environ["LOCAL_WORLD_SIZE"] = "4" if rank == 3 else "2"
    os.environ["LOCAL_RANK"] = str(rank % (4 if rank == 3 else 2))
    model = make_model()
    with pytest.raises(ValueError, match=r"resolved zero_optimization.mics_shard_size "
                                         r"differently \(rank 0: 2, .*rank 3: 4\)"):
        zeroengine.initialize(model, config(2, "auto"), optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1))
    return True


def test_ranks_that_see_different_nodes_are_refused():
    assert run_ranks(WORLD, disagreeing_auto) == [True] * WORLD


def test_traffic_model():
    from zeroengine.tools.traffic import Topology, cross_node_bytes
    topo = Topology(4, 2)
    plain = sum(cross_node_bytes(1e6, topo, 3, backend="gloo").values())
    # fp32, 1M parameters, 2 nodes of 2: forward and backward ring all-gathers cross at 2 of
    # 4 edges with 3/4 of 4 MB each, the point-to-point reduce-scatter sends 2 x 4 MB
    assert plain == pytest.approx(2 * 1.5 * 4e6 + 2 * 4e6)
    hybrid = sum(cross_node_bytes(1e6, topo, 3, hybrid=True).values())
    assert hybrid == pytest.approx(2 * 4e6) and hybrid <= plain / 2
    hpz = cross_node_bytes(1e6, topo, 3, hpz=True, backend="gloo")
    assert hpz["all_gather (backward)"] == 0
    big = Topology(1024, 8)
    ring = cross_node_bytes(70e9, big, 3, "bf16")
    assert ring["reduce_scatter"] == pytest.approx(ring["all_gather (forward)"])
    # two-hop qgZ: about half a bf16 ring's reduce-scatter bytes
    qgz = cross_node_bytes(70e9, big, 3, "bf16", qgz=True)["reduce_scatter"]
    assert qgz / ring["reduce_scatter"] == pytest.approx(1.0156 / 2, rel=0.01)


def test_estimate_prints_cross_node_traffic(capsys):
    from zeroengine.tools.cli import main
    assert main(["estimate", "--params", "7e9", "--stage", "3", "--world", "64",
                 "--ranks-per-node", "8", "--inter-gbps", "200"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 64 |")]
    per_node = {r[2].strip(): float(r[4]) for r in rows if len(r) > 5}
    assert set(per_node) >= {"plain", "hybrid (mics_shard_size = node)", "hpZ + qwZ + qgZ"}
    assert per_node["hpZ + qwZ + qgZ"] < per_node["hybrid (mics_shard_size = node)"] \
        < per_node["plain"]
