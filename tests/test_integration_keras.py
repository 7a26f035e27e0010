"""Keras 3 on zeroengine (torch backend; zeroengine.integrations.keras): model.fit() at world
size 2 ends with the parameters of Keras' own single-process fit() on the same global batches
(SGD with momentum, AdamW with a learning-rate schedule, global_clipnorm), at stages 0-3. Needs
the `keras` extra."""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import pytest

keras = pytest.importorskip("keras", reason="the optional `keras` extra is not installed "
                            "(pip install 'zeroengine[keras]')")

from harness import max_relative_error  # noqa: E402

from zeroengine.testing import run_ranks  # noqa: E402

GLOBAL_BATCH, EPOCHS = 8, 2


def data():
    import numpy as np
    rng = np.random.default_rng(3)
    x = rng.standard_normal((48, 8)).astype("float32")
    return x, np.sin(x.sum(axis=1, keepdims=True)).astype("float32")


def compiled(optim: str):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh",
                                                                    name="hidden"),
                              keras.layers.LayerNormalization(name="norm"),
                              keras.layers.Dense(1, name="out")], name="regressor")
    if optim == "sgd":
        opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    else:
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2,
                                                               decay_rate=0.7)
        opt = keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.01,
                                     global_clipnorm=0.5)
    model.compile(optimizer=opt, loss="mse")
    return model


def params(model) -> dict:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def single_process(optim: str) -> dict:
    model = compiled(optim)
    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return params(model)


def distributed(cases) -> list:
    from zeroengine.integrations import keras as zkeras
    out = []
    for stage, optim in cases:
        model = compiled(optim)
        engine = zkeras.distribute(model, {"zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0}})
        x, y = data()
        world = engine.comm.world_size
        history = model.fit(zkeras.shard(x, GLOBAL_BATCH), zkeras.shard(y, GLOBAL_BATCH),
                            batch_size=GLOBAL_BATCH // world, epochs=EPOCHS, shuffle=False,
                            verbose=0)
        out.append(dict(state=engine.consolidated_state_dict(),
                        iterations=int(model.optimizer.iterations.numpy()),
                        global_steps=engine.global_steps,
                        losses=history.history["loss"]))
        engine.close()
    return out


CASES = [(s, o) for o in ("sgd", "adamw") for s in range(4)]


@pytest.fixture(scope="module")
def results():
    per_rank = run_ranks(2, distributed, CASES, timeout=600)
    return {case: [r[i] for r in per_rank] for i, case in enumerate(CASES)}


def single_process_each(optims) -> list:
    return [single_process(o) for o in optims]


@pytest.fixture(scope="module")
def references():
    """Keras' own fit(), one process, the global batch (its own process: Keras' state is
    per process)."""
    return dict(zip(("sgd", "adamw"), run_ranks(1, single_process_each, ["sgd", "adamw"])[0]))


@pytest.mark.parametrize("optim,tol", [("sgd", 1e-5), ("adamw", 2e-4)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fit_ends_with_keras_single_process_parameters(results, references, stage, optim,
                                                       tol):
    reference = references[optim]
    for r in results[(stage, optim)]:
        err, where = max_relative_error(r["state"], reference)
        assert err <= tol, (err, where)
        assert r["iterations"] == EPOCHS * 48 // GLOBAL_BATCH
        assert r["global_steps"] == r["iterations"]  # Keras' opt.step() is the engine's step


def test_shard_reassembles_the_global_batches():
    import numpy as np

    from zeroengine.integrations.keras import shard
    x = np.arange(20)
    parts = [shard(x, 4, rank, 2) for rank in range(2)]
    assert parts[0].tolist() == [0, 1, 4, 5, 8, 9, 12, 13, 16, 17]
    assert parts[1].tolist() == [2, 3, 6, 7, 10, 11, 14, 15, 18, 19]
    with pytest.raises(ValueError, match="multiple of the world size"):
        shard(x, 3, 0, 2)
