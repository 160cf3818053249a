"""`data.decode=gpu` on real JPEGs: the device half runs with device="cpu" here (libjpeg instead of nvJPEG), so the
CPU tests check what the GPU runs - shapes, normalization, the same augmentation statistics as the CPU path, odd
and corrupt files per data.on_corrupt - and a GPU test compares nvJPEG's run with the CPU's on the same crops.

The photos are scikit-learn's two sample images, cut and re-encoded as JPEG (tests/test_imagenet_pipeline.py).
"""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from PIL import Image
from test_imagenet_pipeline import BATCH, imagenet_config, photo, run_epoch, write_imagenet, write_odd_files

from lkcnn.training import ConfigError, CorruptImageError, ImageFolderDataModule
from lkcnn.training.data import gpu_decode
from lkcnn.training.data.datasets import CorruptImage

SIZE = 32  # output pixels: the statistics need many draws, kept cheap


def write_asymmetric(root: Path, rng: np.random.Generator, count: int = 4) -> None:
    """`count` real 500x375 JPEGs in two classes, each with its left third darkened, so a missing or doubled flip
    shows in the mean image."""
    for c in range(2):
        folder = root / f"n{c:08d}"
        folder.mkdir(parents=True)
        for i in range(count // 2):
            pixels = np.asarray(photo(rng)).copy()
            pixels[:, :170] = (pixels[:, :170] * 0.35).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.JPEG", quality=int(rng.integers(80, 96)))


def datamodule(root: Path, decode: str, **transform: object) -> ImageFolderDataModule:
    dm = ImageFolderDataModule(root=str(root), num_classes=2, img_size=SIZE, batch_size=2, val_fraction=0.5,
                               transform=transform, decode=decode)
    dm.setup("fit")
    return dm


def draws(dm: ImageFolderDataModule, index: int, n: int) -> torch.Tensor:
    """`n` augmented copies of one training image, through the CPU pipeline or the worker + device halves."""
    if dm.decode == "cpu":
        return torch.stack([dm.train_set[index][0] for _ in range(n)])
    batch, _, corrupt = dm.train_set.collate([dm.train_set[index] for _ in range(n)])
    images, keep, failed = gpu_decode.decode_batch(batch, "cpu")
    assert not corrupt and not failed and len(keep) == n
    return images


def per_draw(x: torch.Tensor) -> torch.Tensor:
    """Per output image: channel means (normalization, colour), channel stds and mean neighbour difference (crop
    scale, filter), left-minus-right half (flip): (N, 8)."""
    half = x.shape[-1] // 2
    flip = x[..., :half].mean((1, 2, 3)) - x[..., half:].mean((1, 2, 3))
    detail = (x[..., 1:] - x[..., :-1]).abs().mean((1, 2, 3))
    return torch.cat([x.mean((2, 3)), x.std((2, 3)), flip[:, None], detail[:, None]], 1)


def test_device_path_draws_the_same_crops_flips_and_normalization_as_the_cpu_path(tmp_path, no_cuda_check):
    write_asymmetric(tmp_path, np.random.default_rng())
    recipe = dict(scale=[0.08, 1.0], hflip=0.5, color_jitter=None, interpolation="bicubic")
    cpu, gpu = datamodule(tmp_path, "cpu", **recipe), datamodule(tmp_path, "gpu", **recipe)
    n = 400
    for index in range(len(cpu.train_set)):
        a, b = per_draw(draws(cpu, index, n)), per_draw(draws(gpu, index, n))
        # difference of means in standard errors: a wrong flip rate, scale range, filter or normalization gives
        # 6-14 here (tried), a right one under 3
        z = (a.mean(0) - b.mean(0)).abs() / (a.var(0) / n + b.var(0) / n).sqrt()
        assert z.max() < 5.5, (index, z)


def test_color_jitter_runs_on_the_device_with_the_cpu_paths_spread(tmp_path, no_cuda_check):
    write_asymmetric(tmp_path, np.random.default_rng())
    whole = dict(scale=[1.0, 1.0], ratio=[4 / 3, 4 / 3], hflip=0.0, color_jitter=0.4, interpolation="bicubic")
    cpu, gpu = datamodule(tmp_path, "cpu", **whole), datamodule(tmp_path, "gpu", **whole)
    assert gpu.train_set.transform.color_jitter is not None and not gpu.train_set.transform.skipped
    n = 200
    ratios = []
    for index in range(len(cpu.train_set)):  # the crop is the whole image: the spread is the jitter's alone
        a, b = per_draw(draws(cpu, index, n))[:, :6], per_draw(draws(gpu, index, n))[:, :6]
        assert a.std(0).min() > 0.02  # the CPU path jitters at all
        ratios.append(b.std(0) / a.std(0))
    ratio = torch.stack(ratios).mean()
    assert 0.85 < ratio < 1.18, ratio  # half the jitter (0.2) gives about 0.6


def test_imagenet_recipe_with_decode_gpu_trains_and_validates(tmp_path, no_cuda_check, caplog):
    rng = np.random.default_rng()
    write_imagenet(tmp_path, train=4, val=2, rng=rng)  # 12 training images: 3 batches of 4
    with caplog.at_level(logging.WARNING, logger="lkcnn.training.data.datamodule"):
        dm = instantiate(imagenet_config(tmp_path, 3, decode="gpu").data)
        dm.setup("fit")
        dm.setup("validate")  # a second setup does not warn again
    assert not [r.getMessage() for r in caplog.records if "data.decode=gpu skips" in r.getMessage()]
    transform = dm.train_set.transform
    assert transform.rand_augment is not None and transform.random_erasing is not None and transform.hflip == 0.5
    mean = torch.tensor(transform.mean).view(1, 3, 1, 1)
    for images, targets in run_epoch(dm, 0, train=True):
        assert images.shape == (BATCH, 3, 64, 64) and images.dtype == torch.float32
        assert torch.isfinite(images).all() and images.std() > 0.1
        assert targets.shape == (BATCH, 3)  # mixup/cutmix and label smoothing after the device half
        torch.testing.assert_close(targets.sum(1), torch.ones(BATCH))
        pixels = images * torch.tensor(transform.std).view(1, 3, 1, 1) + mean  # back to 0..1, but for erasing
        assert pixels.quantile(0.02) > -0.2 and pixels.quantile(0.98) < 1.2
    # validation is deterministic: the device half matches the CPU pipeline up to the two resize implementations
    cpu = instantiate(imagenet_config(tmp_path, 3).data)
    cpu.setup("fit")
    device_val, cpu_val = run_epoch(dm, 0, train=False), run_epoch(cpu, 0, train=False)
    assert sum(len(t) for _, t in device_val) == 6
    for (a, ta), (b, tb) in zip(device_val, cpu_val, strict=True):
        assert torch.equal(ta, tb) and a.shape == b.shape
        assert (a - b).abs().mean() < 0.03 and (a - b).abs().max() < 0.5  # normalized units; 1/255 is ~0.017


def test_odd_files_take_the_cpu_decode_and_corrupt_ones_are_counted_once(tmp_path, no_cuda_check, caplog):
    rng = np.random.default_rng()
    write_imagenet(tmp_path, train=6, val=2, rng=rng)
    files = write_odd_files(tmp_path, rng)
    dm = instantiate(imagenet_config(tmp_path, 3, decode="gpu").data)
    dm.setup("fit")
    index = {Path(p).name: i for i, (p, _) in enumerate(dm.train_set.samples)}
    for name in ("cmyk", "gray", "png", "exif"):  # decoded by the worker, with load_rgb
        image = dm.train_set[index[files[name].name]][0]
        assert image.data.dim() == 3 and image.data.shape[0] == 3, name
    plain = next(p for p, _ in dm.train_set.samples if "train_" in p)
    for path in (plain, files["tiny"]):  # plain RGB JPEGs travel as bytes, however small
        assert dm.train_set[index[Path(path).name]][0].data.dim() == 1, path
    assert isinstance(dm.train_set[index[files["truncated"].name]], CorruptImage)
    with caplog.at_level(logging.WARNING, logger="lkcnn.training.data.datamodule"):
        for epoch in range(2):
            train, val = run_epoch(dm, epoch, train=True), run_epoch(dm, epoch, train=False)
            assert dm.num_corrupt == 2 and all(torch.isfinite(images).all() for images, _ in train + val)
            assert sum(len(t) for _, t in val) == 6
    warnings = [r.getMessage() for r in caplog.records if "corrupt image" in r.getMessage()]
    assert len(warnings) == 2 and all("odd_truncated.JPEG" in w for w in warnings), warnings
    strict = instantiate(imagenet_config(tmp_path, 3, decode="gpu", on_corrupt="error").data)
    strict.setup("fit")
    with pytest.raises(CorruptImageError, match=r"odd_truncated\.JPEG .*data\.on_corrupt=skip"):
        run_epoch(strict, 0, train=True)


def test_a_batch_crosses_from_a_worker_as_one_tensor_of_jpeg_bytes(tmp_path, no_cuda_check):
    import io
    import pickle

    from multiprocessing.reduction import ForkingPickler  # torch registers its tensor reductions on it

    rng = np.random.default_rng()
    write_imagenet(tmp_path, train=6, val=2, rng=rng)
    write_odd_files(tmp_path, rng)
    dm = instantiate(imagenet_config(tmp_path, 3, decode="gpu").data)
    dm.setup("fit")
    samples = [dm.train_set[i] for i in range(len(dm.train_set))]
    batch, _, _ = dm.train_set.collate(samples)
    assert {image.data.dim() for image in batch.images} == {1, 3}  # plain JPEGs and images the worker decoded
    state = batch.__getstate__()
    assert [type(v).__name__ for v in state.values() if isinstance(v, torch.Tensor)] == ["Tensor"]
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(batch)  # as a DataLoader worker sends it
    received = pickle.loads(buffer.getvalue())
    assert len(received) == len(batch)
    for sent, got in zip(batch.images, received.images, strict=True):
        assert got.path == sent.path and got.crop == sent.crop and torch.equal(got.data, sent.data)
    decoded = [gpu_decode.decode(b, "cpu")[0] for b in (batch, received)]
    assert all(torch.equal(a, b) for a, b in zip(*decoded, strict=True))
    dm.num_workers = 1  # and through a real worker process
    dm.trainer = SimpleNamespace(training=True)
    for images, targets in (dm.on_after_batch_transfer(dm.on_before_batch_transfer(b, 0), 0)
                            for b in dm.train_dataloader()):
        assert images.shape[1:] == (3, 64, 64) and torch.isfinite(images).all() and len(images) == len(targets)


def test_a_jpeg_the_decoder_rejects_costs_only_itself(tmp_path, no_cuda_check):
    """Bytes that passed the worker's checks but fail in the decoder: the batch decodes the rest, the file is
    reported; a batch with nothing left is one clear error."""
    write_asymmetric(tmp_path, np.random.default_rng())
    dm = datamodule(tmp_path, "gpu", scale=[0.08, 1.0], color_jitter=None)
    good = [dm.train_set[i % len(dm.train_set)] for i in range(3)]
    bad = gpu_decode.EncodedImage(good[0][0].data[:300].clone(), good[0][0].crop, "bad.JPEG")
    batch, targets, _ = dm.train_set.collate([good[0], (bad, 1), good[1], good[2]])
    images, keep, corrupt = gpu_decode.decode_batch(batch, "cpu")
    assert keep.tolist() == [0, 2, 3] and images.shape == (3, 3, SIZE, SIZE)
    assert [c.path for c in corrupt] == ["bad.JPEG"]
    images, kept_targets = dm.on_after_batch_transfer((batch, targets), 0)  # no trainer: as in validation
    assert images.shape[0] == 3 and torch.equal(kept_targets, targets[[0, 2, 3]]) and dm.num_corrupt == 1
    only_bad, _, _ = dm.train_set.collate([(bad, 1)])
    with pytest.raises(CorruptImageError, match="every image of a batch failed to decode"):
        dm.on_after_batch_transfer((only_bad, torch.tensor([1])), 0)


def test_decode_gpu_needs_cuda_and_image_files(tmp_path):
    write_asymmetric(tmp_path, np.random.default_rng(), count=2)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"needs a CUDA GPU.*set data\.decode=cpu$"):
            ImageFolderDataModule(root=str(tmp_path), num_classes=2, img_size=SIZE, batch_size=2, decode="gpu")
    with pytest.raises(ConfigError, match="data.decode='nvjpeg' must be one of cpu, gpu"):
        ImageFolderDataModule(root=str(tmp_path), num_classes=2, img_size=SIZE, batch_size=2, decode="nvjpeg")


