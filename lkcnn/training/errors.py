"""Errors a user can cause through the config or the data: train.py prints their message alone, no stack trace."""
from __future__ import annotations


class UserError(Exception):
    """Base of the errors whose message says what to change; nothing below it is a bug."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work (wrong model keyword, odd batch with mixup, unknown conv_impl...)."""


class PathNotFoundError(UserError, FileNotFoundError):
    """A dataset root or checkpoint path that does not exist, or a dataset without the expected layout."""


class CorruptImageError(UserError, OSError):
    """An image file that cannot be decoded, raised when data.on_corrupt=error."""


def find_user_error(err: BaseException | None) -> UserError | None:
    """The UserError behind `err`, if any: Hydra's instantiate wraps errors raised in constructors."""
    while err is not None:
        if isinstance(err, UserError):
            return err
        err = err.__cause__
    return None
