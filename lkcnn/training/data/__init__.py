"""lkcnn.training.data: the DataModules (image folders, ImageNet, shards, digits, synthetic), their datasets and the
augmentation pieces timm lacks (a posterize for every Pillow, the GPU decode path)."""
from .datamodule import ImageDataModule
from .sources import DigitsDataModule, ImageFolderDataModule, SyntheticDataModule

__all__ = ["DigitsDataModule", "ImageDataModule", "ImageFolderDataModule", "SyntheticDataModule"]
# (lkcnn.training.data.shards is imported by its config, not here: `python -m lkcnn.training.data.shards` runs it)
