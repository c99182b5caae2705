"""Job configuration: one frozen dataclass per stage, strict YAML/JSON loading.

Owns: the shape of a job config file, validation with errors that name the field, the
value and the fix, and the derived settings (aux layer ids from num_hidden_layers).
Imports neither torch nor vllm: drivers load configs before any heavy import.
The training stage's dataclass lives in `eagle3.train.config` (its consumer) and is
composed here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from eagle3.train.config import TrainConfig
from eagle3.typed_config import check_types, field_hints

# Choices, each defined once: the field's hint is the check (eagle3.typed_config).
ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]
HsDtype = Literal["bfloat16", "float8_e4m3fn"]
FileFormat = Literal["arrow", "parquet"]
Compression = Literal["zstd", "lz4", "snappy", "gzip"]
ARROW_CODECS = ("zstd", "lz4")  # Arrow IPC compresses buffers with these two only
ExtractBackend = Literal["vllm", "hf"]
Sink = Literal["auto", "memory", "shm"]
Stage = Literal["prepare", "regenerate", "extract", "train", "export", "eval"]
OverLength = Literal["truncate", "reject"]
TinyChatTemplate = Literal["simple", "qwen3"]
LeadingAssistant = Literal["reject", "drop"]
RegenerateCut = Literal["reject", "end"]
"""Names in eagle3.prepare.chat_template.TEMPLATES (a test keeps them equal)."""


def _fail(section: str, name: str, value: Any, fix: str) -> None:
    raise ValueError(f"config {section}.{name}={value!r}: {fix}")


@dataclass(frozen=True)
class TargetConfig:
    """The target (verifier) model."""

    model: str | None = None
    """HF model directory. None: build the tiny seeded demo model under output_dir/target."""
    tiny_size: int = 1
    """Size knob of the tiny demo model (1 = 8 layers, hidden 256), used when model is None."""
    tiny_seed: int = 0
    """Seed of the tiny demo model's weights and tokenizer, used when model is None."""
    tiny_pretrain_steps: int = 100
    """Next-token steps on the conversations for the tiny target (~40 s on 2 cores), so its greedy
    text resembles them and acceptance length means something; 0 = random weights."""
    tiny_chat_template: TinyChatTemplate = "simple"
    """Chat template of the tiny target: "simple" (prefix-stable role markers) or "qwen3" (a
    Qwen3-like template that rewrites earlier turns: each assistant turn becomes its own sample)."""
    trust_remote_code: bool = False
    """Off unless set: a target's own Python code runs in every engine process when on."""
    dtype: ModelDtype = "auto"
    """Compute dtype of the engines (extract, regenerate, eval, the doctor's dry run). "auto": bfloat16
    on a GPU or on a CPU that computes bf16 natively (AVX512-BF16, AMX, Arm BF16), float32 on a CPU
    that would emulate it (3-5x slower there; eagle3/precision.py), resolved in each engine's process
    and named in the job's log and summary. Hidden states are stored as extract.hs_dtype whatever this
    is; the trainer's precision is train.optimizer.bf16."""

    def __post_init__(self):
        check_types(self, "target")
        if self.tiny_size < 1:
            _fail("target", "tiny_size", self.tiny_size, "must be >= 1 (1 = 8 layers, hidden 256)")
        if self.tiny_pretrain_steps < 0:
            _fail("target", "tiny_pretrain_steps", self.tiny_pretrain_steps, "must be >= 0 (0 = random weights)")


