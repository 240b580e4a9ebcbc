"""Estimates before any GPU is touched: pure formulas and the search that uses them.

    flops.py     parameter counts and FLOPs per iteration (the trainer's log line calls tflops_per_gpu)
    memory.py    memory per GPU and pipeline stage (weights, gradients, optimizer, activations, context)
    settings.py  the trainer's Config flattened for the formulas (settings_of) and the one memory call
    planner.py   the time model, GPU kinds (the A100 fit, calibrations), days and GPU-hours, and the
                 (tp, pp, dp, micro batch) search of tools/plan_topology.py
    report.py    the text `pretrain_gpt.py --dry-run` prints: the plan first, then the details
    calibrations/  measured seconds per layer of GPU kinds (`--calibration h100`), each saying its source

Imports run one way: flops <- memory <- settings <- planner <- report. The command-line helpers live in tools/.
"""
