"""Prepare-stage configs: `prepare:` (conversations -> tokens, eagle3.prepare.tokens) and
`regenerate:` (the target rewrites the answers, eagle3.prepare.regenerate), in a job file.

Owns: their fields and checks. Does not own: limits against other stages (eagle3.config.JobConfig).
Imports neither torch nor vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from eagle3.typed_config import check_types, fail

OverLength = Literal["truncate", "reject"]
LeadingAssistant = Literal["reject", "drop"]
RegenerateCut = Literal["reject", "end"]


@dataclass(frozen=True)
class PrepareConfig:
    """Conversations -> chat template -> input_ids + loss_mask (Arrow)."""

    conversations: str
    """Required. OpenAI `messages` or ShareGPT `conversations` records: a JSONL, JSON array, Parquet or Arrow file,
    a directory of those (name order), or a `datasets.save_to_disk` directory. Read where the driver runs."""
    max_length: int = 2048
    """Tokens per sample at most; over_length says what happens to a conversation that has more."""
    over_length: OverLength = "truncate"
    """'truncate' (default): keep the assistant turns that fit, whole; their tokens and hidden states are
    those of the full conversation (attention is causal), so nothing false is taught and less is lost.
    'reject': drop such a conversation whole. A turn is never cut inside."""
    max_samples: int | None = None
    """Take at most this many records (in file order); None = all."""
    leading_assistant: LeadingAssistant = "reject"
    """A conversation whose first non-system turn is the assistant's (it answers no user turn): 'reject'
    it, or 'drop' those leading turns and keep the rest (as FastChat-style trainers do for split chunks)."""
    assistant_only_loss: bool = True
    """loss_mask = 1 on assistant tokens only (the draft predicts the target's answers); False trains
    on every token."""
    num_eval_prompts: int = 96
    """The first N good records are held out of training: their prompts go to eval_prompts.jsonl for
    vLLM's evaluation (the first eval.num_prompts) and the choice of the draft to export (the next
    eval.select_num_prompts)."""
    heldout_fraction: float = 0.02
    """Fraction of conversations held out of training, in [0, 0.5], for the trainer's held-out accuracy
    every train.eval_every_steps (a hash of the conversation id decides: stable across runs). 0: none."""
    heldout_min_conversations: int = 8
    """With heldout_fraction > 0: hold out at least this many conversations (at most half), so a small
    data set still has a split."""
    num_workers: int | None = None
    """Ray tasks (1 CPU each) that tokenize chunks of records at once; None = the cluster's CPUs. The
    output is the same for any value."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra chat-template variables, as the target is served with them (vLLM's chat_template_kwargs),
    e.g. {enable_thinking: false}: then reasoning in the records is removed, as the target never writes it."""

    def __post_init__(self):
        check_types(self, "prepare")
        if not self.conversations.strip():
            fail("prepare", "conversations", self.conversations, "must name a file or directory of conversations")
        if self.max_length < 8:
            fail("prepare", "max_length", self.max_length, "must be >= 8 tokens")
        if self.num_eval_prompts < 0:
            fail("prepare", "num_eval_prompts", self.num_eval_prompts, "must be >= 0")
        if self.max_samples is not None and self.max_samples < 1:
            fail("prepare", "max_samples", self.max_samples, "must be >= 1 or null")
        if not 0 <= self.heldout_fraction <= 0.5:
            fail("prepare", "heldout_fraction", self.heldout_fraction,
                 "must be in [0, 0.5] (0.02 = 2% of the conversations held out of training; 0 = none)")
        if self.heldout_min_conversations < 0:
            fail("prepare", "heldout_min_conversations", self.heldout_min_conversations, "must be >= 0")
        if self.num_workers is not None and self.num_workers < 1:
            fail("prepare", "num_workers", self.num_workers, "must be >= 1, or null for the cluster's CPUs")


@dataclass(frozen=True)
class RegenerateConfig:
    """Optional stage between prepare and extract: the target rewrites every assistant turn of the
    prepared conversations with its own sampling, so the draft learns the target's text (on-policy
    data). Runs on extraction's replica layout (extract.num_replicas, tensor_parallel_size,
    pipeline_parallel_size, gpu_memory_utilization, cpu_kvcache_space_gib, placement_timeout_s).
    See eagle3/prepare/regenerate.py."""

    enabled: bool | None = None
    """Train on regenerated responses: the stage runs before extract whenever extract or regenerate runs.
    A switch, not a stage name, so which data a draft learns never depends on which stages are rerun.
    None: on, except for target.model: tiny (a test fixture whose sampled text teaches nothing)."""
    temperature: float | None = None
    """Sampling temperature; 0 = greedy (a draft for greedy serving). None: the target's
    generation_config.json, else 1.0 (the target's own distribution)."""
    top_p: float | None = None
    """Nucleus sampling, in (0, 1]. None: the target's generation_config.json, else 1.0."""
    max_tokens: int = 1024
    """Tokens generated per assistant turn at most; a turn that reaches it (or prepare.max_length) is
    cut mid-answer, and `cut` decides what becomes of its conversation."""
    cut: RegenerateCut = "reject"
    """A conversation that cannot be regenerated whole: 'reject' it (default: every kept turn is one the
    target ended itself), or 'end' it there, keeping the turns before: for a target that rarely ends a
    turn within max_tokens."""
    seed: int | None = 0
    """Each turn's seed derives from this, the sample id and the turn: the same text whatever the
    sharding, batch or resume. null: unseeded (not reproducible); benchmarks/regen_bench.py measures the cost."""
    samples_per_shard: int = 256
    """Conversations per shard, the unit committed once all are done. A replica generates several shards
    at once, so a shard smaller than max_num_seqs still fills the engine."""
    max_num_seqs: int = 256
    """vLLM's limit on sequences decoded together."""
    enforce_eager: Literal["auto", True, False] = "auto"
    """'auto': CUDA graphs on a GPU (decoding gains much from them) and eager on the CPU (compile warm-up
    costs more than a small job gains). true / false: eager / compiled everywhere."""

    def __post_init__(self):
        check_types(self, "regenerate")
        if self.temperature is not None and self.temperature < 0:
            fail("regenerate", "temperature", self.temperature, "must be >= 0 (0 = greedy), or null")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            fail("regenerate", "top_p", self.top_p, "must be in (0, 1], or null")
        for name in ("max_tokens", "samples_per_shard", "max_num_seqs"):
            if getattr(self, name) < 1:
                fail("regenerate", name, getattr(self, name), "must be >= 1")