@dataclass(frozen=True)
class PrepareConfig:
    """Conversations -> chat template -> input_ids + loss_mask (Arrow)."""

    conversations: str = "data/demo_conversations.jsonl"
    """OpenAI `messages` or ShareGPT `conversations` records, from: a JSONL file, a JSON array
    file (read record by record, never whole; a file cut inside a record ends in one reject),
    a Parquet or Arrow file, a directory of those (read in name order), or a directory written
    by `datasets.save_to_disk` (one split). ShareGPT's chatgpt/bing/bard turns are assistant
    turns, counted in the summary's mapped_roles. Must be readable where the job's driver runs."""
    max_length: int = 2048
    """Tokens per sample at most; over_length says what happens to a conversation that has more."""
    over_length: OverLength = "truncate"
    """'truncate': keep the conversation's assistant turns whose sample fits, whole (for a
    prefix-stable template: the conversation cut after the last whole assistant turn that fits),
    counted in the summary's num_truncated; a conversation whose first turn does not fit is a
    reject. Default, because every kept turn ends where the target ended it and its tokens and
    hidden states are exactly those of the full conversation (attention is causal), so cutting
    teaches nothing false, while rejecting loses every turn that fits (most of ShareGPT at 4K
    tokens). A turn is never cut inside. 'reject': such a conversation is a reject, whole."""
    max_samples: int | None = None
    """Take at most this many records (in file order); None = all."""
    leading_assistant: LeadingAssistant = "reject"
    """A conversation whose first non-system turn is the assistant's: 'reject' it (kind
    assistant_first: that turn answers no user turn), or 'drop' the assistant turns before the first
    user turn and keep the rest, counted in the summary's num_leading_assistant_dropped. ShareGPT's
    "split" copy cuts long conversations into chunks, and every chunk after the first may start
    with the assistant (6,308 of its 17,672 records); FastChat-style trainers drop that turn."""
    assistant_only_loss: bool = True
    """loss_mask = 1 on assistant tokens only; False trains on every token."""
    num_eval_prompts: int = 16
    """The first N good records are held out of training: their prompts (up to the first
    assistant turn) go to eval_prompts.jsonl for the acceptance-length evaluation."""
    heldout_fraction: float = 0.02
    """Fraction of the kept conversations held out of training, in [0, 0.5]: prepared, regenerated
    and extracted with the rest, never trained on; the trainer measures the draft's accuracy per
    TTT position on them every train.eval_every_steps (eagle3.prepare.heldout: a hash of the
    conversation id decides, so all samples of a conversation are on one side, on every run).
    0 = no split (no held-out accuracy). Unlike num_eval_prompts, which holds out prompts for
    vLLM's acceptance, this holds out whole conversations with their hidden states. Online
    (train.source online) too: the ranks skip the split, and the engines extract it first into
    hidden_states_heldout/ (ray_jobs/online.py), the only hidden states online mode writes unless
    epochs is keep."""
    heldout_min_conversations: int = 8
    """With heldout_fraction > 0: hold out at least this many conversations (at most half of
    them) when the fraction alone gives fewer, so a small data set still has a split."""
    num_workers: int | None = None
    """Ray tasks (1 CPU each, on any node) that tokenize contiguous chunks of records at once;
    None = the cluster's CPUs. The output is the same for any value."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, as the target is served with them (vLLM's
    chat_template_kwargs), e.g. {enable_thinking: false} for a Qwen3-like target served without
    reasoning: then reasoning in the records is removed, since the target never writes it."""

    def __post_init__(self):
        check_types(self, "prepare")
        if self.max_length < 8:
            _fail("prepare", "max_length", self.max_length, "must be >= 8 tokens")
        if self.num_eval_prompts < 0:
            _fail("prepare", "num_eval_prompts", self.num_eval_prompts, "must be >= 0")
        if self.max_samples is not None and self.max_samples < 1:
            _fail("prepare", "max_samples", self.max_samples, "must be >= 1 or null")
        if not 0 <= self.heldout_fraction <= 0.5:
            _fail("prepare", "heldout_fraction", self.heldout_fraction,
                  "must be in [0, 0.5] (0.02 = 2% of the conversations held out of training; 0 = none)")
        if self.heldout_min_conversations < 0:
            _fail("prepare", "heldout_min_conversations", self.heldout_min_conversations, "must be >= 0")
        if self.num_workers is not None and self.num_workers < 1:
            _fail("prepare", "num_workers", self.num_workers, "must be >= 1, or null for the cluster's CPUs")


