"""Randomness that is a function of (seed, epoch), so a run resumed from an epoch-end checkpoint repeats exactly.

Lightning restores weights, optimizer, scheduler and loop counters but not RNG streams; re-deriving every stream
at each epoch start from the run seed and the epoch number makes the RNG state after a resume the same as in an
uninterrupted run, whatever happened before (sanity checks, validation, worker start-up).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler


def epoch_seed(seed: int, epoch: int, rank: int = 0) -> int:
    """A well-mixed 63-bit seed for one epoch of one run on one rank (seed+epoch would repeat across runs)."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def reseed_globals(seed: int, epoch: int, rank: int = 0) -> None:
    """Seed torch (all devices), numpy and random for this epoch: drop path, mixup, main-process transforms."""
    s = epoch_seed(seed, epoch, rank)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


class EpochShuffleSampler(Sampler[int]):
    """Random order drawn from (seed, epoch), plus a generator for the DataLoader's worker seeds.

    Pass `generator` to the DataLoader: it is re-seeded by `set_epoch`, which Lightning calls every epoch, so
    augmentations in workers are reproducible too (keep persistent_workers off, or workers keep their old state).
    """

    def __init__(self, data: Sized, seed: int) -> None:
        self.num_samples = len(data)
        self.seed = seed
        self.epoch = 0
        self.generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.generator.manual_seed(epoch_seed(self.seed, epoch) ^ 0x5EED)

    def __iter__(self) -> Iterator[int]:
        order = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        yield from torch.randperm(self.num_samples, generator=order).tolist()

    def __len__(self) -> int:
        return self.num_samples


class DeferredStartDataLoader(DataLoader):
    """A DataLoader whose iterator starts (draws worker seeds, takes indices, spawns workers) at the first batch.

    Lightning calls iter() on the first epoch's loader early - `estimated_stepping_batches` in
    configure_optimizers does - before a resumed run has restored its epoch and called `set_epoch`; a standard
    iterator would then shuffle and seed the resumed epoch as epoch 0.
    """

    def __iter__(self) -> Iterator[Any]:
        return _DeferredIterator(super().__iter__)


class _DeferredIterator:
    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self._start = start
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> _DeferredIterator:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._start()
        return next(self._iterator)
