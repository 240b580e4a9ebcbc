"""gptpar: a small, readable Megatron-style 3D-parallel GPT training library."""
from setuptools import find_packages, setup

setup(
    name="gptpar",
    version="0.1.0",
    description="Tensor, pipeline and data parallel GPT training on PyTorch + DeepSpeed, runnable on CPU/gloo",
    packages=find_packages(include=["gptpar", "gptpar.*"]),
    python_requires=">=3.10",
    # torch is pinned exactly: a looser range lets pip pull a multi-GB CUDA build in place of the CPU wheel.
    install_requires=[
        "torch==2.13.0",
        "deepspeed==0.19.8",
        "sentencepiece",
        "numpy",
        "tensorboard",
        "tqdm",
    ],
    extras_require={
        # transformers is the reference model in tests and benchmarks; pinned so comparisons stay reproducible.
        "dev": ["pytest", "transformers==5.23.0"],
    },
)
