"""Extract-stage config (`extract:` in a job file; consumed by eagle3.extract.extractor,
ray_jobs/extract.py, and by the regenerate stage and online mode, which run their engines on the
same replica layout).

Owns: the engine replicas' layout and vLLM settings, the shard files' format, and their checks.
Does not own: limits against other stages (eagle3.config.JobConfig) or what "auto" resolves to on
a cluster (ray_jobs.extract.resolve_replicas_per_gpu). Imports neither torch nor vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eagle3.typed_config import check_types, fail

HsDtype = Literal["bfloat16", "float8_e4m3fn"]
FileFormat = Literal["arrow", "parquet"]
Compression = Literal["zstd", "lz4", "snappy", "gzip"]
ARROW_CODECS = ("zstd", "lz4")  # Arrow IPC compresses buffers with these two only
ExtractBackend = Literal["vllm", "hf"]
Sink = Literal["auto", "memory", "shm"]


@dataclass(frozen=True)
class ExtractConfig:
    """vLLM engines that capture EAGLE-3 hidden states and write them as Arrow shards."""

    aux_hidden_state_layer_ids: tuple[int, ...] | None = None
    """EAGLE-3 auxiliary layers (id k = residual stream after k decoder layers). None: (2, n // 2,
    n - 3) of the target's n layers. The last layer (id n) is always captured too: the training target."""
    num_replicas: int | None = None
    """Engine replicas. None: as many as the cluster's GPUs allow (1 on a CPU-only cluster)."""
    tensor_parallel_size: int = 1
    """GPUs per engine replica, inside one node (vLLM's tensor parallelism): for a target that does
    not fit one GPU."""
    pipeline_parallel_size: int = 1
    """Pipeline stages per engine replica (vLLM's); a replica takes tensor_parallel_size * this GPUs."""
    replicas_per_gpu: int | Literal["auto"] = "auto"
    """Engine replicas sharing each GPU (a 1/n Ray share, gpu_memory_utilization / n each), for a small
    target one engine cannot keep busy; one-GPU replicas only. "auto": 4 for a target under 0.5B
    parameters on a GPU cluster, else 1; regenerate follows it; the log says what it chose and why."""
    samples_per_shard: int = 256
    """Samples per shard at most: the unit handed to a replica and committed to the manifest. Smaller:
    finer resume and balance; larger: fewer files (shard_bytes may lower it)."""
    shard_bytes: int = 1 << 30
    """Bound on a shard's hidden-state bytes (from the mean sample length): a shard is held in pinned
    host memory and the object store up to max_inflight_shards times per replica. 0: no bound."""
    hs_dtype: HsDtype = "bfloat16"
    """Storage of hidden states: bfloat16 (lossless) or float8_e4m3fn (per-token scale, half the bytes)."""
    file_format: FileFormat = "arrow"
    """'arrow' (Arrow IPC: memory-mapped by the trainer, written at near disk speed) or 'parquet'
    (smaller with compression, slower to write). See eagle3/extract/shards.py."""
    direct_io: bool = True
    """Write Arrow shards with O_DIRECT (near the disk's raw bandwidth), buffered where the file system
    refuses it. false: always buffered (e.g. a network file system whose O_DIRECT path is slow)."""
    compression: Compression | None = None
    """None, or a codec: 'lz4'/'zstd' (both formats), 'snappy'/'gzip' (Parquet only). Hidden states are
    noisy floats: little gain for much CPU."""
    max_num_batched_tokens: int | None = None
    """vLLM scheduler budget per step; None = max(8192, prepare.max_length + 1). Must exceed the longest
    sample: chunked prefill is off for extraction."""
    max_num_seqs: int = 256
    """vLLM's limit on sequences in one step."""
    gpu_memory_utilization: float = 0.85
    """Fraction of each GPU's memory vLLM may take (weights, activations, KV cache), in (0, 1]. With
    train.online.gpu_split shared: at most 1 - train.online.trainer_gpu_fraction."""
    kv_cache_memory_bytes: int | None = None
    """Each engine's KV cache in bytes, set instead of profiled. None: vLLM profiles the free memory. Set
    it where several engines start at once on one GPU (profiling misreads the others' memory); extraction
    is prefill-only and needs little. Shared-GPU online training and auto replicas_per_gpu use 4 GiB."""
    enforce_eager: bool = True
    """Skip CUDA graph / torch.compile warm-up: extraction is prefill-only, so graphs buy little."""
    block_size: int | None = None
    """KV cache block size in tokens (vLLM's), a multiple of 16; None: vLLM's default. Larger: less
    per-request host work with a KV connector (benchmarks/extract_bench.py --block-size measures it)."""
    cpu_kvcache_space_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE on CPU-only engines (vLLM's default takes most of the NUMA node)."""
    backend: ExtractBackend = "vllm"
    """'vllm' (the product) or 'hf' (transformers forward: the reference, and for CPU tests of the
    orchestration without an engine start)."""
    sink: Sink = "auto"
    """How hidden states leave the engine: 'memory' (in-process, no files; needs tp*pp == 1), 'shm'
    (files in /dev/shm, deleted as soon as read), 'auto'."""
    max_inflight_shards: int = 3
    """Per replica: shards handed out but not yet written. More overlaps engine calls and writes
    better; each costs a shard of object-store memory per replica."""
    placement_timeout_s: float = 600.0
    """Seconds to wait for GPUs before failing with what to check."""
    load_format: str = "auto"
    """vLLM load_format; 'dummy' gives random weights of the target's shape (benchmarks only)."""

    def __post_init__(self):
        check_types(self, "extract")
        if self.file_format == "arrow" and self.compression not in (None, *ARROW_CODECS):
            fail("extract", "compression", self.compression,
                 f"use one of {[None, *ARROW_CODECS]} with arrow files (snappy and gzip are Parquet only)")
        if self.block_size is not None and (self.block_size < 16 or self.block_size % 16):
            fail("extract", "block_size", self.block_size, "use a multiple of 16 (the attention kernels' unit), or null")
        if self.samples_per_shard < 1:
            fail("extract", "samples_per_shard", self.samples_per_shard, "must be >= 1")
        if self.shard_bytes < 0:
            fail("extract", "shard_bytes", self.shard_bytes, "must be >= 0 (0: no bound)")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                fail("extract", name, getattr(self, name), "must be >= 1 (GPUs per engine replica along this axis)")
        if self.sink == "memory" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            # The memory sink hands tensors over inside the engine's process; tp*pp > 1 runs the model in
            # other processes (eagle3.extract.extractor.VLLMBackend refuses it at engine start).
            fail("extract", "sink", self.sink, f"'memory' needs tensor_parallel_size * pipeline_parallel_size == 1, "
                 f"found {self.tensor_parallel_size} * {self.pipeline_parallel_size}; use 'shm' or 'auto'")
        if self.per_gpu < 1:
            fail("extract", "replicas_per_gpu", self.replicas_per_gpu, "must be >= 1 (1: each replica has whole GPUs), "
                 "or 'auto'")
        if self.per_gpu > 1 and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            fail("extract", "replicas_per_gpu", self.replicas_per_gpu,
                 f"needs engine replicas of one GPU, found tensor_parallel_size * pipeline_parallel_size = "
                 f"{self.tensor_parallel_size} * {self.pipeline_parallel_size}; use 1, or replicas of one GPU")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            fail("extract", "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be >= 1 byte, or null (profiled)")
        if self.num_replicas is not None and self.num_replicas < 1:
            fail("extract", "num_replicas", self.num_replicas, "must be >= 1, or null (as many as the GPUs allow)")
        if self.max_inflight_shards < 1:
            # 0 would hand out no shard at all: the job would wait forever with engines up.
            fail("extract", "max_inflight_shards", self.max_inflight_shards, "must be >= 1 (3 overlaps engine and writes)")
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("extract", "gpu_memory_utilization", self.gpu_memory_utilization,
                 "must be in (0, 1]: the fraction of each GPU's memory vLLM may take")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            fail("extract", "max_num_batched_tokens", self.max_num_batched_tokens,
                 "must be >= the longest sample (>= prepare.max_length), or null")
        if self.max_num_seqs < 1:
            fail("extract", "max_num_seqs", self.max_num_seqs, "must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1 << 20:
            fail("extract", "kv_cache_memory_bytes", self.kv_cache_memory_bytes,
                 "must be >= 1 MiB (e.g. 8589934592 for 8 GiB), or null to let vLLM profile")
        if self.cpu_kvcache_space_gib < 1:
            fail("extract", "cpu_kvcache_space_gib", self.cpu_kvcache_space_gib, "must be >= 1 GiB")
        if not self.placement_timeout_s > 0:
            fail("extract", "placement_timeout_s", self.placement_timeout_s, "must be > 0 seconds")
        if self.aux_hidden_state_layer_ids is not None and len(self.aux_hidden_state_layer_ids) < 1:
            fail("extract", "aux_hidden_state_layer_ids", self.aux_hidden_state_layer_ids, "give at least one id or null")

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
