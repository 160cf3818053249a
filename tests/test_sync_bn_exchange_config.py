"""Where SyncBatchNorm's exchanges run (CPU): NCCL unless the config asks for lkcnn's NVLink kernels, and those only
compiled on several GPUs of one machine; a bad setting fails at construction; a failed exchange's record turns into
one clear ExchangeError that names the exchange, the rank that did not answer and the setting that falls back to
NCCL. The kernels' bounded waits themselves run on GPUs: tests/test_sync_batchnorm_gpu.py and _2gpu.py."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

import lkcnn.training.distributed as distributed_file
import lkcnn.training.module as module_file
from lkcnn.ops import sync_batchnorm
from lkcnn.ops.sync_batchnorm import (
    DEFAULT_EXCHANGE_TIMEOUT_S,
    ExchangeError,
    check_nvlink_exchange,
    exchange_failure_message,
)
from lkcnn.training import ClassificationModule
from lkcnn.training.distributed import use_nvlink_exchange
from lkcnn.training.errors import ConfigError, user_error_message

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"name": "replknet_tiny", "num_classes": 4, "kernel_sizes": [3, 3, 3, 3], "small_kernel": 3}
OPTIM = {"optimizer": {"opt": "adamw", "lr": 1e-3}, "scheduler": {"sched": "cosine"}}


def record(reason: int, kind: int, peer: int, size: int, call: int) -> int:
    """A failure record as csrc/sync_bn/sync_exchange.cu's record_failure writes it."""
    return reason << 60 | kind << 56 | peer << 52 | size << 32 | call


def test_config_defaults_to_auto():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train")
        asked = compose(config_name="train", overrides=["module.sync_bn_exchange=lkcnn",
                                                        "module.sync_bn_exchange_timeout_s=5"])
    assert cfg.module.sync_bn_exchange == "auto"
    assert cfg.module.sync_bn_exchange_timeout_s == DEFAULT_EXCHANGE_TIMEOUT_S
    assert (asked.module.sync_bn_exchange, asked.module.sync_bn_exchange_timeout_s) == ("lkcnn", 5)


@pytest.mark.parametrize("setting,compiled,world_size,num_nodes,device,expected", [
    ("torch", True, 2, 1, "cuda", (False, "")),
    ("auto", True, 2, 1, "cuda", (True, "")),
    ("auto", True, 8, 2, "cuda", (False, "")),
    ("auto", False, 2, 1, "cuda", (False, "")),
    ("auto", True, 1, 1, "cuda", (False, "")),
    ("lkcnn", True, 2, 1, "cuda", (True, "")),
    ("lkcnn", True, 8, 2, "cuda", (False, "the run spans 2 machines")),
    ("lkcnn", False, 2, 1, "cuda", (False, "module.compile=reduce-overhead")),
    ("lkcnn", True, 1, 1, "cuda", (False, "several GPUs")),
    ("lkcnn", True, 2, 1, "cpu", (False, "several GPUs"))],
    ids=["torch", "auto", "auto-two-machines", "auto-eager", "auto-one-gpu", "asked", "two-machines", "eager",
         "one-gpu", "cpu"])
def test_nvlink_exchange_only_where_asked_and_possible(setting, compiled, world_size, num_nodes, device, expected):
    wanted, why_not = use_nvlink_exchange(setting, compiled=compiled, world_size=world_size, num_nodes=num_nodes,
                                          device_type=device)
    assert wanted == expected[0]
    assert expected[1] in why_not and bool(why_not) == bool(expected[1])


@pytest.mark.parametrize("kwargs,match", [
    ({"sync_bn_exchange": "nvlink"}, r"module.sync_bn_exchange='nvlink': use one of auto, lkcnn, torch"),
    ({"sync_bn_exchange_timeout_s": 0}, r"module.sync_bn_exchange_timeout_s=0: use a positive number of seconds"),
    ({"sync_bn_exchange_timeout_s": "5s"}, r"sync_bn_exchange_timeout_s='5s'")])
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ClassificationModule(MODEL, OPTIM, **kwargs)


@pytest.mark.parametrize("compile,setting,world_size,num_nodes,device,fails,expected", [
    (True, "torch", 2, 1, "cuda", False, None), (True, "lkcnn", 2, 1, "cuda", False, "nvlink"),
    (True, "lkcnn", 2, 1, "cuda", True, "cannot be set up.*no peer access"),
    (False, "lkcnn", 2, 1, "cuda", False, "compiled runs only"), (True, "lkcnn", 1, 1, "cuda", False, "several GPUs"),
    (True, "lkcnn", 4, 2, "cuda", False, "spans 2 machines"), (True, "lkcnn", 2, 1, "cpu", False, "several GPUs"),
    (True, "torch", 4, 2, "cuda", False, None), (True, "auto", 2, 1, "cuda", False, "nvlink"),
    (True, "auto", 2, 1, "cuda", True, "cannot be set up.*no peer access"), (False, "auto", 2, 1, "cuda", False, None),
    (True, "auto", 1, 1, "cuda", False, None), (True, "auto", 4, 2, "cuda", False, None),
    (True, "auto", 1, 1, "cpu", False, None)],
    ids=["torch", "compiled-2-gpus", "cannot-set-up", "eager", "one-gpu", "two-machines", "cpu",
         "two-machines-torch", "auto-compiled-2-gpus", "auto-cannot-set-up", "auto-eager", "auto-one-gpu",
         "auto-two-machines", "auto-cpu"])