def test_a_crop_the_device_path_cannot_do_is_a_config_error(tmp_path, no_cuda_check):
    write_asymmetric(tmp_path, np.random.default_rng(), count=2)
    with pytest.raises(ConfigError, match=r"with a random resized crop only, .*ResizeKeepRatio.*set data\.decode=cpu$"):
        datamodule(tmp_path, "gpu", train_crop_mode="rkrc")


def on_both_devices(dm: ImageFolderDataModule, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` training draws, decoded and augmented on CUDA (returned on the CPU) and on the CPU: the same draws."""
    batch, _, _ = dm.train_set.collate([dm.train_set[i % len(dm.train_set)] for i in range(n)])
    on_gpu, keep, corrupt = gpu_decode.decode_batch(batch, "cuda")
    on_cpu, _, _ = gpu_decode.decode_batch(batch, "cpu")
    assert on_gpu.is_cuda and len(keep) == n and not corrupt
    return on_gpu.cpu(), on_cpu


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvjpeg_matches_the_cpu_decode_on_the_same_crops(tmp_path):
    rng = np.random.default_rng()
    write_asymmetric(tmp_path, rng, count=8)
    dm = datamodule(tmp_path, "gpu", scale=[0.08, 1.0], hflip=0.5, color_jitter=None, interpolation="bicubic")
    on_gpu, on_cpu = on_both_devices(dm, 32)
    diff = (on_gpu - on_cpu).abs()
    # nvJPEG and libjpeg differ in IDCT and chroma upsampling by a few levels of 255 (0.017 normalized each)
    assert diff.mean() < 0.03 and diff.quantile(0.999) < 0.3, (diff.mean(), diff.max())
    val_batch, _, _ = dm.val_set.collate([dm.val_set[i] for i in range(len(dm.val_set))])
    a, _, _ = gpu_decode.decode_batch(val_batch, "cuda")
    b, _, _ = gpu_decode.decode_batch(val_batch, "cpu")
    assert (a.cpu() - b).abs().mean() < 0.03
