"""lkcnn.training: the LightningModule, data/ (DataModules), callbacks/, distributed setup and the app's helpers."""
from .data import DigitsDataModule, ImageDataModule, ImageFolderDataModule, SyntheticDataModule
from .distributed import SyncBatchNormPlugin
from .errors import ConfigError, CorruptImageError, PathNotFoundError, UserError, user_error_message
from .model_factory import build_model
from .module import ClassificationModule
from .resume import resolve_ckpt_path

__all__ = ["ClassificationModule", "ConfigError", "CorruptImageError", "DigitsDataModule", "ImageDataModule",
           "ImageFolderDataModule", "PathNotFoundError", "SyncBatchNormPlugin", "SyntheticDataModule",
           "UserError", "build_model", "resolve_ckpt_path", "user_error_message"]
