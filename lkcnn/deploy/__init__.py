"""lkcnn.deploy: from a trained checkpoint to deployable weights.

`checkpoint` reads checkpoint files safely, `reparam` merges the re-parameterizable branches (and folds BatchNorm)
into single kernels, `export` verifies and writes the deployed model (safetensors + config.json, ONNX) and loads it
back (`lkcnn.load_deployed`).
"""
