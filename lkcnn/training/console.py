"""The app's console: Lightning's log lines printed once, and known noise that says nothing about the run filtered."""
from __future__ import annotations

import logging
import warnings

# Lightning's advertisements for its hosted services, logged at INFO on every run.
ADVERTISEMENTS = ("💡 Tip:",)
# Deprecation warnings raised inside Lightning and torch about their own internals, which the user can do nothing
# about, and warnings the run summary puts in lkcnn's terms.
KNOWN_NOISE = (r".*isinstance\(treespec, LeafSpec\)` is deprecated",
               r"The dirpath has changed from")  # ModelCheckpoint resumed into a new folder: the `resume` line


class _DropAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ADVERTISEMENTS)


def quiet_known_noise() -> None:
    """Under Hydra, Lightning's INFO lines reach the console twice: through its own handler on the `lightning` logger
    and through Hydra's root handlers (which also write train.log). Keep Hydra's; drop advertisements and noise."""
    lightning_logger = logging.getLogger("lightning")
    if logging.getLogger().handlers:  # Hydra configured the root logger: let the records propagate there alone
        for handler in list(lightning_logger.handlers):
            if type(handler) is logging.StreamHandler:
                lightning_logger.removeHandler(handler)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvertisements) for f in rank_zero.filters):
        rank_zero.addFilter(_DropAdvertisements())
    for message in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message)
