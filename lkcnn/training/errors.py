"""Errors a user can cause through the config or the data: train.py prints their message alone, no stack trace."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from lkcnn.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value that cannot work (wrong model keyword, odd batch with mixup, unknown conv_impl...)."""


class PathNotFoundError(UserError, FileNotFoundError):
    """A dataset root or checkpoint path that does not exist, or a dataset without the expected layout."""


class CorruptImageError(UserError, OSError):
    """An image file that cannot be decoded, raised when data.on_corrupt=error."""


def user_error_message(err: BaseException) -> str | None:
    """The one-line message for an error the user caused, or None for anything else (a bug: keep its traceback).

    Looks through the causes, since Hydra's instantiate wraps errors raised in constructors; a `???` value that the
    command line left unset is a user error too.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue

    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, UserError):
            return str(cause)
        if type(cause).__module__.startswith("wandb") and type(cause).__name__ == "UsageError":
            return (f"W&B: {cause} Or log offline, lkcnn's default: unset WANDB_MODE or pass "
                    "logger.wandb.mode=offline")
        if isinstance(cause, MisconfigurationException):  # Lightning's: a Trainer setting that cannot work here
            hint = (" This machine has no usable GPU: add trainer.accelerator=cpu (with trainer=ddp, also "
                    "trainer.devices=2 or more and trainer.sync_batchnorm=false for DDP over gloo).") \
                if "gpu backend" in str(cause).lower() else ""
            return f"{cause} (check the trainer.* settings){hint}"
        if isinstance(cause, (MissingMandatoryValue, InterpolationToMissingValueError)):
            # the ??? key itself; behind an interpolation only the message names it
            key = cause.full_key if isinstance(cause, MissingMandatoryValue) else \
                str(cause).split("Missing mandatory value: ", 1)[-1].split()[0]
            return f"{key} has no value: set it on the command line, e.g. {key}=..."
        cause = cause.__cause__
    return None


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Inside: an error the user caused ends the program with `Error: <its message>`; any other keeps its traceback."""
    try:
        yield
    except Exception as err:
        message = user_error_message(err)
        if message is None:
            raise
        sys.exit(f"Error: {message}")
