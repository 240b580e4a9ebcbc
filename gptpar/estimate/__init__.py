"""Estimates before any GPU is touched: pure formulas and the search that uses them.

    flops.py     parameter counts and FLOPs per iteration (the trainer's log line calls tflops_per_gpu)
    memory.py    memory per GPU and pipeline stage (weights, gradients, optimizer, activations, context)
    settings.py  the trainer's Config flattened for the formulas (settings_of) and the one memory call
    kinds.py     GPU kinds (`--gpu`, their facts in calibrations/kinds/) and what-ifs (`--assume`)
    planner.py   the time model, GPU kinds' Hardware, calibrations, days and GPU-hours, and the
                 (tp, pp, dp, micro batch) search of tools/plan_topology.py
    validation.py  the time model against published measured runs (published_runs.json): the error band
    report.py    the text `pretrain_gpt.py --dry-run` prints: the plan first, then the details (or its JSON)
    calibrations/  the GPU kinds' facts with their sources (kinds/) and measured seconds per layer (`--calibration
                 h100`), each saying its source

Imports run one way: flops <- memory <- settings <- kinds <- planner <- validation <- report. The command-line
helpers live in tools/.
"""
