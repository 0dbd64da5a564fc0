"""The course's shared helpers: one small module per concern.

- ``env``     device choice, capabilities, the environment report
- ``bench``   the one timing harness and the peaks measured on this machine
- ``memory``  allocated / reserved / peak memory, snapshots
- ``data``    MNIST (local → download → bundled sample), GPU-resident batches, synthetic data
- ``models``  the small models the notebooks train
- ``plot``    tables and the few chart shapes
- ``results`` headline figures that the reference run collects
- ``train``   the language-model training step (autocast, GradScaler, clipping)
"""

from utils import bench, data, env, memory, models, plot, results, train

__all__ = ["bench", "data", "env", "memory", "models", "plot", "results", "train"]
