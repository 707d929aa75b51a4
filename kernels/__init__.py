"""The CUDA sources of the GPU backend, installed as the package data of deggs.kernels
(pyproject.toml maps this folder there); read through importlib.resources
(deggs.numerics.gpu.compile.source). kernels/README.md is the kernel developer's guide."""
