"""lkcnn.training: the LightningModule, the DataModules (data sources) and helpers behind train.py."""
from .datamodule import ImageDataModule
from .distributed import SyncBatchNormPlugin
from .errors import ConfigError, CorruptImageError, PathNotFoundError, UserError, user_error_message
from .model_factory import build_model
from .module import ClassificationModule
from .resume import resolve_ckpt_path
from .sources import DigitsDataModule, ImageFolderDataModule, SyntheticDataModule

__all__ = ["ClassificationModule", "ConfigError", "CorruptImageError", "DigitsDataModule", "ImageDataModule",
           "ImageFolderDataModule", "PathNotFoundError", "SyncBatchNormPlugin", "SyntheticDataModule",
           "UserError", "build_model", "resolve_ckpt_path", "user_error_message"]
