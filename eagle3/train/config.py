"""Training-stage config (consumed by eagle3.train.trainer, eagle3.train.deepspeed_backend, eagle3.train.data,
actors.trainer).

Owns: every knob of draft training and its validation, grouped by concern: `train.optimizer`
(learning-rate schedule, ZeRO, precision), `train.draft` (the draft model and its loss),
`train.data` (batches: size, shuffle, prefetch), `train.checkpoint`, `train.profiling` and
`train.online` (`train.source: online`: hidden states from the engines through the object store);
what is the stage's own (workers, steps, seed, source) stays at `train`'s top. A section is a frozen
dataclass built and type-checked like every other (eagle3.config builds it from the hints, so
errors name `train.optimizer.lr`). Torch-free (drivers load configs before any heavy import),
so the loss names speculators knows are listed here and a test checks them against
speculators' own table.
Does not own: the aux layer ids (read from the hidden-states schema the extract stage
wrote) or the ZeRO/bf16 translation into DeepSpeed (eagle3.train.deepspeed_backend).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from eagle3.typed_config import check_types

# speculators.losses.utils._EAGER_LOSS_FN_MAP keys (speculators 0.9); tests/test_train.py
# fails if speculators renames or drops one.
LossName = Literal["kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid"]
LOSS_NAMES = get_args(LossName)
DraftAttnImpl = Literal["sdpa", "eager", "simple_flex_attention"]
ZeroStage = Literal[0, 1, 2, 3]
Source = Literal["offline", "online"]
OnlineEpochs = Literal["reextract", "keep"]
GpuSplit = Literal["auto", "separate", "shared"]


def _fail(name: str, value: Any, fix: str) -> None:
    raise ValueError(f"config train.{name}={value!r}: {fix}")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, its learning-rate schedule, and how DeepSpeed holds its state (ZeRO, precision)."""

    lr: float = 3e-4
    """Peak AdamW learning rate, reached after warmup_steps."""
    min_lr: float = 0.0
    """Cosine decay floor reached at train.num_steps; must be <= lr."""
    warmup_steps: int | None = None
    """Linear warmup: steps 1..W+1 run at lr * (0, 1, ..., W) / (W + 1), then cosine decay
    (DeepSpeed WarmupCosineLR; its first step always runs at lr 0). Must be <= train.num_steps.
    None: WARMUP_FRACTION of the run's steps."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay (speculators' default)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    zero_stage: ZeroStage = 2
    """DeepSpeed ZeRO stage 0-3. 0: plain data parallel; 1/2: shard optimizer state / gradients
    (the default: the draft's frozen embeddings and lm_head stay replicated, trainable state
    is sharded); 3: shard parameters too (only worth it for very wide drafts; slower)."""
    bf16: bool | None = None
    """bf16 mixed precision (fp32 master weights in the optimizer). None: on with GPUs and on a CPU with
    native bf16 (AVX512-BF16, AMX, Arm BF16), off on a CPU that would emulate it, much slower
    (eagle3/precision.py)."""

    def __post_init__(self):
        check_types(self, "train.optimizer")
        if not self.lr > 0:
            _fail("optimizer.lr", self.lr, "must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            _fail("optimizer.min_lr", self.min_lr, f"must be in [0, lr={self.lr}]")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            _fail("optimizer.warmup_steps", self.warmup_steps, "must be >= 0")
        if self.weight_decay < 0:
            _fail("optimizer.weight_decay", self.weight_decay, "must be >= 0")
        if self.grad_clip < 0:
            _fail("optimizer.grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")


@dataclass(frozen=True)
class DraftConfig:
    """The draft model's shape, its training-time-test unroll and its loss."""

    ttt_steps: int = 3
    """Training-time-test unroll depth: the draft is trained on its own predictions this many
    steps ahead. Also written as the exported draft's default speculative_tokens."""
    ttt_step_loss_decay: float = 1.0
    """Loss weight multiplier per TTT step (1.0 = every step weighted equally)."""
    num_draft_layers: int = 1
    """Decoder layers in the draft (EAGLE-3 uses 1; each adds latency to every draft token)."""
    draft_vocab_size: int | None = None
    """Draft LM-head vocabulary: the most frequent loss-masked target tokens (d2t/t2d mapping), at
    most this many: a target with fewer tokens keeps its whole vocabulary (no mapping). None: 32000."""
    loss: LossName = "kl_div"
    """Distillation loss against the target's next-token distribution; a speculators loss name."""
    norm_before_fc: bool = False
    """EAGLE 3.1: RMSNorm the concatenated aux hidden states before the fc projection. vLLM reads
    it from the exported config since vllm-project/vllm#38111."""
    norm_output: bool = False
    """EAGLE 3.1: feed post-norm hidden states across TTT steps. Needs a vLLM with
    vllm-project/vllm#46488, older ones ignore it silently (lower acceptance)."""
    draft_attn_impl: DraftAttnImpl | None = None
    """Draft attention in training: sdpa, eager, or simple_flex_attention (compiled, block masks). None:
    flex attention on a GPU up to FLEX_ATTN_MAX_TOKENS of train.data.micro_batch_tokens, sdpa above it
    and on the CPU (sdpa's dense masks grow with micro_batch_tokens)."""

    def __post_init__(self):
        check_types(self, "train.draft")
        if self.ttt_steps < 1:
            _fail("draft.ttt_steps", self.ttt_steps, "must be >= 1")
        if not self.ttt_step_loss_decay > 0:
            _fail("draft.ttt_step_loss_decay", self.ttt_step_loss_decay, "must be > 0")
        if self.num_draft_layers < 1:
            _fail("draft.num_draft_layers", self.num_draft_layers, "must be >= 1")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            _fail("draft.draft_vocab_size", self.draft_vocab_size, "must be >= 1 or null (32000, at most the target's vocabulary)")


