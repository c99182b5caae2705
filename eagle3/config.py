"""Job configuration: one frozen dataclass per stage, strict YAML/JSON loading.

Owns: the shape of a job config file, validation with errors that name the field, the
value and the fix, and the derived settings (aux layer ids from num_hidden_layers).
Imports neither torch nor vllm: drivers load configs before any heavy import.
The training stage's dataclass lives in `eagle3.train_config` (its consumer) and is
composed here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from eagle3.train_config import TrainConfig


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
    tiny_pretrain_steps: int = 100
    """Next-token steps on the conversations for the tiny target (~40 s on 2 cores), so its greedy
    text resembles them and acceptance length means something; 0 = random weights."""
    trust_remote_code: bool = False
    """Off unless set: a target's own Python code runs in every engine process when on."""
    dtype: str = "bfloat16"
    """Engine dtype. Hidden states are stored in bf16 (or fp8) whatever this is."""

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float16", "float32"):
            _fail("target", "dtype", self.dtype, "use bfloat16, float16 or float32")


@dataclass(frozen=True)
class PrepareConfig:
    """Conversations -> chat template -> input_ids + loss_mask (Arrow)."""

    conversations: str = "data/demo_conversations.jsonl"
    """JSONL file (or directory of them): OpenAI `messages` or ShareGPT `conversations` records."""
    max_length: int = 2048
    """Samples with more tokens go to rejects.jsonl with their reason; nothing is truncated."""
    max_samples: int | None = None
    """Take at most this many records (in file order); None = all."""
    assistant_only_loss: bool = True
    """loss_mask = 1 on assistant tokens only; False trains on every token."""
    num_eval_prompts: int = 16
    """The first N good records are held out of training: their prompts (up to the first
    assistant turn) go to eval_prompts.jsonl for the acceptance-length evaluation."""

    def __post_init__(self):
        if self.max_length < 8:
            _fail("prepare", "max_length", self.max_length, "must be >= 8 tokens")
        if self.num_eval_prompts < 0:
            _fail("prepare", "num_eval_prompts", self.num_eval_prompts, "must be >= 0")
        if self.max_samples is not None and self.max_samples < 1:
            _fail("prepare", "max_samples", self.max_samples, "must be >= 1 or null")


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
    pipeline_parallel_size: int = 1
    samples_per_shard: int = 256
    """Unit of work handed out to replicas and committed to the manifest (at most this many
    samples; shard_bytes may lower it)."""
    shard_bytes: int = 1 << 30
    """Bound on a shard's hidden-state bytes, estimated from the mean sample length and the
    stored bytes per token: samples_per_shard is lowered to fit (at least 1 sample). A shard's
    table sits in pinned host memory and in the object store up to max_inflight_shards times per
    replica: 256 samples of 4K tokens of a hidden-7168 target would be 60 GB. 0: no bound."""
    hs_dtype: str = "bfloat16"
    """Storage of hidden states: bfloat16 (lossless) or float8_e4m3fn (per-token scale, half the bytes)."""
    file_format: str = "arrow"
    """Shard files: 'arrow' (Arrow IPC, memory-mapped by the trainer, written at near disk speed)
    or 'parquet' (smaller with compression, ~3x slower to write). See eagle3/shards.py."""
    direct_io: bool = True
    """Write Arrow shards with O_DIRECT (near the disk's raw bandwidth; buffered writes + fsync
    measured 0.2-0.5x of it), falling back to buffered writes where the file system refuses it.
    false: always buffered (e.g. a network file system whose O_DIRECT path is slow)."""
    compression: str | None = None
    """None, or a codec: 'lz4'/'zstd' (both formats), 'snappy'/'gzip' (Parquet only). Hidden
    states are noisy floats: expect little gain for much CPU."""
    max_num_batched_tokens: int | None = None
    """vLLM scheduler budget; None = max(8192, prepare.max_length). Must be >= the longest sample,
    since chunked prefill is off for extraction."""
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.85
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
    backend: str = "vllm"
    """'vllm' (the product) or 'hf' (transformers forward: the reference, and for CPU tests of the
    orchestration without an engine start)."""
    sink: str = "auto"
    """How hidden states leave the engine: 'memory' (in-process, no files; needs an in-process
    engine, i.e. tp*pp == 1), 'shm' (files in /dev/shm, deleted as soon as read), 'auto'."""
    max_inflight_shards: int = 3
    """Per replica: shards handed out but not yet written. Bounds object-store memory
    (about this many shards of hidden states per replica) and sets how many writer tasks
    and engine calls overlap."""
    placement_timeout_s: float = 600.0
    """How long to wait for GPUs before failing with what to check."""
    load_format: str = "auto"
    """vLLM load_format; 'dummy' gives random weights of the target's shape (benchmarks only)."""

    def __post_init__(self):
        if self.hs_dtype not in ("bfloat16", "float8_e4m3fn"):
            _fail("extract", "hs_dtype", self.hs_dtype, "use bfloat16 or float8_e4m3fn")
        if self.file_format not in ("arrow", "parquet"):
            _fail("extract", "file_format", self.file_format, "use arrow or parquet")
        codecs = (None, "zstd", "lz4") if self.file_format == "arrow" else (None, "zstd", "lz4", "snappy", "gzip")
        if self.compression not in codecs:
            _fail("extract", "compression", self.compression, f"use one of {list(codecs)} with {self.file_format} files")
        if self.backend not in ("vllm", "hf"):
            _fail("extract", "backend", self.backend, "use vllm or hf")
        if self.sink not in ("auto", "memory", "shm"):
            _fail("extract", "sink", self.sink, "use auto, memory or shm")
        if self.block_size is not None and (self.block_size < 16 or self.block_size % 16):
            _fail("extract", "block_size", self.block_size, "use a multiple of 16 (the attention kernels' unit), or null")
        if self.samples_per_shard < 1:
            _fail("extract", "samples_per_shard", self.samples_per_shard, "must be >= 1")
        if self.shard_bytes < 0:
            _fail("extract", "shard_bytes", self.shard_bytes, "must be >= 0 (0: no bound)")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            _fail("extract", "tensor_parallel_size", self.tensor_parallel_size, "sizes must be >= 1")
        if self.aux_hidden_state_layer_ids is not None and len(self.aux_hidden_state_layer_ids) < 1:
            _fail("extract", "aux_hidden_state_layer_ids", self.aux_hidden_state_layer_ids, "give at least one id or null")

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
class EvalConfig:
    """Acceptance length of the exported draft, measured inside vLLM speculative decoding."""

    num_speculative_tokens: tuple[int, ...] = (1, 2, 3, 4, 5)
    """One engine per value; acceptance length = mean tokens accepted per verification step + 1."""
    num_prompts: int = 16
    """Held-out prompts (the last records of the conversation file not used for training)."""
    max_tokens: int = 64
    enabled: bool = True


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None
    """None: join the cluster this job was submitted to, else start a local one."""
    num_cpus: int | None = None
    """Only for a local cluster started by the job."""


