"""What a new user meets: the run's summary block, Lightning's lines printed once, one line for every user error
(exit code non-zero, no traceback), and `ckpt_path=latest` that only resumes a run of the configured model."""
from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import lkcnn  # noqa: F401  (registers lkcnn's models with timm)
from lkcnn.deploy.checkpoint import read_checkpoint
from lkcnn.models import ModelError, build_model
from lkcnn.training import ConfigError, resolve_ckpt_path
from lkcnn.training.callbacks.run_summary import stage_kernels
from lkcnn.training.configs import command_line_error
from lkcnn.training.resume import check_resume_config, claim_run_dir, unused_run_dir
from lkcnn.training.errors import exit_on_user_error

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_app", ROOT / "train.py")
train_app = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_app)

TINY = ["model=replknet_tiny", "+model.channels=[8,8,16,16]", "+model.depths=[1,1,1,1]", "data=synthetic",
        "data.num_classes=4", "data.img_size=32", "data.num_train=8", "data.num_val=4", "data.batch_size=4",
        "data.num_workers=0", "trainer.max_epochs=1", "trainer.accelerator=cpu", "trainer.num_sanity_val_steps=0",
        "callbacks.progress_bar.refresh_rate=0", "cpu_threads=1"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_cfg(run_dir: Path, runs_dir: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={run_dir}", f"paths.runs_dir={runs_dir}", *TINY,
                                           *overrides])


def user_error(cfg: DictConfig) -> str:
    """The message train.py exits with for this config (it must be a user error, not a traceback)."""
    with pytest.raises(SystemExit) as exited, exit_on_user_error():
        train_app.train(cfg)
    message = str(exited.value.code)
    assert message.startswith("Error: ") and "\n" not in message, message
    return message


def run_cli(*args: str, env: dict[str, str] | None = None, multirun: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *["-m"] * multirun, *TINY, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})})


def test_summary_block_before_the_first_step(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    cfg = make_cfg(tmp_path / "run", tmp_path, "trainer.max_steps=2", "module.ema=null")
    train_app.train(cfg)
    block = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("lkcnn run:"))
    rows = dict(line.strip().split(None, 1) for line in block.splitlines()[1:])
    params = sum(p.numel() for p in instantiate(cfg.module).model.parameters())
    assert rows["model"].startswith(f"replknet_tiny ({params / 1e3:.1f} K parameters, kernels 31,29,27,13 on 8,4,2,1")
    assert rows["data"] == "SyntheticDataModule: 4 classes, 32 px, 8 train / 4 val images, batch 4"
    assert rows["device"] == "cpu, precision 32-true"
    assert rows["compile"] == "off (auto: eager on cpu)"  # module.compile=auto compiles on a GPU only
    assert rows["threads"] == "1 CPU threads, 0 loader workers"
    assert rows["steps"] == "2" and rows["output"] == str(tmp_path / "run")


@pytest.mark.parametrize("name,kernels", [("replknet31b", [31, 29, 27, 13]), ("convnext_lk_tiny", [31, 29, 27, 13]),
                                          ("slak_tiny", [51, 49, 47, 13]), ("unireplknet_b", [3, 13, 13, 13])])
def test_summary_names_each_stages_largest_kernel_in_every_family(name, kernels):
    """The summary's kernels (and its too-large-for-the-map warning) for every family of the zoo, not RepLKNet's
    alone: ConvNeXt-LK's plain and SLaK's decomposed kernels, UniRepLKNet's dilated blocks and 3x3 convs."""
    with torch.device("meta"):
        model = timm.create_model(name)
    assert stage_kernels(model) == kernels


def test_resuming_into_a_new_folder_says_where_the_earlier_best_stays(tmp_path, caplog, recwarn):
    """Lightning's ModelCheckpoint warns that it drops its best-k state when the folder changes; the summary says
    what that means for the user's files instead."""
    train_app.train(make_cfg(tmp_path / "a", tmp_path))  # one epoch, validated: a best checkpoint
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert any(p.name.startswith("best-") for p in last.parent.iterdir())
    caplog.set_level(logging.INFO)
    train_app.train(make_cfg(tmp_path / "b", tmp_path, "trainer.max_epochs=2", f"ckpt_path={last}"))
    block = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lkcnn run:")][-1]
    resume = dict(line.strip().split(None, 1) for line in block.splitlines()[1:])["resume"]
    assert resume.startswith(str(last)) and f"earlier best stays in {last.parent}" in resume
    assert f"hydra.run.dir={tmp_path / 'a'}" in resume
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]
    assert (tmp_path / "b" / "checkpoints" / "last.ckpt").exists() and last.exists()  # nothing overwritten


