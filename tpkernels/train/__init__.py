"""The main job: training at any TP × PP × DP layout (``tpkernels train``).

``TrainConfig`` is light; ``Trainer`` and ``train`` import torch and the model code on first use
(PEP 562), so the command line can parse and check a config before paying for them."""

from tpkernels._lazy import lazy_names
from tpkernels.train.config import TrainConfig

__all__ = ["TrainConfig", "Trainer", "train"]
__getattr__ = lazy_names(__name__, {"Trainer": "trainer", "train": "trainer"})
