"""Deploy export: checkpoint -> re-parameterized model.safetensors + config.json (+ model.onnx), and load it back.

Its command line is `python -m lkcnn.export CHECKPOINT OUT_DIR` (console script `lkcnn-export`). The export is
verified before anything is written: the deployed net must match the original on a random batch, and the written
files must load back (`load_deployed`) and give the same outputs. Files are written to a temporary folder beside
OUT_DIR and moved in only when all checks pass, so a failed export leaves OUT_DIR as it was.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from timm.data import resolve_data_config
from torch import nn

import lkcnn
from lkcnn.deploy.checkpoint import Checkpoint, CheckpointError, load_weights, read_checkpoint
from lkcnn.deploy.reparam import reparameterize_model
from lkcnn.errors import UserError, first_line
from lkcnn.models import LkcnnModel, ModelError, build_model, checkpoint_filter_fn
from lkcnn.ops import reference

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
ONNX_FILE = "model.onnx"
FORMAT = "lkcnn-deployed"
DEFAULT_RTOL = 1e-4
CHECK_BATCH = 2  # > 1 so that the ONNX batch dimension stays dynamic
ONNX_STANDARD_DOMAINS = ("", "ai.onnx")
TIMM_DATA_ARGS = ("img_size", "mean", "std", "interpolation", "crop_pct")  # resolve_data_config's argument names


class ExportError(UserError, ValueError):
    """An export that cannot be done or did not verify; the message says why and what to do."""


def _build(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """lkcnn.models.build_model without downloading anything (`pretrained` is dropped); its errors as ExportError."""
    try:
        return build_model(name, **{k: v for k, v in kwargs.items() if k != "pretrained"})
    except ModelError as e:
        raise ExportError(str(e)) from None


def export_checkpoint(
        checkpoint: str | Path,
        out_dir: str | Path,
        model_name: str | None = None,
        overrides: dict[str, Any] | None = None,
        ema: bool = False,
        onnx: bool = False,
        force: bool = False,
        input_size: tuple[int, int] | None = None,
        rtol: float = DEFAULT_RTOL,
) -> dict[str, Any]:
    """Re-parameterize the net in `checkpoint` and write it to `out_dir`; returns the written config.json content.

    The model comes from the spec stored in the checkpoint; `model_name` / `overrides` replace or extend it (and are
    required when the file carries no spec). Raises CheckpointError / ExportError with a clear message.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    _check_out_dir(out_dir, force, checkpoint)
    if onnx and not all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript")):
        raise ExportError("--onnx needs the onnx and onnxscript packages: pip install 'lkcnn[onnx]'.")
    ckpt = read_checkpoint(checkpoint, ema=ema)
    model = _model_for(ckpt, model_name, overrides or {})
    name = model.lkcnn_spec["name"]
    load_weights(model, _filtered(ckpt, model, name), name)
    model.eval()

    data_config = _data_config(model, ckpt, input_size)
    x = torch.randn(CHECK_BATCH, *data_config["input_size"])
    with torch.no_grad():
        expected = model(x)
        reparameterize_model(model)
        deployed = model(x)
    error = _check_close(deployed, expected, rtol, "the re-parameterized model differs from the original")

    config = {
        "format": FORMAT,
        "lkcnn_version": lkcnn.__version__,
        "model": {"name": name, "kwargs": {**model.lkcnn_spec["kwargs"], "deploy": True}},  # the re-load verifies it
        "data_config": {k: list(v) if isinstance(v, tuple) else v for k, v in data_config.items()},
        "weights": {"file": WEIGHTS_FILE, "sha256": ""},
        "source": {"checkpoint": checkpoint.name, "kind": ckpt.kind, "ema": ema},
        "equivalence": {"relative_error": error, "tolerance": rtol},
    }
    tmp = staging_dir(out_dir)
    try:
        safetensors.torch.save_model(model, str(tmp / WEIGHTS_FILE))
        config["weights"]["sha256"] = _sha256(tmp / WEIGHTS_FILE)
        if onnx:
            config["onnx"] = _write_onnx(model, x, deployed, tmp / ONNX_FILE, rtol)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        # safetensors writes 0600; give the weights the mode the umask gave config.json
        (tmp / WEIGHTS_FILE).chmod((tmp / CONFIG_FILE).stat().st_mode)
        with torch.no_grad():
            _check_close(load_deployed(tmp)(x), deployed, rtol, f"the model re-loaded from {out_dir} differs")
        move_into(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return config


def load_deployed(out_dir: str | Path) -> nn.Module:
    """The deployed model written by `export_checkpoint`, in eval mode; the weights file's sha256 is verified."""
    out_dir = Path(out_dir)
    config_path, weights_path = out_dir / CONFIG_FILE, out_dir / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"{out_dir} is not an lkcnn export: it needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                                "create it with `python -m lkcnn.export CHECKPOINT OUT_DIR`.")
    try:
        config = json.loads(config_path.read_text())
        spec, sha256 = config["model"], config["weights"]["sha256"]
        name, kwargs = spec["name"], dict(spec["kwargs"], deploy=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{config_path} is not a valid lkcnn export config ({type(e).__name__}: {e}); "
                         "export the checkpoint again.") from None
    actual = _sha256(weights_path)
    if actual != sha256:
        raise ValueError(f"{weights_path} does not match the sha256 recorded in {config_path} ({actual} != "
                         f"{sha256}): the file was modified or damaged. Export the checkpoint again.")
    if "quantization" in config:  # an 8-bit export: the fake-quant model
        from lkcnn.deploy.quantized_export import load_quantized
        return load_quantized(out_dir, config)
    model = _build(name, kwargs)
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(weights_path), strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{weights_path} does not fit model '{name}' {kwargs} from {config_path}: "
                         f"{str(e).splitlines()[-1].strip()}. Export the checkpoint again.") from None
    if missing or unexpected:
        raise ValueError(f"{weights_path} does not fit model '{name}' {kwargs} from {config_path}: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}. Export the checkpoint again.")
    return model.eval()


