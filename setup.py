"""gptpar: a small, readable Megatron-style 3D-parallel GPT training library."""
from setuptools import find_packages, setup

setup(
    name="gptpar",
    version="0.1.0",
    description="Tensor, pipeline and data parallel GPT training on PyTorch + DeepSpeed, runnable on CPU/gloo",
    packages=find_packages(include=["gptpar", "gptpar.*"]),
    # the planner's shipped GPU calibrations (--calibration h100)
    package_data={"gptpar.estimate": ["calibrations/*.json", "calibrations/kinds/*.json", "published_runs.json"]},
    python_requires=">=3.10",
    install_requires=[
        # The range gptpar supports (the GPU image runs 2.11, CI 2.13), so that installing gptpar where a torch
        # is already installed (a CUDA build on every GPU cluster) keeps that torch. The exact CPU pin lives
        # where the CPU build is wanted: the Makefile's venv (and CI through it) installs torch==2.13.0 first.
        # tests/integration/test_packaging.py checks that pip leaves an installed torch 2.11 alone.
        "torch>=2.11",
        # Pinned: gptpar.training.engine relies on DeepSpeed 0.19.8's internals (its docstring lists each one
        # beside the test that breaks when it changes), so another version may fail in ways no range promises.
        "deepspeed==0.19.8",
        "sentencepiece",
        "numpy",
        "tensorboard",
        "tqdm",
    ],
    extras_require={
        # Optional features, imported only where their option is used (the trainer and tools run without them):
        # training.optimizer=adamw8bit (bitsandbytes' 8-bit AdamW, CUDA and CPU), training.precision=fp8
        # (torchao's float8 training, pinned: gptpar calls one of its internals, gptpar/tensor_parallel/float8.py),
        # tools/plot_metrics.py and tools/eval_harness.py.
        "8bit": ["bitsandbytes==0.50.2"],
        "fp8": ["torchao==0.18.0"],
        "plot": ["matplotlib"],
        # tools/eval_harness.py: EleutherAI's lm-evaluation-harness (accelerate: its Hugging Face model, the
        # reference in tests, imports it).
        "eval": ["lm-eval==0.4.13", "accelerate"],
        # transformers is the reference model in tests and benchmarks; pinned so comparisons stay reproducible.
        # `make test` and `make demo` install this extra, so the 8-bit, fp8 and evaluation tests run and the demo
        # draws its plot and evaluates its model.
        # pytest-xdist: `make test` runs two workers (see the Makefile).
        "dev": ["pytest", "pytest-xdist==3.8.0", "transformers==5.23.0", "bitsandbytes==0.50.2", "torchao==0.18.0",
                "matplotlib", "lm-eval==0.4.13", "accelerate"],
    },
)