FLEX_ATTN_MAX_TOKENS = 8192
"""The longest packed sequence flex attention was measured to train (benchmarks/RESULTS.md, long-context
training): its compile failed to finish beyond it, while sdpa trained longer sequences."""


DEFAULT_MAX_DRAFT_VOCAB = 32000
"""train.draft.draft_vocab_size when null: the draft head's tokens at most (speculators' default)."""


def resolve_draft_vocab_size(requested: int | None, target_vocab_size: int) -> int:
    """The draft head's vocabulary: `requested` (DEFAULT_MAX_DRAFT_VOCAB when None), at most the
    target's; equal to the target's means no d2t/t2d mapping."""
    return min(requested or DEFAULT_MAX_DRAFT_VOCAB, target_vocab_size)


def resolve_draft_attn_impl(impl: DraftAttnImpl | None, micro_batch_tokens: int, cuda: bool) -> DraftAttnImpl:
    """The draft attention a run uses: `impl` when set, otherwise flex attention on a GPU for
    packed sequences up to FLEX_ATTN_MAX_TOKENS and sdpa above it or without a GPU (flex
    attention's CPU path is not what the CPU tier tests)."""
    if impl is not None:
        return impl
    return "simple_flex_attention" if cuda and micro_batch_tokens <= FLEX_ATTN_MAX_TOKENS else "sdpa"


