"""The main job: training at any TP × PP × DP layout (``tpkernels train``).

``TrainConfig`` is light; ``Trainer`` and ``train`` import torch and the model code on first use
(PEP 562), so the command line can parse and check a config before paying for them."""

from tpkernels.train.config import TrainConfig

__all__ = ["TrainConfig", "Trainer", "train"]


def __getattr__(name: str):
    if name in ("Trainer", "train"):
        from tpkernels.train import trainer  # noqa: PLC0415

        return getattr(trainer, name)
    raise AttributeError(f"module 'tpkernels.train' has no attribute {name!r}")
