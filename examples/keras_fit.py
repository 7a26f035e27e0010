"""Keras 3 (torch backend) on zeroengine: model.fit() at ZeRO stage 2.

    torchrun --nproc_per_node 2 examples/keras_fit.py         # or: python examples/keras_fit.py

The one added line: ``zkeras.distribute(model, config)`` after ``model.compile``; each rank
fits its shard of the data (``zkeras.shard``). Needs ``pip install 'zeroengine[keras]'``.
"""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from zeroengine.integrations import keras as zkeras  # noqa: E402

GLOBAL_BATCH = 64


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 16)).astype("float32")
    y = np.sin(x.sum(axis=1, keepdims=True)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, activation="gelu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.AdamW(3e-3, global_clipnorm=1.0), loss="mse")
    engine = zkeras.distribute(model, {"zero_optimization": {"stage": 2}})
    model.fit(zkeras.shard(x, GLOBAL_BATCH), zkeras.shard(y, GLOBAL_BATCH),
              batch_size=GLOBAL_BATCH // engine.comm.world_size, epochs=3, shuffle=False,
              verbose=2 if engine.comm.rank == 0 else 0)


if __name__ == "__main__":
    main()