@dataclass(frozen=True)
class DataConfig:
    """The batches each rank trains on: their size, the shuffle, and how they are built ahead."""

    micro_batch_tokens: int = 8192
    """Tokens per micro-batch per rank: samples are packed (document-masked) into one
    [1, micro_batch_tokens] sequence. A sample longer than this is truncated with a warning."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Tokens per step ~= micro_batch_tokens * this * train.num_workers."""
    shuffle_buffer_size: int = 256
    """Samples held per rank for the streaming shuffle (memory: this many samples, as views of the
    memory-mapped shards: page cache, not copies)."""
    prefetch_batches: int | None = None
    """Micro-batches built ahead, pinned, so reading and packing overlap the device's step; each costs a
    packed batch of /dev/shm and pinned memory. None: as many as fit in 2 GiB, 2 to 16
    (eagle3.train.data.pipeline.PREFETCH_AUTO_BYTES). 0: build each batch when the step needs it."""
    data_workers: int | None = None
    """Processes per rank that pack the prefetched batches into a shared ring (order unchanged): more
    keep up with a faster step. None: min(4, this rank's CPUs // 4), at least 1. 0: a thread of the
    trainer, whose GIL slows its kernel launches (the fallback where /dev/shm cannot hold the ring)."""

    def __post_init__(self):
        check_types(self, "train.data")
        if self.micro_batch_tokens < 16:
            _fail("data.micro_batch_tokens", self.micro_batch_tokens, "must be >= 16 tokens")
        if self.gradient_accumulation_steps < 1:
            _fail("data.gradient_accumulation_steps", self.gradient_accumulation_steps, "must be >= 1")
        if self.shuffle_buffer_size < 1:
            _fail("data.shuffle_buffer_size", self.shuffle_buffer_size, "must be >= 1 (1 = no shuffle within shards)")
        if self.prefetch_batches is not None and self.prefetch_batches < 0:
            _fail("data.prefetch_batches", self.prefetch_batches, "must be >= 0 (0 = no prefetch) or null (auto)")
        if self.data_workers is not None and self.data_workers < 0:
            _fail("data.data_workers", self.data_workers, "must be >= 0 (0 = a thread) or null (auto)")


@dataclass(frozen=True)
class CheckpointConfig:
    """DeepSpeed checkpoints in the run's storage (what a resume starts from)."""

    checkpoint_every: int = 200
    """Save a DeepSpeed checkpoint every this many steps (and after the last): each one stops every rank
    for the write, and a failure loses the steps since the last one."""
    num_checkpoints_to_keep: int | None = 2
    """Checkpoints kept in the run's storage (oldest deleted first); None keeps all."""
    max_failures: int = 3
    """Worker-group failures (a worker process or its node died) that Ray Train recovers from by
    itself within one job: it restarts the workers from the last checkpoint. 0: the first failure
    ends the job (a resubmit then resumes from the checkpoint); -1: retry without limit."""

    def __post_init__(self):
        check_types(self, "train.checkpoint")
        if self.max_failures < -1:
            _fail("checkpoint.max_failures", self.max_failures, "must be >= 0, or -1 (no limit)")
        if self.checkpoint_every < 1:
            _fail("checkpoint.checkpoint_every", self.checkpoint_every, "must be >= 1 step")
        if self.num_checkpoints_to_keep is not None and self.num_checkpoints_to_keep < 1:
            _fail("checkpoint.num_checkpoints_to_keep", self.num_checkpoints_to_keep, "must be >= 1 or null (keep all)")


@dataclass(frozen=True)
class ProfilingConfig:
    """What a slow step waits for, recorded with torch.profiler on rank 0."""

    profile_steps: list[int] | None = None
    """[first, last]: rank 0 records these optimizer steps with torch.profiler and writes profile/trace.json
    and profile/top_ops.txt: what a slow step waits for. Off by default: the profiler slows the steps it
    records. Last <= train.num_steps."""

    def __post_init__(self):
        check_types(self, "train.profiling")
        if self.profile_steps is not None and not (
                len(self.profile_steps) == 2 and 1 <= self.profile_steps[0] <= self.profile_steps[1]):
            _fail("profiling.profile_steps", self.profile_steps, "use [first, last] with 1 <= first <= last, or null")


