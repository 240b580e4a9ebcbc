"""pretrain_gpt.py with DeepSpeed's CPU accelerator told to accept fp16 (gptpar.training.engine.allow_fp16_on_cpu).

For `bench/gpu_trainer.py --cpu-smoke` only: it checks the fp16 step's flow on a CPU whose oneDNN has no fp16
kernels (emulated, slow; tiny shapes). Real fp16 runs use pretrain_gpt.py on a GPU.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

if __name__ == "__main__":
    from gptpar.training.engine import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    import pretrain_gpt

    sys.exit(pretrain_gpt.main())