def test_setup_enables_the_nvlink_exchange_where_it_applies(monkeypatch, recwarn, compile, setting, world_size,
                                                            num_nodes, device, fails, expected):
    """module.setup: lkcnn's exchange (with the configured limit) for a compiled run on several GPUs of one machine,
    by default (auto) or by name (lkcnn); NCCL elsewhere, silently under auto; a warning that says why where lkcnn
    was named and cannot run, or where the exchange cannot be set up."""
    calls = []

    def enable(group, timeout_s):
        if fails:
            raise RuntimeError("no peer access")
        calls.append((group, timeout_s))

    monkeypatch.setattr(distributed_file, "enable_nvlink_exchange", enable)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    trainer = SimpleNamespace(world_size=world_size, num_nodes=num_nodes,
                              strategy=SimpleNamespace(root_device=torch.device(device)))
    monkeypatch.setattr(ClassificationModule, "trainer", property(lambda self: trainer))
    module = ClassificationModule(MODEL, OPTIM, compile=compile, sync_bn_exchange=setting,
                                  sync_bn_exchange_timeout_s=7.5)
    module.setup("fit")
    assert calls == ([(dist.group.WORLD, 7.5)] if expected == "nvlink" else [])
    warned = [str(w.message) for w in recwarn if "NCCL" in str(w.message)]
    if expected in (None, "nvlink"):
        assert warned == []
    else:
        assert len(warned) == 1 and "stays on NCCL" in warned[0]
        assert re.search(expected, warned[0]), warned


def test_failure_messages_name_the_exchange_the_rank_and_the_fallback():
    timeout = exchange_failure_message(record(1, 2, 1, 512, 1234), rank=0, timeout_s=5.0)
    assert timeout == (
        "SyncBatchNorm's NVLink exchange (batch statistics of 512 channels, call 1234) failed on rank 0: rank 1 did "
        "not answer within 5 s (it died, ran out of memory or skipped an exchange; a slow host can also be late). "
        "Set module.sync_bn_exchange=torch to exchange through NCCL, or raise module.sync_bn_exchange_timeout_s "
        "(now 5) if rank 1 is only slow.")
    peer_failed = exchange_failure_message(record(2, 1, 3, 1000, 7), rank=2, timeout_s=60.0)
    assert "(gradient sums of 1000 values, call 7) failed on rank 2: rank 3 gave up on an exchange" in peer_failed
    diverged = exchange_failure_message(record(3, 2, 0, 64, 9), rank=1, timeout_s=60.0)
    assert "rank 0 made another exchange at this call (the ranks' BatchNorm calls diverged)" in diverged
    for message in (timeout, peer_failed, diverged):
        assert "\n" not in message and message.endswith("is only slow.")
        assert "module.sync_bn_exchange=torch" in message


def test_check_raises_once_the_kernels_record_a_failure(monkeypatch):
    """check_nvlink_exchange (after every training step) reads the record the kernels write into mapped host memory;
    the error is a user error, so train.py prints its message alone."""
    status = torch.zeros(1, dtype=torch.int64)
    exchange = sync_batchnorm._Exchange(torch.empty(0), [0, 0], 1, 16384, 32768, status, 3.0)
    monkeypatch.setattr(sync_batchnorm, "_exchanges", {"0": exchange})
    monkeypatch.setattr(sync_batchnorm, "_raised", set())
    check_nvlink_exchange()  # no failure: nothing
    status[0] = record(1, 1, 0, 48, 2)
    with pytest.raises(ExchangeError, match=r"failed on rank 1: rank 0 did not answer within 3 s") as err:
        check_nvlink_exchange()
    assert user_error_message(err.value) == str(err.value)
    assert sync_batchnorm._raised == {"0"}  # the watchdog then only notes the exit


def test_module_checks_after_every_training_step(monkeypatch):
    checked = []
    monkeypatch.setattr(module_file, "check_nvlink_exchange", lambda: checked.append(True))
    ClassificationModule(MODEL, OPTIM).on_train_batch_end(None, None, 0)
    assert checked == [True]


def test_enable_rejects_a_non_positive_limit():
    with pytest.raises(ValueError, match="positive number of seconds"):
        sync_batchnorm.enable_nvlink_exchange(SimpleNamespace(group_name="x"), timeout_s=0)