def _check_out_dir(out_dir: Path, force: bool, checkpoint: Path) -> None:
    """Refuse a non-empty OUT_DIR without --force, and never overwrite the input checkpoint."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"output {out_dir} exists and is not a folder; choose another OUT_DIR.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"output folder {out_dir} is not empty; choose another OUT_DIR or pass --force to "
                              f"replace the export files there ({CONFIG_FILE}, {WEIGHTS_FILE}, {ONNX_FILE}).")
    if checkpoint.resolve() in {(out_dir / f).resolve() for f in (CONFIG_FILE, WEIGHTS_FILE, ONNX_FILE)}:
        raise FileExistsError(f"the export would overwrite its own input {checkpoint}; choose another OUT_DIR.")


def _model_for(ckpt: Checkpoint, model_name: str | None, overrides: dict[str, Any]) -> nn.Module:
    """Build the training-form model described by the checkpoint's spec, `--model` and `--set`."""
    if model_name is None and ckpt.spec is None:
        raise ExportError(f"checkpoint {ckpt.path} stores no model config ({ckpt.kind}); pass --model NAME, and "
                          "--set key=value for arguments that differ from the defaults (e.g. --set num_classes=10).")
    spec = ckpt.spec or {"name": model_name, "kwargs": {}}
    name = model_name or spec["name"]
    kwargs = {**(spec["kwargs"] if name == spec["name"] else {}), **overrides}
    model = _build(name, kwargs)
    if not isinstance(model, LkcnnModel):
        raise ExportError(f"model '{name}' is not an lkcnn model; export supports lkcnn's registered models.")
    return model


def _filtered(ckpt: Checkpoint, model: nn.Module, name: str) -> Checkpoint:
    """Map foreign key layouts (e.g. official ConvNeXt) onto the model's keys with the models' own filter."""
    try:
        state_dict = checkpoint_filter_fn(ckpt.state_dict, model)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt.path} does not fit model '{name}': {e} Was it made for another "
                              "model? Pass --model NAME and --set key=value to match it.") from None
    return dataclasses.replace(ckpt, state_dict=state_dict)


def _data_config(model: nn.Module, ckpt: Checkpoint, input_size: tuple[int, int] | None) -> dict[str, Any]:
    """timm's data config (input size, mean/std, interpolation, crop) for the deployed model.

    The training run's settings (`data.img_size` and `data.transform.*` of the stored Hydra config, named as timm's
    resolve_data_config arguments) win over the model's pretrained_cfg; `--input-size` wins over both.
    """
    data = (ckpt.hydra_config or {}).get("data")
    data = data if isinstance(data, dict) else {}
    settings = {**data, **(data.get("transform") if isinstance(data.get("transform"), dict) else {})}
    args = {k: settings[k] for k in TIMM_DATA_ARGS if settings.get(k) is not None}  # img_size: an int (the app's)
    config = resolve_data_config(args, model=model)
    size = tuple(input_size) if input_size else config["input_size"][1:]
    config["input_size"] = (getattr(model, "in_chans", 3), *size)
    return config


def _check_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> float:
    """Relative L2 error of `actual` vs `expected`; raises ExportError (nothing written) above `rtol`."""
    error = (torch.linalg.vector_norm((actual - expected).double())
             / torch.linalg.vector_norm(expected.double()).clamp_min(1e-12)).item()
    if not error <= rtol:  # also catches NaN
        raise ExportError(f"{what}: relative error {error:.3e} > tolerance {rtol:.1e}. Nothing was written. "
                          "This is a re-parameterization bug (please report it with the model name and config), or "
                          "pass a larger --rtol if the checkpoint's weights are extreme.")
    return error