@dataclass(frozen=True)
class OnlineConfig:
    """`train.source: online`: the engines extract while the trainer trains, and each
    hidden-states table goes from an engine to a training rank through the Ray object store
    (ray_jobs/online.py, actors/online_feed.py, eagle3/train/online_feed.py). Ignored when source is offline."""

    max_inflight_bytes: int = 4 << 30
    """Bound on hidden-state bytes in the object store (extracting, or not yet taken by their rank), split
    evenly between the ranks: engines wait while it is reached (the trainer is behind). Larger: more
    slack between the two sides, more object-store memory."""
    epochs: OnlineEpochs = "reextract"
    """After the first epoch: 'reextract' (default: hidden states stay off the disk, and few epochs cost
    less in engine passes than in writes) asks the engines again; 'keep' writes each table as a committed
    shard and serves later epochs from disk: for many epochs with slow engines."""
    record_sample_ids: bool = False
    """Each rank appends the sample ids of every optimizer step to train/sample_ids/rank-<r>.jsonl: an
    audit that every sample was trained once per epoch, across restarts. Offline training reads it too."""
    log_every_s: float = 10.0
    """How often the job log gets a line of who waits for whom (bytes in flight, engine idle
    time and why, trainer ranks' wait for engines); the same figures are Ray gauges."""
    gpu_split: GpuSplit = "auto"
    """'separate': whole GPUs for engines and training workers (neither waits on the other's memory or
    kernels); 'shared': an engine replica and a training worker on every GPU, for too few GPUs.
    'auto': separate where the GPUs suffice for both, else shared (ray_jobs.online.split_gpus)."""
    trainer_gpu_fraction: float = 0.3
    """gpu_split shared: each training worker's share of its GPU (Ray resource and memory cap), in (0, 0.5) so no
    GPU gets two ranks; the engine takes the rest (extract.gpu_memory_utilization + this <= 1). An estimate:
    an 8B target's draft with 8K-token micro-batches fits 0.3 of an 80 GB GPU."""

    def __post_init__(self):
        check_types(self, "train.online")
        if not 0 < self.trainer_gpu_fraction < 0.5:
            _fail("online.trainer_gpu_fraction", self.trainer_gpu_fraction,
                  "must be in (0, 0.5): the share of one GPU each training worker takes next to an engine replica")
        if self.max_inflight_bytes < 1:
            _fail("online.max_inflight_bytes", self.max_inflight_bytes, "must be >= 1 byte (e.g. 4294967296 = 4 GiB)")
        if not self.log_every_s > 0:
            _fail("online.log_every_s", self.log_every_s, "must be > 0 seconds")


WARMUP_FRACTION = 0.03
"""train.optimizer.warmup_steps when null: this fraction of the steps (the measured recipes warmed up
over 50 of 1,500 steps and 50 of 7,200)."""

EVALS_PER_RUN = 20
"""train.eval_every_steps when null: about this many held-out evaluations in a run, so the curve has as
many points whatever its length (each costs forwards over up to train.eval_max_tokens tokens), and
never more often than every MIN_EVAL_EVERY steps."""
MIN_EVAL_EVERY = 10