def test_another_runs_folder_is_refused_and_kept_unless_the_run_resumes_there(tmp_path):
    """hydra.run.dir=<an earlier run> without its ckpt_path (or two runs in one second's default folder) would have
    Lightning overwrite that run's last.ckpt and metrics: one line instead, nothing written; resuming there works."""
    run = tmp_path / "a"
    train_app.train(make_cfg(run, tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0", "logger=csv"))
    last = run / "checkpoints" / "last.ckpt"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    message = user_error(make_cfg(run, tmp_path, "trainer.max_steps=2", "trainer.limit_val_batches=0"))
    assert f"{run} already holds another run" in message and f"ckpt_path={last}" in message
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    train_app.train(make_cfg(run, tmp_path, "trainer.max_epochs=2", "trainer.limit_val_batches=0", f"ckpt_path={last}"))
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] > 1  # trained on, in place
    claim_run_dir(str(tmp_path / "b"), None)  # a run that started at the same moment, in the same default folder
    with pytest.raises(ConfigError, match="already holds another run"):
        claim_run_dir(str(tmp_path / "b"), None)


def test_the_command_refuses_another_runs_folder_before_hydra_writes_into_it(tmp_path):
    first = run_cli(f"hydra.run.dir={tmp_path}", "trainer.max_steps=1", "trainer.limit_val_batches=0")
    assert first.returncode == 0, first.stderr[-2000:]
    config = (tmp_path / ".hydra" / "config.yaml").read_text()
    again = run_cli(f"hydra.run.dir={tmp_path}", "trainer.max_steps=2", "trainer.limit_val_batches=0")
    assert again.returncode != 0 and f"{tmp_path} already holds another run" in again.stderr
    assert "Traceback" not in again.stderr and (tmp_path / ".hydra" / "config.yaml").read_text() == config


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    """Hydra's default folder is named after the second a run starts: a second run started in it (a shell loop of
    background runs) wrote its .hydra/ files over the first's. conf/train.yaml's folder is unused_run_dir's."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        default = compose("train", return_hydra_config=True).hydra.run
    assert OmegaConf.to_container(default)["dir"].startswith("${lkcnn.unused_dir:${paths.runs_dir}/${now:")
    run = f"hydra.run.dir=${{lkcnn.unused_dir:{tmp_path}/run}}"  # the default's resolver, on a fixed name
    first = run_cli(run, "trainer.max_steps=1", "trainer.limit_val_batches=0", "seed=1")
    second = run_cli(run, "trainer.max_steps=1", "trainer.limit_val_batches=0", "seed=2")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run_1"]
    for folder, seed in (("run", 1), ("run_1", 2)):
        assert OmegaConf.load(tmp_path / folder / ".hydra" / "config.yaml").seed == seed
        assert (tmp_path / folder / "checkpoints" / "last.ckpt").is_file()
    (tmp_path / "taken").mkdir()
    assert unused_run_dir(str(tmp_path / "taken")) == f"{tmp_path}/taken_1" and (tmp_path / "taken_1").is_dir()
    assert unused_run_dir(str(tmp_path / "taken")) == f"{tmp_path}/taken_1"  # Hydra resolves it more than once
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's ranks, each running the command: they share one folder
    assert unused_run_dir(str(tmp_path / "taken")) == str(tmp_path / "taken")


def test_multiruns_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    """A multirun's default folder is named after its second too: a second sweep started in it wrote its
    multirun.yaml and its jobs' .hydra/ files over the first's, then was refused. conf/train.yaml's sweep folder is
    unused_run_dir's, and every job of one sweep shares it."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        default = compose("train", return_hydra_config=True).hydra.sweep
    assert OmegaConf.to_container(default)["dir"].startswith("${lkcnn.unused_dir:${paths.runs_dir}/multirun/${now:")
    sweep = f"hydra.sweep.dir=${{lkcnn.unused_dir:{tmp_path}/sweep}}"  # the default's resolver, on a fixed name
    first = run_cli(sweep, "trainer.max_steps=1", "trainer.limit_val_batches=0", "seed=1,3", multirun=True)
    second = run_cli(sweep, "trainer.max_steps=1", "trainer.limit_val_batches=0", "seed=2", multirun=True)
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep", "sweep_1"]
    for folder, seeds in (("sweep", [1, 3]), ("sweep_1", [2])):
        assert OmegaConf.load(tmp_path / folder / "multirun.yaml").hydra.overrides.task[-1] == "seed=" + ",".join(
            map(str, seeds))
        for job, seed in enumerate(seeds):
            assert OmegaConf.load(tmp_path / folder / str(job) / ".hydra" / "config.yaml").seed == seed
            assert (tmp_path / folder / str(job) / "checkpoints" / "last.ckpt").is_file()


def test_a_config_mistake_leaves_no_run_folder_behind(tmp_path):
    """Hydra makes the run's folder before the run starts: a run stopped by a config value left one holding only
    Hydra's files, one per attempt. A folder the user named stays."""
    result = run_cli(f"paths.runs_dir={tmp_path / 'runs'}", "data.img_size=0")
    assert result.returncode == 1 and result.stderr.strip().endswith("data.img_size=0 must be a positive number of "
                                                                     "pixels: set e.g. data.img_size=224")
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    printed = run_cli(f"paths.runs_dir={tmp_path / 'runs'}", "--cfg", "all", "--resolve")  # prints, runs nothing
    assert printed.returncode == 0 and f"dir: {tmp_path / 'runs'}/" in printed.stdout
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    named = run_cli(f"hydra.run.dir={tmp_path / 'named'}", "data.img_size=0")
    assert named.returncode == 1 and (tmp_path / "named" / ".hydra" / "config.yaml").is_file()


def test_a_resume_that_changed_the_training_state_is_refused_and_ignored_settings_are_named(tmp_path):
    """Lightning restores EMA weights, optimizer state and schedule as they were: EMA turned off, another optimizer
    or weight decay turned off would end in a load_state_dict traceback, and a new lr would be silently ignored."""
    run = tmp_path / "a"
    train_app.train(make_cfg(run, tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0"))
    last = str(run / "checkpoints" / "last.ckpt")
    message = user_error(make_cfg(tmp_path / "b", tmp_path, f"ckpt_path={last}", "module.ema=null"))
    assert "trained with EMA on and this run has it off" in message and "module.ema" in message
    assert not (tmp_path / "b").exists()

    def config(*overrides: str) -> dict:
        return OmegaConf.to_container(make_cfg(tmp_path / "c", tmp_path, *overrides), resolve=True)
    for override, named in (("optim.optimizer.opt=sgd", "optim.optimizer.opt=adamw (this run: sgd)"),
                            ("optim.optimizer.weight_decay=0", "optim.optimizer.weight_decay=0.05 (this run: 0)"),
                            ("optim.optimizer.layer_decay=0.7", "optim.optimizer.layer_decay=None (this run: 0.7)")):
        with pytest.raises(ConfigError, match="resumes only into the same optimizer") as refused:
            check_resume_config(last, config(override))
        assert named in str(refused.value)
    (warning,) = check_resume_config(last, config("optim.optimizer.lr=1e-5", "optim.optimizer.weight_decay=0.1"))
    assert "optim.optimizer.lr=0.002 (this run: 1e-05)" in warning and "weight_decay=0.05 (this run: 0.1)" in warning
    assert check_resume_config(last, config()) == [] and check_resume_config(None, config("module.ema=null")) == []


@pytest.mark.parametrize("override,said", [
    ("trainer.max_epochs=abc", "trainer.max_epochs='abc': the cosine schedule is laid out over epochs"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 must be at least 1"),
    ("optim.optimizer.lr=-1", "optim.optimizer: Invalid learning rate: -1"),
    ("optim.optimizer.opt=adamww", "optim.optimizer: Optimizer adamww not found"),
    ("optim.scheduler.sched=cosin", "optim.scheduler: Unknown scheduler"),
    ("model.drop_path_rate=2", "drop_path_rate=2 must be a number in [0, 1)"),
    ("cpu_threads=-1", "cpu_threads=-1 must be a whole number of at least 1"),
    ("seed=abc", "seed='abc' must be a whole number of at least 0"),
    ("+data.transform.interpolation=bicubc", "data.transform: KeyError 'bicubc' from timm's create_transform"),
    ("+model.checkpoint_path=/no/such/weights.pth", "checkpoint_path=/no/such/weights.pth is not a file"),
    ("trainer.precision=bogus", "trainer: Precision 'bogus' is invalid. Allowed precision values:"),
    ("+trainer.bogus_key=1", "unexpected keyword argument 'bogus_key' (check the trainer.* settings)"),
    ("module.channels_last=maybe", "module.channels_last='maybe' must be true or false"),
    ("trainer=ddp", "trainer.sync_batchnorm=true needs GPUs (DDP runs SyncBatchNorm on CUDA tensors only): for DDP "
                    "on the CPU (gloo) add trainer.accelerator=cpu trainer.devices=2 trainer.sync_batchnorm=false"),
])
def test_values_that_timm_torch_or_lightning_reject_are_one_line_errors(tmp_path, override, said):
    assert said in user_error(make_cfg(tmp_path / "run", tmp_path, "trainer.max_steps=1", override))


def test_a_run_without_loggers_trains_without_the_learning_rate_monitor(tmp_path):
    """`~logger` (or logger=[]): Lightning refuses a LearningRateMonitor without a logger, after the sanity check."""
    train_app.train(make_cfg(tmp_path / "run", tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0",
                             "~logger"))
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_cli_prints_lightning_lines_once_without_advertisements(tmp_path):
    result = run_cli(f"hydra.run.dir={tmp_path}", "trainer.fast_dev_run=true")
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout + result.stderr
    assert printed.count("Seed set to 0") == 1, printed
    assert printed.count("lkcnn run:") == 1 and "Tip:" not in printed and "LeafSpec" not in printed
    assert "Seed set to 0" in (tmp_path / "train.log").read_text()  # the log file keeps the details


def test_bad_checkpoint_files_are_one_line_errors(tmp_path):
    good = tmp_path / "a"
    train_app.train(make_cfg(good, tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0"))
    last = good / "checkpoints" / "last.ckpt"
    truncated, noise = tmp_path / "truncated.ckpt", tmp_path / "noise.ckpt"
    truncated.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    noise.write_bytes(os.urandom(4096))
    for path in (truncated, noise):
        message = user_error(make_cfg(tmp_path / "b", tmp_path, f"ckpt_path={path}"))
        assert str(path) in message and ("truncated or corrupt" in message or "not a readable" in message), message
    other = user_error(make_cfg(tmp_path / "c", tmp_path, f"ckpt_path={last}", "model.kernel_sizes=[13,13,13,13]"))
    assert "kernel_sizes=default (this run: [13, 13, 13, 13])" in other
    weights = tmp_path / "weights.pth"  # the network's weights only: a run starts from them, it does not resume them
    torch.save(read_checkpoint(last).state_dict, weights)
    plain = user_error(make_cfg(tmp_path / "d", tmp_path, f"ckpt_path={weights}"))
    assert "is not a checkpoint written by train.py" in plain and f"+model.checkpoint_path={weights}" in plain


def test_sync_batchnorm_on_one_cpu_device_trains(tmp_path):
    """Lightning leaves sync_batchnorm alone without DDP: only a distributed CPU run is refused (above)."""
    train_app.train(make_cfg(tmp_path / "run", tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0",
                             "+trainer.sync_batchnorm=true"))
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_a_runs_checkpoint_starts_another_run_and_loads_through_timm(tmp_path):
    """+model.checkpoint_path=<a train.py checkpoint> ended in load_state_dict's report of every key, and timm's
    pretrained=True path refused the file: timm hands over the LightningModule's state_dict, the net's weights beside
    their EMA copy's. Both load the net's weights now; one that does not fit is one line."""
    train_app.train(make_cfg(tmp_path / "a", tmp_path, "trainer.max_steps=2", "trainer.limit_val_batches=0"))
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    checkpoint = read_checkpoint(last)
    assert any(k.startswith("model_ema.") for k in torch.load(last, weights_only=False)["state_dict"])

    def loaded(model: torch.nn.Module) -> bool:
        return all(torch.equal(model.state_dict()[k], v) for k, v in checkpoint.state_dict.items())
    overlay = dict(file=str(last), num_classes=checkpoint.spec["kwargs"]["num_classes"])
    assert loaded(timm.create_model(checkpoint.spec["name"], pretrained=True, pretrained_cfg_overlay=overlay,
                                    **checkpoint.spec["kwargs"]))
    assert loaded(build_model(checkpoint.spec, checkpoint_path=str(last)))
    assert loaded(build_model(checkpoint.spec, checkpoint_path=str(last), in_chans=3))
    with pytest.raises(ModelError, match=r"checkpoint_path=.*: its head.weight is \[4, 16\], the model's \[7, 16\] "
                                         r"\(another number of classes: set model.num_classes to the checkpoint's\)"):
        build_model(checkpoint.spec, checkpoint_path=str(last), num_classes=7)
    train_app.train(make_cfg(tmp_path / "b", tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0",
                             f"+model.checkpoint_path={last}"))
    message = user_error(make_cfg(tmp_path / "c", tmp_path, "model.kernel_sizes=[13,13,13,13]",
                                  f"+model.checkpoint_path={last}"))
    assert f"checkpoint_path={last}: checkpoint tensor" in message and "the model expects" in message


def test_cli_mismatched_checkpoint_exits_with_one_line(tmp_path):
    first = run_cli(f"hydra.run.dir={tmp_path / 'a'}", "trainer.max_steps=1", "trainer.limit_val_batches=0")
    assert first.returncode == 0, first.stderr[-2000:]
    # without validation the best-checkpoint callback is left out (it would warn that val/acc1 is never logged)
    assert "monitored key" not in first.stdout + first.stderr
    assert [p.name for p in (tmp_path / "a" / "checkpoints").iterdir()] == ["last.ckpt"]
    result = run_cli(f"hydra.run.dir={tmp_path / 'b'}", "model.kernel_sizes=[13,13,13,13]",
                     f"ckpt_path={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("Error: ckpt_path=")


def test_wandb_online_without_a_key_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))  # no ~/.netrc or settings of this machine's user
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    message = user_error(make_cfg(tmp_path / "run", tmp_path, "logger=wandb", "trainer.max_steps=1"))
    assert "W&B" in message and "logger.wandb.mode=offline" in message


def test_latest_resumes_only_a_run_of_this_model(tmp_path):
    """Runs with other kernel sizes: `latest` takes the newest run of this model, skipping the newer one of another
    model, and says which runs it found when none fits."""
    runs = {}
    for name, kernels in (("k31_old", "[31,29,27,13]"), ("k31", "[31,29,27,13]"), ("k13", "[13,13,13,13]")):
        cfg = make_cfg(tmp_path / name, tmp_path, f"model.kernel_sizes={kernels}", "trainer.max_steps=1",
                       "trainer.limit_val_batches=0")
        train_app.train(cfg)
        runs[name] = cfg
    model = instantiate(runs["k31"].module).model
    assert resolve_ckpt_path("latest", str(tmp_path), model) == str(tmp_path / "k31" / "checkpoints" / "last.ckpt")
    other = instantiate(make_cfg(tmp_path / "x", tmp_path, "model.kernel_sizes=[7,7,7,7]").module).model
    with pytest.raises(ConfigError, match=r"found 3 run\(s\).*none of this model.*kernel_sizes") as err:
        resolve_ckpt_path("latest", str(tmp_path), other)
    assert str(tmp_path / "k31") in str(err.value) and str(tmp_path / "k13") in str(err.value)


def test_config_values_that_cannot_run_are_one_line_errors(tmp_path):
    """A zero image size, and the `cuda` conv policy on tensors lkcnn's kernels cannot take (here the CPU)."""
    assert "data.img_size=0 must be a positive number of pixels" in user_error(
        make_cfg(tmp_path / "a", tmp_path, "data.img_size=0"))
    assert "forced to cuda" in user_error(make_cfg(tmp_path / "b", tmp_path, "conv_impl=cuda", "trainer.max_steps=1"))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.max_step=3"], "trainer.max_step is not a setting of this config: did you mean trainer.max_steps"),
    (["model=replknet31b", "model.kernel_size=[3,3,3,3]"], "did you mean model.kernel_sizes"),
    (["model=replknet_tinyy"], "model=replknet_tinyy is not one of the model configs"),
    (["+experiment=replknet31b_in1k"], "experiment already has a config: choose another with experiment=..."),
    (["-m", "model.kernel_szes=[7,7,7,7],[13,13,13,13]"], "did you mean model.kernel_sizes"),  # a sweep's first value
    (["--multirun", "data=digitz,synthetic"], "data=digitz is not one of the data configs"),
])
def test_misspelled_overrides_are_named_with_the_closest_names(overrides, message):
    error = command_line_error(overrides)
    assert error is not None and message in error and "\n" not in error


@pytest.mark.parametrize("overrides", [[], ["model=replknet31b", "model.kernel_sizes=[3,3,3,3]"],
                                       ["model.kernel_sizes=[3,3,3,3],[5,5,5,5]"], ["-m", "model.small_kernel=3,5"],
                                       ["--help"], ["hydra.run.dir=/tmp/somewhere"]])
def test_overrides_that_compose_sweep_or_pass_flags_go_on_to_hydra(overrides):
    assert command_line_error(overrides) is None


def test_cli_misspelled_key_exits_with_one_line(tmp_path):
    result = run_cli(f"hydra.run.dir={tmp_path}", "trainer.max_step=3")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("Error: trainer.max_step is not a setting") and "Traceback" not in result.stderr
