"""8-bit export: checkpoint -> deployed float model -> calibrated INT8 / FP8 model -> model.safetensors (8-bit weights
and scales) + config.json (+ model.onnx with QuantizeLinear / DequantizeLinear nodes), and load it back.

`python -m lkcnn.export CKPT OUT --precision int8|fp8 --calibrate data=<config>`. The float deployed model comes from
the float exporter (`export_checkpoint`, into a temporary folder), so every check of a float export runs first. The
8-bit model must agree with the float one on the top-1 class of at least `min_agreement` of the calibration images,
else nothing is written; the written files must load back (`lkcnn.load_deployed`) and give the same outputs, and the
ONNX graph must give them in onnxruntime.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from lkcnn.deploy import export
from lkcnn.deploy.export import CONFIG_FILE, ONNX_FILE, WEIGHTS_FILE, ExportError
from lkcnn.deploy.quantize import (
    DEFAULT_PERCENTILE,
    FORMATS,
    OBSERVERS,
    QuantizeError,
    prepare_quantized,
    quantize,
    top1_agreement,
)

PRECISIONS = ("fp32", *FORMATS)
DEFAULT_OBSERVER = "mse"
DEFAULT_CALIB_BATCHES = 16
DEFAULT_MIN_AGREEMENT = 0.99
DEFAULT_OPSET = 19  # the first opset with float8 QuantizeLinear / DequantizeLinear
# torch.onnx writes opset 18 and newer (it only tries to convert down to older ones); per-channel int8 QDQ exists
# from opset 13, float8 QDQ from 19
MIN_OPSET = {"int8": 18, "fp8": 19}
# onnxruntime against the fake-quant model, on the first calibration batch: the median over its images of each
# image's relative L2 error. With graph optimizations off both compute the same quantized values, and most images agree
# to 1e-6; but where the two engines' float arithmetic (a float layer, a BatchNorm) rounds differently in the last bit,
# an activation can cross a quantization boundary, which moves that image's logits by up to about 5e-2 (the median
# looks past those few images)
ONNX_RTOL = 1e-3
ONNX_FUSED_RTOL = 5e-2  # onnxruntime's default graph optimizations: integer kernels, their own rounding
RELOAD_RTOL = 1e-6  # the re-loaded model computes with the very same tensors


def check_onnx_opset(precision: str, opset: int) -> None:
    """Refuse an opset whose QuantizeLinear / DequantizeLinear cannot carry `precision` (or torch cannot write)."""
    if opset < MIN_OPSET[precision]:
        why = "float8 QuantizeLinear/DequantizeLinear arrived in opset 19" if precision == "fp8" else \
            "torch.onnx writes opset 18 and newer"
        raise ExportError(f"--opset {opset} is too old for {precision} QDQ nodes ({why}): pass --opset "
                          f"{MIN_OPSET[precision]} or newer. Nothing was written.")


def check_calibration_size(batches: Sequence[Tensor], input_size: Sequence[int], source: str) -> None:
    """Refuse calibration images of another size than the export's input size (config.json's): the activation ranges
    would be those of another resolution, and model.onnx, traced on a calibration batch with only its batch dimension
    dynamic, would take the calibration size only. The number of classes of the calibration data is no concern: its
    labels are not used (the agreement check compares the 8-bit model with the float one)."""
    expected = tuple(input_size)
    other = next((tuple(x.shape[-2:]) for x in batches if tuple(x.shape[-2:]) != expected), None)
    if other is not None:
        (h, w), (height, width) = other, expected
        at_it = f"leave data.img_size out of --calibrate (the export's {height} is the default), or " \
            if height == width else ""
        raise ExportError(f"{f'--calibrate {source}' if source else 'the calibration data'} gives {h}x{w} images but "
                          f"the export's input size is {height}x{width} (--input-size, else the training run's "
                          f"data.img_size, else the model's pretrained_cfg): {at_it}export at {h}x{w} with "
                          f"--input-size {h} {w}. Nothing was written.")


def deployed_from_checkpoint(checkpoint: str | Path, model_name: str | None = None,
                             overrides: dict[str, Any] | None = None, ema: bool = False,
                             input_size: tuple[int, int] | None = None,
                             rtol: float = export.DEFAULT_RTOL) -> tuple[nn.Module, dict[str, Any]]:
    """(the deployed float model, its config.json) through the float exporter in a temporary folder, so that the
    checkpoint is read, re-parameterized and verified exactly as `python -m lkcnn.export` does it."""
    with tempfile.TemporaryDirectory(prefix="lkcnn-deploy-") as tmp:
        config = export.export_checkpoint(checkpoint, Path(tmp) / "float", model_name, overrides, ema=ema,
                                          input_size=input_size, rtol=rtol)
        return export.load_deployed(Path(tmp) / "float"), config


def export_quantized(
        checkpoint: str | Path,
        out_dir: str | Path,
        precision: str,
        calibration: Iterable[Tensor] | Callable[[], Iterable[Tensor]],
        calibration_source: str = "",
        observer: str = DEFAULT_OBSERVER,
        percentile: float = DEFAULT_PERCENTILE,
        min_agreement: float = DEFAULT_MIN_AGREEMENT,
        onnx: bool = False,
        opset: int = DEFAULT_OPSET,
        model_name: str | None = None,
        overrides: dict[str, Any] | None = None,
        ema: bool = False,
        force: bool = False,
        input_size: tuple[int, int] | None = None,
        rtol: float = export.DEFAULT_RTOL,
        keep_float: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Export the checkpoint's net in 8 bits (`precision` "int8" or "fp8") to `out_dir`; returns config.json's content.

    `calibration` yields input batches (transformed like validation images, at the export's input size), or is a
    function of the export's data config (config.json's `data_config`: timm's input size, mean/std, interpolation,
    crop) returning them, called once the float model has passed its checks; `calibration_source` says where they
    came from (config.json records it).
    `keep_float`: module names whose layers stay in float (None: the stem and the classifier; see
    `lkcnn.deploy.quantize.default_float_layers`).
    Raises ExportError / QuantizeError / CheckpointError with a one-line message; nothing is written then.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if precision not in FORMATS:
        raise ExportError(f"--precision {precision} is not an 8-bit format; choose one of {', '.join(FORMATS)}.")
    if observer not in OBSERVERS:
        raise ExportError(f"--observer {observer} is unknown; choose one of {', '.join(OBSERVERS)}.")
    if not 0 <= min_agreement <= 1:
        raise ExportError(f"--min-agreement {min_agreement} must be a share between 0 and 1, e.g. 0.99.")
    export._check_out_dir(out_dir, force, checkpoint)
    if onnx:
        check_onnx_opset(precision, opset)
        if not all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript")):
            raise ExportError("--onnx needs the onnx and onnxscript packages: pip install 'lkcnn[onnx]'.")
        if precision == "fp8" and not importlib.util.find_spec("onnxruntime"):
            raise ExportError("FP8 ONNX is not written: it is only written once onnxruntime has run it, and "
                              "onnxruntime is not installed (pip install 'lkcnn[onnx]'), or drop --onnx.")
    float_model, float_config = deployed_from_checkpoint(checkpoint, model_name, overrides, ema, input_size, rtol)
    batches = list(calibration(float_config["data_config"]) if callable(calibration) else calibration)
    if not batches or not sum(len(x) for x in batches):
        raise ExportError(f"no calibration images{f' in {calibration_source}' if calibration_source else ''}; "
                          "pass a data config with training images, e.g. --calibrate data=digits.")
    check_calibration_size(batches, float_config["data_config"]["input_size"][1:], calibration_source)
    quantized = quantize(float_model, batches, precision, observer, percentile, keep_float)
    agreement, images = top1_agreement(float_model, quantized, batches)
    if agreement < min_agreement:
        raise ExportError(f"the {precision} model agrees with the float model on the top-1 class of only "
                          f"{agreement:.2%} of the {images} calibration images (--min-agreement {min_agreement:g}); "
                          "nothing was written. Try another --observer (minmax, percentile, mse), more "
                          "--calib-batches, more layers in float (--keep-float), or a lower --min-agreement.")
    info = quantized.lkcnn_quantization
    config = {
        **{k: v for k, v in float_config.items() if k not in ("weights", "onnx")},
        "weights": {"file": WEIGHTS_FILE, "sha256": ""},
        "quantization": {
            "precision": precision,
            "weights": "per output channel, symmetric, max |w|",
            "activations": f"per tensor, symmetric, at the input of every 8-bit layer; observer {observer}",
            **{k: info[k] for k in ("observer", "percentile") if k in info},
            "calibration": {"data": calibration_source, "batches": len(batches), "images": images},
            "top1_agreement": agreement, "min_agreement": min_agreement,
            "layers": info["layers"],
            "float_layers": info["float_layers"],
        },
    }
    x = batches[0][:export.CHECK_BATCH].to(next(float_model.parameters()).device)
    with torch.no_grad():
        expected = quantized(x)
    tmp = export.staging_dir(out_dir)
    try:
        state = {k: v.detach().contiguous().cpu() for k, v in quantized.state_dict().items()}
        safetensors.torch.save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        config["weights"]["sha256"] = export._sha256(tmp / WEIGHTS_FILE)
        if onnx:
            images = batches[0].to(x.device)
            with torch.no_grad():
                config["onnx"] = _write_onnx(quantized, images, quantized(images), tmp / ONNX_FILE, opset, precision)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / WEIGHTS_FILE).chmod((tmp / CONFIG_FILE).stat().st_mode)  # safetensors writes 0600
        with torch.no_grad():
            export._check_close(export.load_deployed(tmp).to(x.device)(x), expected, RELOAD_RTOL,
                                f"the {precision} model re-loaded from {out_dir} differs")
        export.move_into(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return config


def load_quantized(out_dir: Path, config: dict[str, Any]) -> nn.Module:
    """The 8-bit (fake-quant) model of an export whose config.json has a `quantization` section; `load_deployed`
    calls this after verifying the weights' sha256."""
    from lkcnn.models import ModelError, build_model

    weights_path = out_dir / WEIGHTS_FILE
    try:
        spec, quant = config["model"], config["quantization"]
        precision, layers = quant["precision"], list(quant["layers"])
        model = build_model(spec["name"], **dict(spec["kwargs"], deploy=True))
        prepare_quantized(model, precision, layers)
    except (KeyError, TypeError, AttributeError, ModelError, QuantizeError) as e:
        raise ValueError(f"{out_dir / CONFIG_FILE} is not a valid 8-bit lkcnn export config ({type(e).__name__}: "
                         f"{e}); export the checkpoint again.") from None
    try:
        model.load_state_dict(safetensors.torch.load_file(str(weights_path)), strict=True)
        model.lkcnn_quantization = {k: quant[k] for k in ("precision", "observer", "layers") if k in quant}
    except RuntimeError as e:
        raise ValueError(f"{weights_path} does not fit the {precision} model '{spec['name']}' described by "
                         f"{out_dir / CONFIG_FILE}: {str(e).splitlines()[0]}. Export the checkpoint again.") from None
    return model.eval()