@dataclass(frozen=True)
class ExtractConfig:
    """vLLM engines that capture EAGLE-3 hidden states and write them as Arrow shards."""

    aux_hidden_state_layer_ids: tuple[int, ...] | None = None
    """EAGLE-3 auxiliary layers (id k = residual stream after k decoder layers).
    None: derived as (2, n // 2, n - 3) from the target's num_hidden_layers. The last
    layer (id n) is always captured too, as the training target."""
    num_replicas: int | None = None
    """Engine replicas. None: as many as the cluster's GPUs allow (1 on a CPU-only cluster)."""
    tensor_parallel_size: int = 1
    """GPUs per engine replica, inside one node (vLLM's tensor parallelism); a replica's GPUs are
    one placement-group bundle each, packed on one node."""
    pipeline_parallel_size: int = 1
    """Pipeline stages per engine replica (vLLM's); tensor_parallel_size * this GPUs a replica."""
    replicas_per_gpu: int | Literal["auto"] = "auto"
    """Engine replicas sharing each GPU, for a small target that one engine cannot keep busy: each
    replica is placed on a 1/n share of a GPU (a fractional Ray bundle), takes
    gpu_memory_utilization / n of its memory, and num_replicas defaults to the cluster's GPUs times
    this. Needs tensor_parallel_size * pipeline_parallel_size == 1. On vLLM 0.26 engines that start
    together on one GPU need kv_cache_memory_bytes (memory profiling reads the free memory the
    others' starts change). Measured by benchmarks/replica_bench.py --replicas-per-gpu.
    "auto": the extract stage on a GPU cluster takes 4 for a target of fewer than 0.5B parameters
    (counted from its config; with a KV cache of 4 GiB each where kv_cache_memory_bytes is null) and
    1 otherwise: on one H200, 4 replicas of SmolLM2-135M's shape extracted 1.89x one
    (benchmarks/results/extraction/replicas-h200-smol.md); the 1B shape's one engine already ran at
    0.86x plain prefill. The regenerate stage places its replicas by the same rule (a 135M
    target's one generation engine generated ~15k tokens/s on an H200, at 14 ms a step for ~280
    sequences: far from what the device does). Online training and CPU clusters take 1. The extract and regenerate stages'
    logs and summaries say what auto chose and why."""
    samples_per_shard: int = 256
    """Unit of work handed out to replicas and committed to the manifest (at most this many
    samples; shard_bytes may lower it)."""
    shard_bytes: int = 1 << 30
    """Bound on a shard's hidden-state bytes, estimated from the mean sample length and the
    stored bytes per token: samples_per_shard is lowered to fit (at least 1 sample). A shard's
    table sits in pinned host memory and in the object store up to max_inflight_shards times per
    replica: 256 samples of 4K tokens of a hidden-7168 target would be 60 GB. 0: no bound."""
    hs_dtype: HsDtype = "bfloat16"
    """Storage of hidden states: bfloat16 (lossless) or float8_e4m3fn (per-token scale, half the bytes)."""
    file_format: FileFormat = "arrow"
    """Shard files: 'arrow' (Arrow IPC, memory-mapped by the trainer, written at near disk speed)
    or 'parquet' (smaller with compression, ~3x slower to write). See eagle3/extract/shards.py."""
    direct_io: bool = True
    """Write Arrow shards with O_DIRECT (near the disk's raw bandwidth; buffered writes + fsync
    measured 0.2-0.5x of it), falling back to buffered writes where the file system refuses it.
    false: always buffered (e.g. a network file system whose O_DIRECT path is slow)."""
    compression: Compression | None = None
    """None, or a codec: 'lz4'/'zstd' (both formats), 'snappy'/'gzip' (Parquet only). Hidden
    states are noisy floats: expect little gain for much CPU."""
    max_num_batched_tokens: int | None = None
    """vLLM scheduler budget; None = max(8192, prepare.max_length). Must be >= the longest sample,
    since chunked prefill is off for extraction."""
    max_num_seqs: int = 256
    """vLLM's limit on sequences in one step."""
    gpu_memory_utilization: float = 0.85
    """Fraction of each GPU's memory vLLM may take (weights, activations, KV cache), in (0, 1].
    Online mode with train.online.gpu_split shared: at most 1 - train.online.trainer_gpu_fraction
    (0.7 by default), so that the training worker on the same GPU has its share."""
    kv_cache_memory_bytes: int | None = None
    """GPU: each engine's KV cache size in bytes, set instead of profiled (vLLM's
    kv_cache_memory_bytes; compat.vllm_engine). None (default): vLLM profiles the device's free
    memory and takes gpu_memory_utilization of it. Set it when several engines start at once on one
    GPU (two Ray nodes declaring the same device: benchmarks/two_node.py --share-gpu): profiling
    reads device-wide free memory, which the other engine's start changes (vLLM 0.26 asserts when
    it grows meanwhile, and counts the other's allocations as its own); vLLM then only checks that
    gpu_memory_utilization of the device is free at its start. Prefill-only extraction needs little
    cache: max_num_batched_tokens tokens' worth. Online training on shared GPUs (train.online.gpu_split
    shared) gives its engines 4 GiB where this is null: the trainer sets up on the same GPU while the
    engine starts (ray_jobs/online.py::shared_engine_config)."""
    enforce_eager: bool = True
    """Skip CUDA graph / torch.compile warm-up: extraction is prefill-only, so graphs buy little."""
    block_size: int | None = None
    """KV cache block size in tokens (vLLM's `block_size`), a multiple of 16; None: vLLM's default
    (16 on GPU). vLLM 0.26 derives the block size of the hidden-states cache from it (2 tokens
    for 4 captured layers of a hidden-2048 target at 16) and, with a KV connector set, hashes and
    allocates every request at that granularity: a larger block size means less of that host
    work. Its effect on extraction speed is not measured yet (benchmarks/extract_bench.py
    --block-size)."""
    cpu_kvcache_space_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE on CPU-only engines (vLLM's default takes most of the NUMA node)."""
    backend: ExtractBackend = "vllm"
    """'vllm' (the product) or 'hf' (transformers forward: the reference, and for CPU tests of the
    orchestration without an engine start)."""
    sink: Sink = "auto"
    """How hidden states leave the engine: 'memory' (in-process, no files; needs an in-process
    engine, i.e. tp*pp == 1), 'shm' (files in /dev/shm, deleted as soon as read), 'auto'."""
    max_inflight_shards: int = 3
    """Per replica: shards handed out but not yet written. Bounds object-store memory
    (about this many shards of hidden states per replica) and sets how many writes
    and engine calls overlap."""
    placement_timeout_s: float = 600.0
    """How long to wait for GPUs before failing with what to check."""
    load_format: str = "auto"
    """vLLM load_format; 'dummy' gives random weights of the target's shape (benchmarks only)."""

    def __post_init__(self):
        check_types(self, "extract")
        if self.file_format == "arrow" and self.compression not in (None, *ARROW_CODECS):
            _fail("extract", "compression", self.compression,
                  f"use one of {[None, *ARROW_CODECS]} with arrow files (snappy and gzip are Parquet only)")
        if self.block_size is not None and (self.block_size < 16 or self.block_size % 16):
            _fail("extract", "block_size", self.block_size, "use a multiple of 16 (the attention kernels' unit), or null")
        if self.samples_per_shard < 1:
            _fail("extract", "samples_per_shard", self.samples_per_shard, "must be >= 1")
        if self.shard_bytes < 0:
            _fail("extract", "shard_bytes", self.shard_bytes, "must be >= 0 (0: no bound)")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                _fail("extract", name, getattr(self, name), "must be >= 1 (GPUs per engine replica along this axis)")
        if self.sink == "memory" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            # The memory sink hands tensors over inside the engine's process; tp*pp > 1 runs the model in
            # other processes (eagle3.extract.extractor.VLLMBackend refuses it at engine start).
            _fail("extract", "sink", self.sink, f"'memory' needs tensor_parallel_size * pipeline_parallel_size == 1, "
                  f"found {self.tensor_parallel_size} * {self.pipeline_parallel_size}; use 'shm' or 'auto'")
        if self.per_gpu < 1:
            _fail("extract", "replicas_per_gpu", self.replicas_per_gpu, "must be >= 1 (1: each replica has whole GPUs), "
                  "or 'auto'")
        if self.per_gpu > 1 and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            _fail("extract", "replicas_per_gpu", self.replicas_per_gpu,
                  f"needs engine replicas of one GPU, found tensor_parallel_size * pipeline_parallel_size = "
                  f"{self.tensor_parallel_size} * {self.pipeline_parallel_size}; use 1, or replicas of one GPU")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            _fail("extract", "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be >= 1 byte, or null (profiled)")
        if self.num_replicas is not None and self.num_replicas < 1:
            _fail("extract", "num_replicas", self.num_replicas, "must be >= 1, or null (as many as the GPUs allow)")
        if self.max_inflight_shards < 1:
            # 0 would hand out no shard at all: the job would wait forever with engines up.
            _fail("extract", "max_inflight_shards", self.max_inflight_shards, "must be >= 1 (3 overlaps engine and writes)")
        if not 0 < self.gpu_memory_utilization <= 1:
            _fail("extract", "gpu_memory_utilization", self.gpu_memory_utilization,
                  "must be in (0, 1]: the fraction of each GPU's memory vLLM may take")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            _fail("extract", "max_num_batched_tokens", self.max_num_batched_tokens,
                  "must be >= the longest sample (>= prepare.max_length), or null")
        if self.max_num_seqs < 1:
            _fail("extract", "max_num_seqs", self.max_num_seqs, "must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1 << 20:
            _fail("extract", "kv_cache_memory_bytes", self.kv_cache_memory_bytes,
                  "must be >= 1 MiB (e.g. 8589934592 for 8 GiB), or null to let vLLM profile")
        if self.cpu_kvcache_space_gib < 1:
            _fail("extract", "cpu_kvcache_space_gib", self.cpu_kvcache_space_gib, "must be >= 1 GiB")
        if not self.placement_timeout_s > 0:
            _fail("extract", "placement_timeout_s", self.placement_timeout_s, "must be > 0 seconds")
        if self.aux_hidden_state_layer_ids is not None and len(self.aux_hidden_state_layer_ids) < 1:
            _fail("extract", "aux_hidden_state_layer_ids", self.aux_hidden_state_layer_ids, "give at least one id or null")

    @property
    def per_gpu(self) -> int:
        """replicas_per_gpu as a number: 'auto' is 1 until the extract or regenerate stage resolves it
        (ray_jobs.extract.resolve_replicas_per_gpu), and stays 1 everywhere else."""
        return 1 if self.replicas_per_gpu == "auto" else self.replicas_per_gpu

    @property
    def engine_gpu_memory_utilization(self) -> float:
        """What each engine asks vLLM for: its share of the GPU's gpu_memory_utilization."""
        return self.gpu_memory_utilization / self.per_gpu

    def layer_ids(self, num_hidden_layers: int) -> list[int]:
        """All captured layer ids, ascending: the aux ids, then the last layer. Ascending because
        vLLM's extract_hidden_states fills its output slots in layer order, whatever order the
        config lists them in (0.26: the layer loop; 0.32: an explicit sort)."""
        n = num_hidden_layers
        aux = sorted(self.aux_hidden_state_layer_ids or (2, n // 2, n - 3))
        bad = [i for i in aux if not 0 <= i < n]
        if bad or len(set(aux)) != len(aux):
            raise ValueError(
                f"config extract.aux_hidden_state_layer_ids={aux}: ids must be distinct and in [0, {n - 1}] "
                f"for a target with num_hidden_layers={n}"
            )
        return aux + [n]


@dataclass(frozen=True)
class RegenerateConfig:
    """Optional stage between prepare and extract: the target rewrites every assistant turn of the
    prepared conversations with its own sampling, so the draft learns the target's text (on-policy
    data). Runs on extraction's replica layout (extract.num_replicas, tensor_parallel_size,
    pipeline_parallel_size, gpu_memory_utilization, cpu_kvcache_space_gib, placement_timeout_s).
    See eagle3/prepare/regenerate.py."""

    enabled: bool = False
    """Train on regenerated responses: the stage runs (or resumes) before extract whenever extract or
    regenerate is among the stages, and extract reads regenerated/tokens.parquet. A switch, not a
    stage name alone, so that which data a draft is trained on never depends on which stages one
    invocation reruns."""
    temperature: float | None = None
    """Sampling temperature; 0 = greedy (a draft for greedy serving). None: the target's
    generation_config.json, else 1.0 (the target's own distribution)."""
    top_p: float | None = None
    """Nucleus sampling, in (0, 1]. None: the target's generation_config.json, else 1.0."""
    max_tokens: int = 1024
    """Tokens generated per assistant turn at most; a turn that reaches it (or the context's end,
    prepare.max_length) is cut mid-answer: `cut` says what becomes of its conversation."""
    cut: RegenerateCut = "reject"
    """A conversation that cannot be regenerated whole (an answer cut by max_tokens or the context's
    end, or the regenerated conversation over prepare.max_length): 'reject' it, with the turn and
    the reason; or 'end' it there, keeping the turns before (and a cut answer as its last turn:
    what the target writes under this max_tokens), counted as num_ended_early. 'reject' is the
    default: every kept turn is an answer the target ended itself. 'end' is for a target that
    rarely ends a turn within max_tokens, whose data 'reject' would empty."""
    seed: int | None = 0
    """Each turn's sampling seed is derived from this, the sample id and the turn: the same text
    whatever the sharding, the batch or a resume. null: no per-turn seeds (the engine's own
    generator; not reproducible). vLLM's V2 model runner (0.26's default for dense models, and
    0.32's) samples every request with one kernel whose noise comes from (seed, position), seeded
    or not, so seeds cost nothing there; its V1 runner (0.26's MoE targets) draws each seeded
    request's noise one request after another in every step (benchmarks/regen_bench.py measures)."""
    samples_per_shard: int = 256
    """Conversations per shard: the unit committed exactly once (when all its conversations are
    done). A replica generates several shards at once (ray_jobs.regenerate.INFLIGHT_PER_REPLICA),
    their turns sharing its engine, so a shard smaller than max_num_seqs still fills it."""
    max_num_seqs: int = 256
    """vLLM's limit on sequences decoded together."""
    enforce_eager: Literal["auto", True, False] = "auto"
    """'auto': CUDA graphs on a GPU, which decoding (unlike extraction's prefill) gains much from, and
    eager on the CPU (no graphs there; torch.compile's warm-up costs a CPU engine ~60 s of start,
    more than a small job's whole generation gains). true / false: eager / compiled everywhere."""

    def __post_init__(self):
        check_types(self, "regenerate")
        if self.temperature is not None and self.temperature < 0:
            _fail("regenerate", "temperature", self.temperature, "must be >= 0 (0 = greedy), or null")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            _fail("regenerate", "top_p", self.top_p, "must be in (0, 1], or null")
        for name in ("max_tokens", "samples_per_shard", "max_num_seqs"):
            if getattr(self, name) < 1:
                _fail("regenerate", name, getattr(self, name), "must be >= 1")


@dataclass(frozen=True)
class EvalConfig:
    """The exported draft inside vLLM speculative decoding (eagle3.evaluate): acceptance length at
    each num_speculative_tokens, greedy and at the served sampling (the regeneration's resolved
    regenerate.temperature/top_p: the target's generation_config.json where null), and decode
    output tokens/s with and without the draft at speed_batch_sizes. Engines: one per
    num_speculative_tokens (speed_k's also times the windows), plus the target alone when speed is
    measured. The timed windows are derived from the platform (eagle3.evaluate.speed_windows:
    longer on a GPU, each timed several times; eval.json states them and whether each speedup
    exceeds the spread of its windows)."""

    num_speculative_tokens: tuple[int, ...] = (3,)
    """One engine per value; acceptance length = mean tokens accepted per verification step + 1.
    Each engine costs a start (~25-50 s on the CPU, ~20-70 s on a GPU): 3 alone by default, whose
    acceptance per draft position also gives k=1 and 2 (eval.json's acceptance_length_prefix: the
    acceptance length had the draft stopped after 1 or 2 tokens of the same verification steps);
    list more values (up to 5) to measure each k in an engine of its own."""
    speed_k: int | None = None
    """num_speculative_tokens of the one draft engine whose decode tokens/s is timed against the
    target alone's; must be listed in num_speculative_tokens. None: 3 if listed, else the largest
    listed. 3 because an EAGLE-3 draft's acceptance length mostly saturates by then while a
    verification step still costs little more than k=1's, which is why vLLM's and speculators'
    EAGLE-3 examples serve with it (a larger k pays at batch 1 and costs at large batches: time
    both to choose). Throughput at one k keeps the stage to one extra engine (the baseline)."""
    speed_batch_sizes: tuple[int, ...] = (1, 16)
    """Batch sizes the decode speedup is timed at (requests decoded together; batch 1 is one
    user's latency, a larger one a loaded server's). Empty: no throughput, no baseline engine."""
    enforce_eager: Literal["auto", True, False] = "auto"
    """Of the speed_k and baseline engines: 'auto' = CUDA graphs on a GPU (as `vllm serve` runs:
    the figure a user gets) and eager on the CPU (no graphs there). true: eager everywhere (starts
    faster, decodes slower on a GPU). Engines that only measure acceptance always run eager:
    acceptance does not depend on graphs, and eager starts faster."""
    engines_at_once: Literal["auto", True, False] = "auto"
    """Whether the engines start side by side, each on its share of the device, their acceptance then
    measured side by side and their timed windows taken in turns: their starts overlap (~70 s each
    with CUDA graphs on an H200, for a 135M target: the SmolLM2 job's eval stage took 144 s, session
    22), and the draft's
    engine and the target alone's take turns at the timed windows, round by round, so that eval.json
    pairs each round with the draft with the same round without it. 'auto': true for a small target on a GPU (extraction's rule for
    several replicas a GPU, ray_jobs.extract.small_target: under 0.5B parameters, engines of one
    GPU), each engine with its share of extract.gpu_memory_utilization and a KV cache of
    extract.kv_cache_memory_bytes (4 GiB where null); false elsewhere. false: one engine at a time,
    the device to itself."""
    start_during_training: Literal["auto", True, False] = "auto"
    """Start the eval's engines while the draft trains, from a provisional export of it (the trainer
    writes it once set up, under train/provisional_draft), and load the trained weights into them in
    place when training ends (compat.draft_reload): the engines' start (~75 s on an H100 for a 135M
    target, session 32) overlaps training instead of following it. The training workers then take
    1 - EVAL_GPU_RESERVE of their GPU and the engines share the rest. 'auto': on where the engines
    start side by side (engines_at_once: a small target on a GPU), training is offline, in this job,
    on one worker; false elsewhere. true where that cannot work (online training, several workers on
    GPUs) stops the job at its start, with the reason. An engine that refuses the trained weights (compat.draft_reload)
    is started again from them. Its figures are the same either way: no timing runs during training."""
    speed_repeats: int | None = None
    """Rounds each timed engine decodes every window, fixed before timing. None: 3 on a GPU, 2 on
    the CPU."""
    num_prompts: int = 16
    """Held-out prompts (prepare.num_eval_prompts holds the first good records out of training); the
    acceptance runs all of them, and the timed windows decode them (eagle3.evaluate.speed_windows)."""
    max_tokens: int = 64
    """Tokens generated per prompt for acceptance, at most (exactly, with ignore_eos)."""
    ignore_eos: bool = False
    """Acceptance runs: false = each answer ends where the target ends it (its EOS, or max_tokens),
    as `vllm serve` answers a user; true = exactly max_tokens tokens, past the end of the turn, text
    no user is served. The timed windows always end at EOS."""
    seed: int = 0
    """Sampled acceptance: request i's seed is seed + i (repeatable). Timed windows sample
    unseeded, as served requests do."""
    enabled: bool = True
    """False: no eval engines start; the job ends with the exported draft."""

    def __post_init__(self):
        check_types(self, "eval")
        if not self.num_speculative_tokens or min(self.num_speculative_tokens) < 1:
            _fail("eval", "num_speculative_tokens", list(self.num_speculative_tokens),
                  "give at least one value, each >= 1, e.g. [1, 3]")
        if len(set(self.num_speculative_tokens)) != len(self.num_speculative_tokens):
            _fail("eval", "num_speculative_tokens", list(self.num_speculative_tokens),
                  "list each value once (one engine per value)")
        if self.speed_k is not None and self.speed_k not in self.num_speculative_tokens:
            _fail("eval", "speed_k", self.speed_k,
                  f"must be one of eval.num_speculative_tokens={list(self.num_speculative_tokens)} (its engine "
                  "times the decode speed); add it there, pick a listed value, or null (3 if listed, else the largest)")
        if any(b < 1 for b in self.speed_batch_sizes) or len(set(self.speed_batch_sizes)) != len(self.speed_batch_sizes):
            _fail("eval", "speed_batch_sizes", list(self.speed_batch_sizes),
                  "give distinct batch sizes, each >= 1, e.g. [1, 16]; or [] for no throughput")
        if self.speed_repeats is not None and self.speed_repeats < 1:
            _fail("eval", "speed_repeats", self.speed_repeats, "must be >= 1 rounds, or null (3 on a GPU, 2 on the CPU)")
        if self.num_prompts < 1:
            _fail("eval", "num_prompts", self.num_prompts, "must be >= 1 (or eval.enabled: false)")
        if self.max_tokens < 1:
            _fail("eval", "max_tokens", self.max_tokens, "must be >= 1")

    @property
    def resolved_speed_k(self) -> int | None:
        """The k whose engine times decode speed (speed_k, derived where null); None when
        speed_batch_sizes is empty."""
        if not self.speed_batch_sizes:
            return None
        if self.speed_k is not None:
            return self.speed_k
        return 3 if 3 in self.num_speculative_tokens else max(self.num_speculative_tokens)


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None
    """None: join the cluster this job was submitted to, else start a local one."""
    num_cpus: int | None = None
    """Only for a local cluster started by the job."""
    dashboard_host: str = "127.0.0.1"
    """Only for a local cluster started by the job: the address its dashboard and job server
    (ray job submit) listen on. Loopback by default: anyone who reaches them can run code on
    the cluster. "0.0.0.0" serves every interface (then keep Ray's token authentication on)."""

    def __post_init__(self):
        check_types(self, "ray")
        if not self.dashboard_host.strip():
            _fail("ray", "dashboard_host", self.dashboard_host,
                  "must be an address to listen on: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
        if self.num_cpus is not None and self.num_cpus < 1:
            _fail("ray", "num_cpus", self.num_cpus, "must be >= 1, or null (all of this machine's)")


@dataclass(frozen=True)
class JobConfig:
    output_dir: str = "runs/demo"
    """Where every stage writes (target/, prepared/, hidden_states/, train/, draft/, eval.json, report.json);
    a resubmitted job with the same output_dir resumes from what is committed there."""
    target: TargetConfig = field(default_factory=TargetConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    doctor: bool = True
    """Run ray_jobs.doctor's checks (versions, seams, GPUs, disk, a 2-layer dry run) before any
    weights load; the job stops on a failed check."""
    stages: tuple[Stage, ...] = ("prepare", "extract", "train", "export", "eval")
    """Which stages run; each reuses the committed outputs of earlier ones."""
    cache_dir: str | None = "~/.cache/eagle3/compile"
    """Compile caches of every engine and training worker of the job: vLLM's (VLLM_CACHE_ROOT =
    <it>/vllm), inductor's (TORCHINDUCTOR_CACHE_DIR = <it>/inductor) and Triton's (TRITON_CACHE_DIR =
    <it>/triton), set in the job's runtime env before any worker imports them, so that later engines
    and a resubmitted job load what the first one compiled (vLLM keeps the inductor and Triton files
    of its own graphs under <it>/vllm; inductor/ and triton/ serve the trainer's torch.compile). A path
    valid on every node ('~': the driver's home); null: each library's own default (which a
    container that starts afresh loses)."""

    def __post_init__(self):
        check_types(self, "")
        self._check_across_stages()

    @property
    def train_config(self) -> TrainConfig:
        """train as the job trains with it: train.heldout_first_tokens null becomes eval.max_tokens, so
        that the held-out accuracy beside vLLM's acceptance counts answers of the same length."""
        if self.train.heldout_first_tokens is not None:
            return self.train
        return dataclasses.replace(self.train, heldout_first_tokens=self.eval.max_tokens)

    def _check_across_stages(self) -> None:
        """Limits between sections, which each engine would otherwise find only when it starts."""
        p, e, t, ev = self.prepare, self.extract, self.train, self.eval
        # Chunked prefill is off for extraction (compat.vllm_engine), so every sample prepare lets
        # through must fit one scheduler step; a target whose max_position_embeddings is shorter
        # still needs prepare.max_length lowered to it, or its long samples are rejected at extraction.
        # The step holds the sample and the prefill's one output token (compat.vllm_engine.prefill_max_model_len).
        if e.max_num_batched_tokens is not None and e.max_num_batched_tokens <= p.max_length:
            _fail("extract", "max_num_batched_tokens", e.max_num_batched_tokens,
                  f"must be > prepare.max_length={p.max_length} (chunked prefill is off for extraction: each "
                  "sample and its one prefill output token must fit one step); raise it, lower "
                  "prepare.max_length, or use null (max(8192, max_length + 1))")
        # Samples of up to prepare.max_length tokens would be cut in training; prepare rejects
        # over-long samples rather than truncate them, so training must not truncate either.
        if "train" in self.stages and t.data.micro_batch_tokens < p.max_length:
            _fail("train", "data.micro_batch_tokens", t.data.micro_batch_tokens,
                  f"must be >= prepare.max_length={p.max_length}, or samples would be truncated in training; "
                  "raise it or lower prepare.max_length")
        if "regenerate" in self.stages and not self.regenerate.enabled:
            _fail("job", "stages", list(self.stages), "lists regenerate but regenerate.enabled is false; set "
                  "regenerate.enabled: true (extract then trains on the regenerated responses), or drop the stage")
        if "train" in self.stages and t.source == "online" and e.per_gpu > 1:
            _fail("extract", "replicas_per_gpu", e.replicas_per_gpu, "is for the extract stage; online training "
                  "places its replicas by train.online.gpu_split: use 1 with train.source online")
        if "train" in self.stages and t.source == "online" and t.online.gpu_split == "shared":
            check_gpu_sharing(e, t)  # 'auto' becomes 'shared' only on a cluster: checked there (ray_jobs.online)
        if "eval" in self.stages and ev.enabled and ev.num_prompts > p.num_eval_prompts:
            _fail("eval", "num_prompts", ev.num_prompts,
                  f"only prepare.num_eval_prompts={p.num_eval_prompts} prompts are held out for eval; raise "
                  "prepare.num_eval_prompts, lower eval.num_prompts, or set eval.enabled: false")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_gpu_sharing(e: ExtractConfig, t: TrainConfig) -> None:
    """Online mode, engine and trainer sharing each GPU (train.online.gpu_split): what fits on one
    GPU, checked before any engine starts. ValueError naming the fields otherwise."""
    per = e.tensor_parallel_size * e.pipeline_parallel_size
    if per > 1:
        # Ray's fractional GPU resources are shares of one GPU: a replica over several GPUs cannot take a share.
        _fail("train", "online.gpu_split", "shared", f"needs engine replicas of one GPU, found "
              f"extract.tensor_parallel_size * pipeline_parallel_size = {e.tensor_parallel_size} * "
              f"{e.pipeline_parallel_size}; use 1 * 1, or gpu_split: separate on a cluster with GPUs for both")
    frac = t.online.trainer_gpu_fraction
    if e.gpu_memory_utilization + frac > 1 + 1e-9:
        _fail("extract", "gpu_memory_utilization", e.gpu_memory_utilization,
              f"leaves the training worker sharing its GPU (train.online.gpu_split: shared) less than "
              f"train.online.trainer_gpu_fraction={frac}: the two must sum to <= 1; set "
              f"extract.gpu_memory_utilization <= {1 - frac:.2f} or lower trainer_gpu_fraction")


def _sections(cls) -> dict[str, type]:
    """The fields of `cls` whose hint is a config dataclass (its sections), by name."""
    return {name: hint for name, hint in field_hints(cls).items()
            if isinstance(hint, type) and dataclasses.is_dataclass(hint)}


def config_from_dict(cls, data: Any, where: str = ""):
    """The config dataclass `cls` from a mapping, `where` being its dotted name in error messages
    ("train" for a TrainConfig); a field whose hint is a config dataclass is a section, built the
    same way. Types, ranges and cross-stage limits are checked by the dataclasses' own
    __post_init__ (eagle3.typed_config.check_types first). A key of a section's section given one
    level up (`train.lr`, now `train.optimizer.lr`) is refused with where it belongs."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"config {where or 'file'}: expected a mapping, found {type(data).__name__} {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known), key=str)
    if unknown:
        at = f"{where}." if where else ""
        moved = [f"{at}{k} is now {at}{s}.{k}" for k in unknown
                 for s, sub in _sections(cls).items() if k in {f.name for f in fields(sub)}]
        if moved:
            raise ValueError(f"config {where or 'file'}: {'; '.join(moved)} (keys grouped by concern); "
                             "move each under its section")
        raise ValueError(f"config {where or 'file'}: unknown keys {unknown}; known: {sorted(known)}")
    sections = _sections(cls)
    kwargs = {}
    for name, value in data.items():
        if name in sections:
            kwargs[name] = config_from_dict(sections[name], value, f"{where}.{name}" if where else name)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def job_config_from_dict(data: dict) -> JobConfig:
    return config_from_dict(JobConfig, data, "")


def load_job_config(path: str | Path | None, overrides: dict | None = None) -> JobConfig:
    """Read a YAML or JSON job config (None: all defaults, i.e. the demo) with optional overrides
    given as {"section.key": value}."""
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        if str(path).endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            if node.get(p) is None:  # absent, or `train:` with nothing under it in the file
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ValueError(f"config override {dotted}={value!r}: {'.'.join(parents[: i + 1])} is {node!r}, "
                                 "not a section; override a key inside a section, e.g. train.optimizer.lr=0.001")
        node[leaf] = value
    # Overrides land in the same mapping as the file's keys, so they pass the same checks.
    return job_config_from_dict(data)
