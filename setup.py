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
        # Optional features, imported only where their option is used (the trainer and tools run without them):
        # training.optimizer=adamw8bit (bitsandbytes' 8-bit AdamW, CUDA and CPU), training.precision=fp8
        # (torchao's float8 training, pinned: gptpar calls one of its internals, gptpar/tensor_parallel/float8.py)
        # and tools/plot_metrics.py.
        "8bit": ["bitsandbytes==0.50.2"],
        "fp8": ["torchao==0.18.0"],
        "plot": ["matplotlib"],
        # transformers is the reference model in tests and benchmarks; pinned so comparisons stay reproducible.
        # `make test` and `make demo` install this extra, so the 8-bit and fp8 tests run and the demo draws its plot.
        "dev": ["pytest", "transformers==5.23.0", "bitsandbytes==0.50.2", "torchao==0.18.0", "matplotlib"],
    },
)
