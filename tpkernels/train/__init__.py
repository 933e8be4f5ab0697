"""The main job: training at any TP × PP × DP layout (``tpkernels train``)."""

from tpkernels.train.config import TrainConfig
from tpkernels.train.trainer import Trainer, train

__all__ = ["TrainConfig", "Trainer", "train"]
