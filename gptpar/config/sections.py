"""The run config's sections besides `model` (gptpar.model.config.GPTConfig): `parallel`, `training`, `data`,
`checkpoint`, `logging`, each a dataclass whose fields carry their documentation (docs/config.md is generated from
it by tools/gen_config_docs.py) and whose `__post_init__` checks what one section alone can check."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from gptpar.config.errors import ConfigError
from gptpar.config.fields import check_fields as _check_fields
from gptpar.config.fields import check_positive as _positive
from gptpar.config.fields import doc_field as _f
from gptpar.model.config import RECOMPUTE_MODES, GPTConfig, recompute_mode
from gptpar.schedules import LearningRateSchedule, SkipRanges

OPTIMIZERS = ("adamw", "adamw8bit")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name names


def deepspeed_precision(precision: str) -> str:
    """What DeepSpeed runs for `training.precision`, and so the optimizer files its checkpoints hold: fp8 is bf16
    to DeepSpeed (bf16 weights, BF16_Optimizer's fp32 accumulation and master weights; the float8 casts happen inside
    gptpar's tensor-parallel layers, gptpar.tensor_parallel.float8), so an fp8 checkpoint is a bf16 one and resumes
    in either precision. The one home of that mapping (the generated DeepSpeed config, the universal converter, the
    memory and checkpoint-size estimates read it)."""
    if precision not in PRECISIONS:
        raise ValueError(f"training.precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return "bf16" if precision == "fp8" else precision


def parse_range(spec: Optional[str]) -> Optional[Tuple[int, int]]:
    """logging.profile's "START-END" (1-based iterations, both included) -> (START, END); None -> None; ValueError
    naming the fix."""
    if spec is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(spec))
    if m is None or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"logging.profile {spec!r} must be \"START-END\", two iteration numbers with "
                         "1 <= START <= END, e.g. \"5-6\" (both included; iteration 1 compiles under "
                         "training.compile, so start after it)")
    return int(m.group(1)), int(m.group(2))


@dataclass
class ParallelConfig:
    """How the ranks are split: tensor x pipeline x data parallel, DeepSpeed's (pipe, data, model) grid."""

    tensor_model_parallel_size: int = _f(1, "Tensor-parallel ranks (Megatron column/row split); must divide "
                                            "the heads, hidden and FFN sizes.")
    pipeline_model_parallel_size: int = _f(1, "Pipeline stages; every stage must hold at least one "
                                              "transformer layer.")
    data_parallel_size: Optional[int] = _f(None, "Data-parallel replicas. When given, the launched world size "
                                                 "must equal tp x pp x dp exactly (the config names the world "
                                                 "it expects); null = whatever the world size leaves.")
    partition_method: str = _f("auto", "How layers are split across pipeline stages: `balanced` counts each "
                                       "embedding as a layer, `transformer` counts transformer layers only, `auto` "
                                       "picks balanced where it divides, else transformer.",
                               choices=("auto", "balanced", "transformer"))
    embedding_weight: Optional[int] = _f(None, "With `balanced` partitioning, how many transformer layers "
                                               "each embedding counts as (relieves the first and last stages "
                                               "of a large vocab); null = 1. Needs (num_layers + 2 x weight) "
                                               "% pp == 0.")
    sequence_parallel: bool = _f(False, "Megatron sequence parallelism inside tensor-parallel regions "
                                        "(needs seq_length % tp == 0).")
    distributed_timeout_minutes: float = _f(30.0, "Process-group timeout: a stalled (or stopped) rank ends the run "
                                                  "with one line naming this field after this long instead of "
                                                  "hanging.")

    def __post_init__(self):
        _check_fields("parallel", self)
        _positive("parallel", self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "distributed_timeout_minutes")
        _positive("parallel", self, "data_parallel_size", "embedding_weight", allow_none=True)
        if self.embedding_weight is not None and self.partition_method == "transformer":
            raise ConfigError("parallel.embedding_weight only applies to partition_method `balanced` or "
                              "`auto`: remove it or change parallel.partition_method")


@dataclass
class TrainingConfig:
    """Batch sizes, duration, optimizer, LR schedule, precision and exit conditions."""

    micro_batch_size: int = _f(1, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: int = _f(8, "Samples per iteration over all data-parallel ranks = micro_batch_size x "
                                   "micro-batches x dp (the final size when ramping up).")
    train_iters: Optional[int] = _f(None, "Iterations to train (set this or train_samples, not both).")
    train_samples: Optional[int] = _f(None, "Samples to train (set this or train_iters); needed by ramp-up.")
    lr: float = _f(1.0e-4, "Peak learning rate, reached at the end of warmup.")
    min_lr: float = _f(0.0, "Learning rate at the end of decay and after it.")
    lr_warmup_iters: int = _f(0, "Linear warmup from 0 to lr, in iterations (iteration-based training).")
    lr_warmup_samples: int = _f(0, "Linear warmup from 0 to lr, in samples (sample-based training).")
    lr_decay_iters: Optional[int] = _f(None, "Iteration where decay reaches min_lr; null = train_iters.")
    lr_decay_samples: Optional[int] = _f(None, "Sample count where decay reaches min_lr; null = train_samples.")
    lr_decay_style: str = _f("linear", "Decay after warmup: constant, linear or cosine (Megatron's "
                                       "AnnealingLR).", choices=("constant", "linear", "cosine"))
    lr_schedule_on_resume: str = _f(
        "config", "When a resumed checkpoint was saved with another LR schedule: `config` follows this config's and "
                  "says so in one line; `checkpoint` keeps the checkpoint's, so the learning rate continues "
                  "smoothly.", choices=("config", "checkpoint"))
    optimizer: str = _f("adamw", "`adamw`: torch's fused AdamW, fp32 moments (8 bytes of state per parameter); "
                                 "`adamw8bit`: bitsandbytes' 8-bit AdamW, ~2 bytes per parameter (`pip install "
                                 "bitsandbytes`).",
                        choices=OPTIMIZERS)
    weight_decay: float = _f(0.01, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_eps: float = _f(1.0e-8, "AdamW epsilon.")
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    seed: int = _f(1234, "Seed of the model init and of the synthetic data.")
    precision: str = _f("fp32", "Parameter/compute precision. bf16: bf16 weights, fp32 gradient accumulation and "
                                "master weights; fp16: dynamic loss scaling; fp8: bf16 with the transformer GEMMs in "
                                "float8 (torchao). All but fp32 run at ZeRO-1.",
                        choices=PRECISIONS)
    fp8_recipe: str = _f("tensorwise", "precision fp8 only: torchao's scaling recipe. `tensorwise`: one dynamic "
                                       "scale per tensor (per tp shard), e4m3 forward, e5m2 gradients, the fastest; "
                                       "`rowwise`: a power-of-2 scale per row, e4m3 throughout, more accurate.",
                         choices=FP8_RECIPES)
    loss_scale: float = _f(0.0, "fp16 only: a static loss scale; 0 = dynamic loss scaling.")
    initial_loss_scale: float = _f(4294967296.0, "fp16 only: the first dynamic loss scale (a power of 2).")
    loss_scale_window: int = _f(1000, "fp16 only: iterations without overflow before the scale doubles.")
    hysteresis: int = _f(2, "fp16 only: overflows tolerated before the scale halves.")
    min_loss_scale: float = _f(1.0, "fp16 only: the dynamic scale never drops below this.")
    zero_stage: int = _f(0, "ZeRO stage: 0 (plain data parallel) or 1 (optimizer state sharded over dp). The "
                            "pipeline engine refuses 2 and 3; bf16 and fp16 always run at 1.", choices=(0, 1))
    activation_checkpointing: Union[bool, str] = _f(
        "none", "Activation recompute in backward (Megatron's --recompute-granularity): `none`; `selective` "
                "recomputes each layer's attention core; `full` each whole transformer layer. true/false are read as "
                "full/none.", choices=RECOMPUTE_MODES)
    compile: bool = _f(
        False, "torch.compile each transformer layer (one graph that every layer reuses). The first iteration "
               "compiles; its time is left out of the log line's rates. Checkpoints move between compile on and off.")
    gradient_accumulation_fusion: bool = _f(
        True, "Megatron's gradient-accumulation fusion: in bf16 (and fp8) each tensor-parallel linear layer's "
              "weight-gradient GEMM adds into DeepSpeed's fp32 gradient buffer directly. No effect in fp32 / fp16.")
    rampup_batch_size: Optional[List[int]] = _f(None, "Megatron's batch-size ramp-up `[start, increment, "
                                                      "samples]`: start at `start`, grow by `increment` "
                                                      "evenly over `samples` samples up to "
                                                      "global_batch_size; null = constant. Needs "
                                                      "train_samples.")
    eval_interval: Optional[int] = _f(1000, "Evaluate on the validation split every this many iterations; "
                                            "null = never.")
    eval_iters: int = _f(100, "Micro-batch rounds (global batches) per evaluation.")
    exit_interval: Optional[int] = _f(None, "Stop when iteration % exit_interval == 0 (saving a checkpoint "
                                            "when checkpoint.save is set); null = never.")
    exit_duration_in_mins: Optional[float] = _f(None, "Stop (and save) after this many minutes of training; "
                                                      "null = never.")
    exit_on_nan_iterations: Optional[int] = _f(10, "Stop with exit code 1 after this many consecutive iterations "
                                                   "whose loss is NaN or Inf; null = never. A checkpoint is never "
                                                   "saved while the weights hold NaN/Inf.")
    skip_train_iteration_range: Optional[List[str]] = _f(
        None, "Megatron-DeepSpeed's --skip-train-iteration-range: `\"START-END\"` iteration ranges (1-based, both "
              "included) whose batches are drawn and discarded without a step, as after a loss spike. null = none.")
    kill_switch_path: Optional[str] = _f(
        None, "Megatron-DeepSpeed's --kill-switch-path: when this file exists, every rank stops after the current "
              "iteration, saves a checkpoint (with checkpoint.save) and exits 0. null = off.")
    check_replicas_interval: Optional[int] = _f(
        None, "Compare a digest of every replicated parameter across its replicas before every save (null) and also "
              "every N iterations (N > 0); 0 = never. Replicas that differ end the run (exit 1).")

    def __post_init__(self):
        s = "training"
        if isinstance(self.activation_checkpointing, bool):  # the older switch: true = full, false = none
            self.activation_checkpointing = recompute_mode(self.activation_checkpointing)
        _check_fields(s, self)
        # Mixed precision runs at ZeRO-1 (not a field: the trainer prints `zero_stage_note` at start):
        # - bf16 must accumulate gradients in fp32, and DeepSpeed's only such path is BF16_Optimizer, its
        #   own ZeRO-1 ("unsupported mix of model_dtype=bfloat16 and grad_accum_dtype=float32" at stage 0);
        # - fp16 at stage 0 (FP16_(Unfused)Optimizer) is broken in DeepSpeed: engine.backward multiplies the loss
        #   by the scale only for ZeRO optimizers, yet the step divides the gradients by it (tests/integration/test_precision.py).
        self.zero_stage_promoted = deepspeed_precision(self.precision) in ("bf16", "fp16") and self.zero_stage == 0
        if self.zero_stage_promoted:
            self.zero_stage = 1

        _positive(s, self, "micro_batch_size", "global_batch_size", "adam_eps", "initial_loss_scale",
                  "loss_scale_window", "hysteresis", "min_loss_scale")
        _positive(s, self, "train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples",
                  "eval_interval", "exit_interval", "exit_duration_in_mins", "exit_on_nan_iterations",
                  allow_none=True)
        _positive(s, self, "lr", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "weight_decay",
                  "clip_grad", "loss_scale", "eval_iters", "seed", allow_zero=True)
        _positive(s, self, "check_replicas_interval", allow_none=True, allow_zero=True)
        if (self.train_iters is None) == (self.train_samples is None):
            raise ConfigError("set exactly one of training.train_iters and training.train_samples "
                              f"(got train_iters={self.train_iters}, train_samples={self.train_samples}); "
                              "set the other to null")
        if self.min_lr > self.lr:
            raise ConfigError(f"training.min_lr ({self.min_lr}) exceeds training.lr ({self.lr}): lower min_lr")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"training.{name} must be in [0, 1), got {getattr(self, name)}")
        if math.log2(self.initial_loss_scale) % 1:
            raise ConfigError(f"training.initial_loss_scale ({self.initial_loss_scale}) must be a power of 2 "
                              f"(DeepSpeed takes its exponent), e.g. {2.0 ** round(math.log2(self.initial_loss_scale))}")
        if self.train_iters is not None:  # Megatron: iteration-based options only
            for name, off in (("lr_warmup_samples", 0), ("lr_decay_samples", None), ("rampup_batch_size", None)):
                if getattr(self, name) != off:
                    why = " (ramp-up is sample-based, like Megatron)" if name == "rampup_batch_size" else ""
                    raise ConfigError(f"training.{name} needs sample-based training{why}: set "
                                      f"training.train_samples instead of train_iters, or reset {name}")
            warmup, decay, unit = self.lr_warmup_iters, self.lr_decay_iters or self.train_iters, "iters"
        else:
            for name, off in (("lr_warmup_iters", 0), ("lr_decay_iters", None)):
                if getattr(self, name) != off:
                    raise ConfigError(f"training.{name} is iteration-based but training.train_samples is set: "
                                      f"use training.{name.replace('iters', 'samples')} instead")
            warmup, decay, unit = self.lr_warmup_samples, self.lr_decay_samples or self.train_samples, "samples"
        try:  # the schedule's own rule (Megatron's AnnealingLR asserts warmup_steps < decay_steps)
            LearningRateSchedule.from_config(self)
        except ValueError:
            raise ConfigError(f"training.lr_warmup_{unit} ({warmup}) must be below the decay length "
                              f"(lr_decay_{unit} or train_{unit}: {decay}): shorten the warmup") from None
        try:
            SkipRanges.parse(self.skip_train_iteration_range)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.kill_switch_path == "":
            raise ConfigError("training.kill_switch_path is an empty string: give a file path or null")
        if self.fp8_recipe != "tensorwise" and self.precision != "fp8":
            raise ConfigError(f"training.fp8_recipe={self.fp8_recipe} applies to training.precision=fp8 only, got "
                              f"precision {self.precision}: set training.precision=fp8 or remove fp8_recipe")
        if self.rampup_batch_size is not None and len(self.rampup_batch_size) != 3:
            raise ConfigError("training.rampup_batch_size must be [start, increment, samples], got "
                              f"{self.rampup_batch_size}")
        # the batch arithmetic (ramp-up included) needs the data-parallel size: Config.check runs it

    @property
    def zero_stage_note(self) -> Optional[str]:
        """The one line saying why zero_stage 0 became 1, or None."""
        if not self.zero_stage_promoted:
            return None
        why = {"bf16": "bf16 accumulates gradients in fp32 only through BF16_Optimizer, which shards the fp32 "
                       "master weights and Adam state over dp",
               "fp16": "DeepSpeed's fp16 optimizer at stage 0 never scales the loss but unscales the "
                       "gradients"}[deepspeed_precision(self.precision)]
        return f"training.zero_stage 0 -> 1 ({self.precision}): {why}"


@dataclass
class DataConfig:
    """Where the tokens come from and how samples are masked."""

    data_path: Optional[Union[str, List[Union[str, float]]]] = _f(
        None, "A preprocessed dataset prefix (`path/name_text_document`, without .bin/.idx) or Megatron's "
              "weighted blend `[\"0.3\", \"prefixA\", \"0.7\", \"prefixB\"]`. null needs data.synthetic=true.")
    valid_data_path: Optional[Union[str, List[Union[str, float]], Dict[str, Union[str, List[Union[str, float]]]]]] = _f(
        None, "Named validation sets, each evaluated and logged on its own: a dict `{\"NAME\": prefix or blend}`, "
              "Megatron-DeepSpeed's weighted split paths, or one prefix or blend. null = data.data_path's validation "
              "split.")
    tokenizer_model: Optional[str] = _f(None, "The tokenizer the data was preprocessed with: a SentencePiece "
                                              "`.model`, or a local Hugging Face `tokenizer.json` or folder. Gives "
                                              "the end-of-document id, is checked against model.vocab_size, decodes "
                                              "generated text.")
    split: str = _f("949,50,1", "Train, validation, test proportions of each dataset (Megatron's --split).")
    synthetic: bool = _f(False, "Train on synthetic tokens: sample i is randint(0, vocab_size, seq_length + "
                                "1) seeded by (training.seed, i), identical for every topology.")
    reset_position_ids: bool = _f(False, "Restart position ids after each end-of-document token.")
    reset_attention_mask: bool = _f(False, "Do not attend across end-of-document tokens.")
    eod_mask_loss: bool = _f(False, "Exclude end-of-document tokens from the loss.")
    prefix_lm: bool = _f(False, "Prefix-LM: bidirectional attention over a prefix of each sample.")
    loss_on_targets_only: bool = _f(False, "Prefix-LM: compute the loss on the non-prefix tokens only.")

    def __post_init__(self):
        _check_fields("data", self)
        if self.synthetic and self.data_path is not None:
            raise ConfigError("data.synthetic=true and data.data_path are both set: set data.data_path=null "
                              "for synthetic data, or data.synthetic=false to read the dataset")
        if self.data_path == "":
            raise ConfigError("data.data_path is empty: give a dataset prefix or null")
        _check_data(self.data_path, self.split)
        if self.valid_data_path is not None and self.synthetic:
            raise ConfigError("data.valid_data_path names datasets but data.synthetic=true: set data.valid_data_path="
                              "null (synthetic runs validate on synthetic samples) or data.synthetic=false")
        _check_valid_data_path(self.valid_data_path)
        if self.loss_on_targets_only and not self.prefix_lm:
            raise ConfigError("data.loss_on_targets_only needs data.prefix_lm=true (targets follow the prefix)")


def _check_data(data_path, split) -> None:
    """The data pipeline's own parsers (gptpar.data.gpt_dataset: the path grammar and the blend weights'
    rule, the split), so a data path or split the config accepts is one the datasets read the same way."""
    from gptpar.data.gpt_dataset import DataError, parse_data_path, parse_split

    for key, parse, value in (("data_path", parse_data_path, data_path), ("split", parse_split, split)):
        if value is not None:
            try:
                parse(value)
            except DataError as e:
                raise ConfigError(f"data.{key}: {e}") from None


def _check_valid_data_path(valid_data_path) -> None:
    """The validation-sets grammar's one home is gptpar.data.gpt_dataset.parse_valid_data_path."""
    from gptpar.data.gpt_dataset import DataError, parse_valid_data_path

    if valid_data_path is not None:
        try:
            parse_valid_data_path(valid_data_path)
        except DataError as e:
            raise ConfigError(f"data.valid_data_path: {e}") from None


@dataclass
class CheckpointConfig:
    """Where checkpoints go and come from."""

    save: Optional[str] = _f(None, "Directory to save checkpoints in; null = never save.")
    load: Optional[str] = _f(None, "Checkpoint to resume from: checkpoint.save's folder (its `latest`) or one of its "
                                   "iter_N folders. A missing folder starts fresh; anything else that is not a whole "
                                   "checkpoint is an error (exit 2).")
    init_from: Optional[str] = _f(None, "Start from these weights (Megatron's --finetune): a gptpar, weights-only or "
                                        "universal checkpoint of any tp x pp, or a local Hugging Face model; "
                                        "iteration 0, fresh optimizer. checkpoint.load wins.")
    universal_dir: Optional[str] = _f(None, "Where resuming a checkpoint of another parallel shape or precision "
                                            "writes (or finds) its universal copy, `{universal_dir}/{tag}`. null = "
                                            "`{load folder}_universal` beside the load folder.")
    save_interval: Optional[int] = _f(None, "Save every this many iterations (and always at exit); "
                                            "null = only at exit.")
    keep_last: Optional[int] = _f(None, "Keep only the newest K checkpoints; null = keep all.")
    async_save: bool = _f(False, "Write checkpoints in a background thread while training goes on (the save first "
                                 "copies this rank's state to host memory). Worth it where host cores are free "
                                 "during the step (GPU training).")
    async_host_buffer_mb: Optional[int] = _f(
        None, "With async_save: at most this many MiB of host memory hold a save's snapshot, copied in chunks through "
              "a bounded pool (the next optimizer step waits for the rest to be written). null = the whole state.")
    checksums: bool = _f(True, "Record the sha256 of every file this run writes (checkpoints, universal copies) "
                               "in its manifest, hashed as it is written. false = sizes only.")
    verify_checksums: bool = _f(True, "Check every file read (resume, universal copy, init_from) against the sha256 "
                                      "its manifest records, before it is parsed: a changed file is refused, "
                                      "naming it (exit 2). false = skip the check (said in the log).")
    shutdown_grace_seconds: Optional[int] = _f(
        None, "Seconds gptpar.launch gives the ranks to save after SIGTERM/SIGINT before it kills them (torchrun's "
              "--shutdown-timeout). null = 2 x (last iteration + save, measured in checkpoint.save) + 60, min 300.")
    override_lock: bool = _f(False, "Take over checkpoint.save's lock (`.gptpar.lock`) even when gptpar cannot tell "
                                    "that the job holding it has ended (another host, an unreadable lock). A live "
                                    "job's lock on this host is always refused.")

    def __post_init__(self):
        _check_fields("checkpoint", self)
        _positive("checkpoint", self, "save_interval", "keep_last", "shutdown_grace_seconds", "async_host_buffer_mb",
                  allow_none=True)
        for name in ("save", "load", "init_from", "universal_dir"):
            if getattr(self, name) == "":
                raise ConfigError(f"checkpoint.{name} is an empty string: give a directory or null")
        if self.save is None and (self.save_interval is not None or self.keep_last is not None):
            raise ConfigError("checkpoint.save_interval / checkpoint.keep_last are set but checkpoint.save is "
                              "null: give checkpoint.save a directory")


@dataclass
class LoggingConfig:
    """The Megatron log line, the metrics file, TensorBoard and the memory report."""

    log_interval: int = _f(100, "Print the log line (and write metrics) every this many iterations.")
    tensorboard_dir: Optional[str] = _f(None, "TensorBoard event directory; null = no TensorBoard.")
    metrics_file: Optional[str] = _f(None, "JSONL file, appended, one object per logged iteration with every "
                                           "field of the log line at full precision; null = none.")
    tflops_formula: str = _f("improved", "TFLOPs estimate: `improved` (Narayanan et al. eq. 3, vocab term "
                                         "corrected without recompute) or `legacy` (params x factor x 2 x "
                                         "tokens).", choices=("improved", "legacy"))
    log_num_zeros: bool = _f(False, "Count zero gradient entries (after clipping, each parameter of the model "
                                    "once) for the `num zeros` field; false omits the field.")
    log_params_norm: bool = _f(False, "Megatron's --log-params-norm: the L2 norm of the whole model's weights as "
                                      "`params norm` in the log line, the metrics file and TensorBoard; false omits "
                                      "it. Costs a few one-number all-reduces per log line.")
    tensorboard_tags: str = _f("megatron", "TensorBoard tag names: `megatron` writes Megatron-DeepSpeed's "
                                           "(`lm-loss-training/lm loss`, `learning-rate/learning-rate`, ...); "
                                           "`gptpar` the older `train/<key>`, `eval/lm_loss`.",
                               choices=("megatron", "gptpar"))
    timers: bool = _f(False, "After each log line, print where an iteration's time went (Megatron's `time (ms)` "
                             "line), averaged over the interval; also in the metrics file and TensorBoard. pp = 1 "
                             "only; synchronises the device around each phase.")
    profile: Optional[str] = _f(None, "Megatron-LM's --profile-step-start/-end: `\"START-END\"` (1-based, both "
                                      "included) runs torch.profiler over those iterations and prints the top ops at "
                                      "END. Pick iterations after the first. null = off.")
    profile_dir: Optional[str] = _f(None, "With logging.profile: each rank writes its Chrome trace "
                                          "(`trace_rank<R>.json.gz`, chrome://tracing or Perfetto) into this "
                                          "directory; null = the printed table only.")
    straggler_threshold: Optional[float] = _f(
        1.2, "Name a rank whose own time per iteration (its work less its waits in collectives) is over this many "
             "times the others' median; sent in the loop's stop all-reduce, read one log interval late, no device "
             "wait. Must be > 1; null = off.")
    straggler_min_gap_seconds: float = _f(
        0.25, "A straggler must also be this many seconds per iteration slower than the others' median.")
    straggler_intervals: int = _f(
        3, "A straggler is named once it has been over the threshold this many log intervals in a row.")
    diagnostics_dir: Optional[str] = _f(
        None, "Where each rank writes what it was doing when a collective times out or loses its peer, or on SIGUSR2 "
              "(`tools/diagnose_hang.py DIR` reads it). null = `<checkpoint.save>/diagnostics`.")

    def __post_init__(self):
        _check_fields("logging", self)
        if self.straggler_threshold is not None and not self.straggler_threshold > 1:
            raise ConfigError(f"logging.straggler_threshold must be > 1 (a ratio to the others' median) or null, "
                              f"got {self.straggler_threshold!r}")
        if not self.straggler_min_gap_seconds >= 0:
            raise ConfigError(f"logging.straggler_min_gap_seconds must be >= 0 (seconds), got "
                              f"{self.straggler_min_gap_seconds!r}")
        try:
            parse_range(self.profile)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.profile_dir is not None and self.profile is None:
            raise ConfigError("logging.profile_dir is set but logging.profile is null: set logging.profile "
                              "(e.g. \"5-6\") or remove profile_dir")
        _positive("logging", self, "log_interval")
        _positive("logging", self, "straggler_intervals")
        for name in ("tensorboard_dir", "metrics_file", "diagnostics_dir"):
            if getattr(self, name) == "":
                raise ConfigError(f"logging.{name} is an empty string: give a value or null")


# Model keys are GPTConfig's (gptpar/model/config.py); their documentation for docs/config.md lives here.
MODEL_DOCS = {
    "num_layers": "Transformer layers.",
    "hidden_size": "Hidden size h.",
    "num_attention_heads": "Attention heads; must divide hidden_size and by tp.",
    "ffn_hidden_size": "MLP inner size; null = 4 x hidden_size.",
    "seq_length": "Tokens per sample.",
    "max_position_embeddings": "Rows of the learned position embedding; null = seq_length (unused with alibi).",
    "vocab_size": "The tokenizer's vocabulary; the embedding holds it padded to a multiple of "
                  "make_vocab_size_divisible_by x tp.",
    "make_vocab_size_divisible_by": "Vocab padding multiple (per tensor-parallel rank); 1 disables padding.",
    "hidden_dropout": "Dropout after attention and MLP.",
    "attention_dropout": "Dropout on attention probabilities.",
    "layernorm_epsilon": "LayerNorm epsilon.",
    "init_method_std": "Standard deviation of the normal weight init.",
    "tie_word_embeddings": "Output layer shares the word embedding (must be true).",
    "activation": "MLP activation: gelu, gelu_tanh (BLOOM's) or relu.",
    "position_embedding_type": "learned (a position table, GPT-2) or alibi (no table: each head adds slope x "
                               "(key - query position) to its attention scores, BLOOM; slopes for any head count, "
                               "each tp rank using its own heads').",
    "embed_layernorm": "A LayerNorm right after the embedding (BLOOM's --embed-layernorm); the embedding stage "
                       "owns it.",
}

SECTIONS = {"model": GPTConfig, "parallel": ParallelConfig, "training": TrainingConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig}
# The section of DeepSpeed config keys (nested objects, DeepSpeed's names), not a dataclass: see Config.deepspeed.
DEEPSPEED_SECTION = "deepspeed"
DEEPSPEED_DOC = "DeepSpeed's own keys for what gptpar does not decide, merged over the DeepSpeed config it generates."
ALL_SECTIONS = (*SECTIONS, DEEPSPEED_SECTION)


__all__ = ["OPTIMIZERS", "PRECISIONS", "FP8_RECIPES", "deepspeed_precision", "parse_range", "ParallelConfig",
           "TrainingConfig", "DataConfig", "CheckpointConfig", "LoggingConfig", "MODEL_DOCS", "SECTIONS",
           "DEEPSPEED_SECTION", "DEEPSPEED_DOC", "ALL_SECTIONS"]
