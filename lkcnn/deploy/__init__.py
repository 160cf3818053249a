"""lkcnn.deploy: from a trained checkpoint to deployable weights.

`checkpoint` reads checkpoint files safely, `reparam` merges the re-parameterizable branches (and folds BatchNorm)
into single kernels, `export` verifies and writes the deployed model (safetensors + config.json, ONNX) and loads it
back (`lkcnn.load_deployed`); `quantize` calibrates and quantizes a deployed model to INT8 / FP8,
`quantized_export` writes it, and `gemm8` runs its GEMMs in 8 bits on a GPU with their neighbours in the epilogue.
"""