@dataclass(frozen=True)
class TrainConfig:
    """DeepSpeed EAGLE-3 draft training."""

    num_workers: int = 1
    """Ray Train workers (one DeepSpeed data-parallel rank each; one GPU each on a GPU cluster)."""
    num_epochs: float = 5.0
    """Passes over the training data (the prepared or regenerated tokens less the held-out split), which
    set num_steps once the data is known: ceil(num_epochs * tokens / tokens per step), tokens per step being
    data.micro_batch_tokens * data.gradient_accumulation_steps * num_workers (packing fills a micro-batch
    short of it, so a little fewer passes). The measured recipes trained 5 to 7 passes."""
    num_steps: int | None = None
    """Optimizer steps (each = data.gradient_accumulation_steps micro-batches per rank), set instead of
    num_epochs; data is cycled in epochs as needed. None: from num_epochs. The job's report states the
    passes either way (train.passes)."""
    seed: int = 0
    """Seeds the draft's initial weights and the data shuffle (order depends on seed and epoch)."""
    log_every_s: float = 30.0
    """Training's lines in the job's output, at most one every this many seconds: rank 0's step
    line in its worker log, and the driver's progress bar line (at most 100 of those in a run,
    actors.train_progress). Every step is in train/metrics.jsonl and the Ray gauges whatever this is."""
    source: Source = "offline"
    """Where training reads hidden states: 'offline' (default): the extract stage's shards on disk; 'online':
    engines extract while training runs, tables reach the ranks through the object store, nothing written
    (settings: train.online). Same order and draft vocabulary either way."""
    eval_every_steps: int | None = None
    """Every this many optimizer steps, and after the last, the draft's accuracy per TTT position on the
    held-out split (prepare.heldout_fraction) goes into metrics.jsonl: more often, finer curves, each
    costing forwards over up to eval_max_tokens tokens. None: EVALS_PER_RUN evaluations in a run."""
    heldout_first_tokens: int | None = None
    """Also count held-out accuracy over only the first this many tokens of each answer, to compare with
    vLLM's acceptance over eval.max_tokens (a small target's long answers end in loops that overstate
    accuracy; benchmarks/answer_repeats.py). None: eval.max_tokens; 0: off."""
    eval_max_tokens: int = 65536
    """Held-out tokens (packed, all ranks together) an evaluation reads at most, in a fixed order, so every
    evaluation, with any num_workers, measures the same samples; the ranks share them."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)

    def __post_init__(self):
        check_types(self, "train")  # types and Literal choices (each section checked its own); the ranges below
        if self.num_workers < 1:
            _fail("num_workers", self.num_workers, "must be >= 1")
        if not self.num_epochs > 0:
            _fail("num_epochs", self.num_epochs, "must be > 0 passes over the training data")
        if self.num_steps is not None and self.num_steps < 1:
            _fail("num_steps", self.num_steps, "must be >= 1, or null (from train.num_epochs)")
        if not self.log_every_s > 0:
            _fail("log_every_s", self.log_every_s, "must be > 0 seconds")
        if self.eval_every_steps is not None and self.eval_every_steps < 1:
            _fail("eval_every_steps", self.eval_every_steps, "must be >= 1 step (prepare.heldout_fraction: 0 turns "
                  "the held-out evaluation off)")
        if self.heldout_first_tokens is not None and self.heldout_first_tokens < 0:
            _fail("heldout_first_tokens", self.heldout_first_tokens, "must be >= 1 token, 0 (off) or null")
        if self.eval_max_tokens < 1:
            _fail("eval_max_tokens", self.eval_max_tokens, "must be >= 1 token (at least one micro-batch is read)")
        # Limits between a section and the stage's own length (once it is known: resolve_length).
        if self.num_steps is None:
            return
        # Scaled with the length the moment it is known: a config whose num_steps is set is complete.
        if self.optimizer.warmup_steps is None:
            object.__setattr__(self, "optimizer", dataclasses.replace(
                self.optimizer, warmup_steps=round(WARMUP_FRACTION * self.num_steps)))
        if self.eval_every_steps is None:
            object.__setattr__(self, "eval_every_steps", max(MIN_EVAL_EVERY, self.num_steps // EVALS_PER_RUN))
        if self.optimizer.warmup_steps > self.num_steps:
            _fail("optimizer.warmup_steps", self.optimizer.warmup_steps, f"must be in [0, num_steps={self.num_steps}]")
        steps = self.profiling.profile_steps
        if steps is not None and steps[1] > self.num_steps:
            _fail("profiling.profile_steps", steps, f"use [first, last] with 1 <= first <= last <= num_steps="
                  f"{self.num_steps}, or null")



def tokens_per_step(cfg: TrainConfig) -> int:
    """Tokens an optimizer step takes at most, all ranks together (packing leaves some room)."""
    return cfg.data.micro_batch_tokens * cfg.data.gradient_accumulation_steps * cfg.num_workers


def resolve_length(cfg: TrainConfig, train_tokens: int) -> tuple[TrainConfig, dict]:
    """cfg with num_steps set from num_epochs and the training data's token count (a num_steps given is
    kept), warmup and evaluation scaled with it; and a record of how. Checked again as a whole (a
    profile_steps past the derived steps is refused)."""
    per_step = tokens_per_step(cfg)
    steps = cfg.num_steps if cfg.num_steps is not None else max(1, math.ceil(cfg.num_epochs * train_tokens / per_step))
    resolved = dataclasses.replace(cfg, num_steps=steps)
    record = {"num_steps": steps, "steps_from": "train.num_steps" if cfg.num_steps is not None else "train.num_epochs",
              "num_epochs": cfg.num_epochs if cfg.num_steps is None else None, "train_tokens": train_tokens,
              "tokens_per_step": per_step, "warmup_steps": resolved.optimizer.warmup_steps,
              "eval_every_steps": resolved.eval_every_steps,
              "planned_passes": round(steps * per_step / train_tokens, 2) if train_tokens else None}
    return resolved, record