def write_onnx_graph(model: nn.Module, x: torch.Tensor, path: Path, what: str = "ONNX",
                     decompositions: dict | None = None, **export_kwargs) -> tuple[int, list, list[str]]:
    """Write `model` to `path` as ONNX through torch.export, batch dynamic, lkcnn's large-kernel conv op as a standard
    Conv node (plus `decompositions`; `export_kwargs` go to torch.onnx.export); returns the written graph's opset, its
    nodes (functions' included) and its custom ops. A failed export is an ExportError (`what` names it)."""
    import onnx  # optional dependency (lkcnn[onnx]), checked by the exporters

    # lkcnn's registered conv op has no ONNX translation: decompose it into its own PyTorch path (F.conv2d), which
    # exports as a standard Conv node.
    table = torch.export.default_decompositions()
    table[torch.ops.lkcnn.dwconv2d_fwd.default] = reference.forward
    table.update(decompositions or {})
    try:
        program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        torch.onnx.export(program.run_decompositions(table), (x,), str(path), input_names=["input"],
                          output_names=["logits"], verbose=False,
                          external_data=_nbytes(model) > 2**31 - 2**27, **export_kwargs)  # protobuf's 2 GiB limit
    except Exception as e:  # torch.export / onnxscript raise many types; report one line, keep the cause
        raise ExportError(f"{what} export failed ({type(e).__name__}: {first_line(e)}). "
                          "Nothing was written; export without --onnx and report the error.") from e
    graph = onnx.load(str(path), load_external_data=False)
    nodes = list(graph.graph.node) + [n for f in graph.functions for n in f.node]
    custom = sorted({f"{n.domain}::{n.op_type}" for n in nodes if n.domain not in ONNX_STANDARD_DOMAINS})
    return max(o.version for o in graph.opset_import if o.domain in ONNX_STANDARD_DOMAINS), nodes, custom


def _write_onnx(model: nn.Module, x: torch.Tensor, expected: torch.Tensor, path: Path, rtol: float) -> dict[str, Any]:
    """Export ONNX with the large-kernel conv as a standard Conv node; compare with onnxruntime when installed."""
    opset, nodes, custom = write_onnx_graph(model, x, path)
    if custom or not any(n.op_type == "Conv" for n in nodes):
        raise ExportError(f"the ONNX graph has custom ops {custom} or no Conv node; the large-kernel conv must export "
                          "as a standard Conv (has lkcnn's conv op changed?). "
                          "Nothing was written; export without --onnx.")
    result: dict[str, Any] = {"file": ONNX_FILE, "opset": opset}
    try:
        import onnxruntime
    except ImportError:  # optional: the graph check above still ran
        return result
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"input": x.numpy()})
    result["onnxruntime_relative_error"] = _check_close(torch.from_numpy(out), expected, rtol,
                                                        "onnxruntime's output differs from the deployed model")
    return result


def _nbytes(model: nn.Module) -> int:
    """Size of the model's weights in bytes."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def staging_dir(out_dir: Path) -> Path:
    """A new hidden folder beside `out_dir` (same file system: the files move in by rename) for an export's files
    until they are verified."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
    except OSError as e:
        raise ExportError(f"cannot write in {out_dir.parent} ({e.strerror or e}): choose an OUT_DIR in a writable "
                          "folder.") from None


def move_into(tmp: Path, out_dir: Path) -> None:
    """Move the verified files from `tmp` into `out_dir`, all or none: the files of an earlier export there (a stale
    model.onnx included) are set aside in `tmp` first and put back if any move fails. Other files are not touched."""
    written = [p.name for p in tmp.iterdir()]
    files = (CONFIG_FILE, WEIGHTS_FILE, ONNX_FILE, f"{ONNX_FILE}.data")
    earlier = [name for name in files if (out_dir / name).exists()]
    aside, moved = tmp / ".earlier", []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        aside.mkdir()
        for name in earlier:
            os.replace(out_dir / name, aside / name)
        for name in written:
            os.replace(tmp / name, out_dir / name)
            moved.append(name)
    except OSError as e:
        for name in moved:
            os.replace(out_dir / name, tmp / name)
        for name in earlier:
            if (aside / name).exists():
                os.replace(aside / name, out_dir / name)
        raise ExportError(f"could not write the export into {out_dir} ({e.strerror or e}); it is left as it was: "
                          "make the folder writable or choose another OUT_DIR.") from None

