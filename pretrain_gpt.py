"""Pretrain a GPT with tensor x pipeline x data parallelism (the main is gptpar.training.pretrain.main).

    deepspeed --num_gpus 2 pretrain_gpt.py --config configs/cpu_dp2.json     # 2 ranks (gloo on CPU)
    torchrun --nproc_per_node 2 pretrain_gpt.py --config configs/cpu_pp2.json
    python pretrain_gpt.py --config configs/cpu_tiny.json --set training.train_iters=5   # one rank
    python pretrain_gpt.py --config configs/200b.json --dry-run   # the plan only: no process group, no weights
    python pretrain_gpt.py --config configs/200b.json --dry-run --sec-per-iter 150   # priced at a measured time
    python pretrain_gpt.py --help   # the options; every config field is in docs/config.md

Exit codes: 0 done, 2 refused before anything changed, 1 the run's own failure (gptpar.training.pretrain says which).
"""

from gptpar.training.pretrain import exit_now, main

if __name__ == "__main__":
    exit_now(main())