@dataclass(frozen=True)
class JobConfig:
    output_dir: str = "runs/demo"
    target: TargetConfig = field(default_factory=TargetConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    doctor: bool = True
    """Run ray_jobs.doctor's checks (versions, seams, GPUs, disk, a 2-layer dry run) before any
    weights load; the job stops on a failed check."""
    stages: tuple[str, ...] = ("prepare", "extract", "train", "export", "eval")
    """Which stages run; each reuses the committed outputs of earlier ones."""

    def __post_init__(self):
        allowed = ("prepare", "extract", "train", "export", "eval")
        bad = [s for s in self.stages if s not in allowed]
        if bad:
            _fail("job", "stages", list(self.stages), f"unknown stages {bad}; allowed: {list(allowed)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, data: Any, where: str):
    if not dataclasses.is_dataclass(cls):
        return data
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"config {where}: expected a mapping, found {type(data).__name__} {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"config {where}: unknown keys {unknown}; known: {sorted(known)}")
    kwargs = {}
    hints = {f.name: f.type for f in fields(cls)}
    for name, value in data.items():
        sub = _SECTIONS.get((cls, name))
        if sub is not None:
            kwargs[name] = _build(sub, value, f"{where}.{name}" if where else name)
        elif isinstance(value, list) and "tuple" in str(hints[name]):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"config {where}: {e}") from None


_SECTIONS = {(JobConfig, n): t for n, t in [("target", TargetConfig), ("prepare", PrepareConfig),
                                            ("extract", ExtractConfig), ("train", TrainConfig),
                                            ("eval", EvalConfig), ("ray", RayConfig)]}


def job_config_from_dict(data: dict) -> JobConfig:
    return _build(JobConfig, data, "")


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
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return job_config_from_dict(data)