def _write_onnx(model: nn.Module, x: Tensor, expected: Tensor, path: Path, opset: int,
                precision: str) -> dict[str, Any]:
    """ONNX with one QuantizeLinear/DequantizeLinear pair per layer input and a DequantizeLinear per 8-bit weight;
    compared with the fake-quant model in onnxruntime (required for FP8, whose ONNX is written only if it runs)."""
    from lkcnn.ops.qdq import onnx_translations

    x = x.cpu()
    model = model.cpu()
    relu = {torch.ops.aten.relu.default: _relu_as_max} if precision == "fp8" else None
    written, nodes, custom = export.write_onnx_graph(model, x, path, f"{precision} ONNX", relu, opset_version=opset,
                                                     custom_translation_table=onnx_translations(opset))
    if written != opset:
        raise ExportError(f"torch.onnx wrote opset {written} instead of --opset {opset}; pass --opset {written}. "
                          "Nothing was written.")
    layers = len(model.lkcnn_quantization["layers"])
    counts = {op: sum(n.op_type == op for n in nodes) for op in ("QuantizeLinear", "DequantizeLinear")}
    if custom or counts != {"QuantizeLinear": layers, "DequantizeLinear": 2 * layers}:
        raise ExportError(f"the {precision} ONNX graph has custom ops {custom} or {counts} Q/DQ nodes for {layers} "
                          "quantized layers (expected one Q and two DQ each). Nothing was written; export without "
                          "--onnx and report this.")
    result: dict[str, Any] = {"file": ONNX_FILE, "opset": opset, "quantize_linear_nodes": layers}
    try:
        import onnxruntime
    except ImportError:  # optional for INT8 (export_quantized requires it for FP8): the graph check above still ran
        return result
    what = "FP8 ONNX is not written" if precision == "fp8" else "the INT8 ONNX graph is not written"
    # graph optimizations off, onnxruntime runs the QDQ graph as written: the fake-quant model's arithmetic (ONNX_RTOL).
    # Its default optimizations fuse Q/DQ into integer kernels, whose requantization rounds differently
    # (ONNX_FUSED_RTOL); a deployment runs those, so they must compute the same network too.
    errors = {}
    for level, tolerance in (("ORT_DISABLE_ALL", ONNX_RTOL), ("ORT_ENABLE_ALL", ONNX_FUSED_RTOL)):
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = getattr(onnxruntime.GraphOptimizationLevel, level)
        try:
            session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            (out,) = session.run(None, {"input": x.numpy()})
        except Exception as e:  # onnxruntime's errors are its own types; one line says which node failed
            raise ExportError(f"{what}: onnxruntime {onnxruntime.__version__} cannot run it ({level}: "
                              f"{str(e).strip().splitlines()[0][:200]}); drop --onnx (the safetensors export "
                              "works without it). Nothing was written.") from None
        error = median_image_error(torch.from_numpy(out), expected.cpu())
        if not error <= tolerance:
            raise ExportError(f"{what}: onnxruntime {onnxruntime.__version__} ({level}) computes it with a median "
                              f"relative error of {error:.2e} > {tolerance:.0e} against the {precision} model; drop "
                              "--onnx (the safetensors export works without it). Nothing was written.")
        errors[level] = error
    result["onnxruntime_relative_error"] = errors["ORT_DISABLE_ALL"]
    result["onnxruntime_optimized_relative_error"] = errors["ORT_ENABLE_ALL"]
    return result


def _relu_as_max(x: Tensor) -> Tensor:
    """ReLU as Max(x, 0) in FP8 ONNX graphs. onnxruntime's ReluQuantRewrite (qdq_transformer/relu_quantizelinear.cc,
    on at its default optimization level) deletes a Relu whose only consumer is a QuantizeLinear, trusting the
    quantization to clip at the zero point: true for uint8 (zero point 0) and int8 (zero point -128), which it checks,
    but it does not check float8, whose symmetric range keeps negatives, so the optimized graph computes another
    network (microsoft/onnxruntime#20187 fixed the rule for 16-bit types). No rule removes Max, the same function."""
    return torch.maximum(x, x.new_zeros(()))


def median_image_error(actual: Tensor, expected: Tensor) -> float:
    """The median over the batch of each image's relative L2 error (NaN-safe: a NaN makes the median NaN, which
    compares false against any tolerance)."""
    dims = tuple(range(1, expected.dim()))
    errors = (torch.linalg.vector_norm((actual - expected).double(), dim=dims)
              / torch.linalg.vector_norm(expected.double(), dim=dims).clamp_min(1e-12))
    return errors.median().item()
