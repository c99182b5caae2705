"""What a job will cost before it starts: hidden-state bytes on disk and seconds per stage.

Owns: `estimate(...)`, a pure function of the config, the target's config.json, the token count,
the GPUs and the free disk, returning a plain dict (the doctor prints it as rows, the job's summary
can keep it); the rates it uses, each with its physical meaning and the results file it comes from
(benchmarks/results/<source>); the target's parameter count from its config.json.
Imports neither torch nor vllm. How far off it is on measured jobs:
benchmarks/results/job/cost-estimate-vs-measured-2026-12-06.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3.schema import stored_bytes_per_token

JOB_WARM = "job/smollm2-135m-sharegpt-job-h100-2026-12-05.md"
JOB_COLD = "job/smollm2-135m-sharegpt-job-h100-2026-12-06.md"
JOB_ALL = "job/smollm2-135m-sharegpt-all-records-h100-2026-12-05.md"
QWEN_REGEN = "regeneration/regen-vs-generate-qwen2.5-coder-1.5b-512-seqs-h200-2026-12-04.md"
QWEN_JOB = "quality/qwen2.5-coder-1.5b-sharegpt-job-h200-2026-12-05.md"
EXTRACT_8B = "extraction/extract-vs-prefill-8b-shape-h200-2026-11-30.md"
FIT = "job/cost-estimate-vs-measured-2026-12-06.md"


@dataclass(frozen=True)
class Rate:
    value: float
    unit: str
    meaning: str
    source: str  # under benchmarks/results/

    def to_dict(self) -> dict:
        return {"value": self.value, "unit": self.unit, "meaning": self.meaning, "source": self.source}


RATES: dict[str, Rate] = {
    "regen_s_per_token": Rate(18.3e-6, "s per generated token per GPU", "a regeneration step's fixed cost "
                              "(scheduler, rendering) a token",
                              f"{JOB_WARM}, {JOB_ALL} (4 engines a GPU), {QWEN_REGEN}"),
    "regen_s_per_token_per_bparam": Rate(19.5e-6, "s per generated token per GPU per 1e9 active parameters",
                                         "decode compute", f"{QWEN_REGEN} against {JOB_WARM}"),
    "extract_s_per_token": Rate(2.47e-6, "s per token per GPU", "extraction's fixed cost a token (copy, write)",
                                JOB_WARM),
    "extract_s_per_token_per_bparam": Rate(2.74e-6, "s per token per GPU per 1e9 active parameters",
                                           "prefill compute", f"{EXTRACT_8B} against {JOB_WARM}"),
    "train_s_per_token_per_hidden": Rate(8.72e-9, "s per trained token per hidden unit per GPU",
                                         "the one-layer draft's step, offline (199k tokens/s at hidden 576)", JOB_WARM),
    "online_train_slowdown": Rate(1.29, "x", "online, the trainer shares the GPU with its engine (154k vs 199k "
                                  "tokens/s)", f"{JOB_ALL} against {JOB_WARM}"),
    "tokens_per_step_fill": Rate(0.94, "of train.data.micro_batch_tokens", "packing leaves the rest of a step empty",
                                 f"{JOB_WARM}, {JOB_ALL}, {QWEN_JOB}"),
    "regen_generated_per_token": Rate(0.39, "generated tokens per prepared token at regenerate.max_tokens 512",
                                      "the target's answers, cut at max_tokens", f"{JOB_WARM}, {JOB_ALL}"),
    "regen_kept_per_token": Rate(0.15, "prompt tokens kept per prepared token", "the user turns regeneration keeps",
                                 f"{JOB_WARM}, {JOB_ALL}"),
    "engine_s_per_bparam": Rate(27.0, "s per 1e9 parameters per GPU", "an engine's weight load and compile beyond "
                                "a 0.135B target's", f"{QWEN_JOB} (online engine 59.7 s) against {JOB_ALL} (21.8 s)"),
    "online_engine_s": Rate(21.8, "s", "the online engine's start, before the first step", JOB_ALL),
    "prepare_s_per_record": Rate(1.0e-3, "s per record", "tokenizing with the chat template, Ray tasks",
                                 f"{JOB_WARM}, {JOB_ALL}"),
    "heldout_fraction_written": Rate(1.0, "x prepare.heldout_fraction", "online mode writes the held-out split's "
                                     "shards only", JOB_ALL),
}

# Fixed seconds of each stage besides its work (engine starts, Ray Train's set-up, the trainer's first
# step, export, the eval's timed windows). Warm: compile caches and page cache filled by an earlier job.
# Cold: those of the cold job scaled by COLD_SCALE, since two cold jobs of nearly the same work took
# 936 s and 546 s; FIT says how that scale was chosen.
OVERHEAD_WARM = {"prepare": 6.5, "doctor": 19.0, "regenerate": 36.0, "extract": 19.7, "train": 38.8, "eval": 88.0}
OVERHEAD_COLD_JOB = {"prepare": 18.6, "doctor": 107.0, "regenerate": 141.0, "extract": 54.7, "train": 289.0,
                     "eval": 256.0}
COLD_SCALE = 0.71
OVERHEAD_SOURCES = {"warm": JOB_WARM, "cold": f"{JOB_COLD} x {COLD_SCALE} ({FIT})"}


def overheads(warm: bool) -> dict[str, float]:
    if warm:
        return dict(OVERHEAD_WARM)
    return {k: round(v * COLD_SCALE, 1) for k, v in OVERHEAD_COLD_JOB.items()}


def text_config(config: dict) -> dict:
    """The language model's part of a config.json (multimodal wrappers nest it)."""
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(key), dict) and "num_hidden_layers" in config[key]:
            return config[key]
    return config


def parameters(config: dict) -> tuple[float, float]:
    """(total, active) parameters from a config.json: embeddings (and an untied head), attention and MLP
    per layer; a mixture of experts counts every expert in total and num_experts_per_tok in active."""
    t = text_config(config)
    h, n_layers, vocab = t["hidden_size"], t["num_hidden_layers"], t.get("vocab_size", 32000)
    heads = t.get("num_attention_heads") or max(1, h // 128)
    head_dim = t.get("head_dim") or h // heads
    kv = t.get("num_key_value_heads") or heads
    attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    experts = t.get("num_local_experts") or t.get("n_routed_experts") or t.get("num_experts") or 0
    inter = t.get("intermediate_size") or 4 * h
    if experts:
        per_expert = 3 * h * (t.get("moe_intermediate_size") or inter)
        shared = 3 * h * (t.get("shared_expert_intermediate_size") or 0) + \
            3 * h * (t.get("moe_intermediate_size") or 0) * (t.get("n_shared_experts") or 0)
        mlp_total = experts * per_expert + shared
        mlp_active = (t.get("num_experts_per_tok") or 2) * per_expert + shared
    else:
        mlp_total = mlp_active = 3 * h * inter
    embed = vocab * h * (1 if t.get("tie_word_embeddings", config.get("tie_word_embeddings", False)) else 2)
    return (float(embed + n_layers * (attn + mlp_total)), float(embed + n_layers * (attn + mlp_active)))


def _steps(cfg, train_tokens_per_step: float, num_train_tokens: float) -> int:
    """train.num_steps, or train.num_epochs passes over the data where num_steps is not set."""
    t = cfg.train
    steps = getattr(t, "num_steps", None)
    epochs = getattr(t, "num_epochs", None)
    if steps is None and epochs is not None:
        return max(1, math.ceil(epochs * num_train_tokens / train_tokens_per_step))
    return int(steps or 0)


def estimate(cfg, target_config: dict, num_tokens: int, num_gpus: int, free_disk_bytes: int | None, *,
             num_records: int | None = None, warm: bool = False, tokens_from: str = "") -> dict:
    """Bytes and seconds of the job `cfg` (an eagle3.config.JobConfig) on `num_gpus` GPUs:
    num_tokens prepared tokens (counted, or estimated from the conversations: `tokens_from` says
    which), target_config the target's config.json, free_disk_bytes free at output_dir (None:
    unknown), warm whether compile caches are filled. Returns {"stages": {name: seconds},
    "seconds": total, "hidden_state_bytes", "fits", "recommend", "rates", ...}."""
    t = text_config(target_config)
    hidden, n_layers = t["hidden_size"], t["num_hidden_layers"]
    total_p, active_p = parameters(target_config)
    total_b, active_b = total_p / 1e9, active_p / 1e9
    r = {k: v.value for k, v in RATES.items()}
    gpus = max(1, num_gpus)
    over = overheads(warm)
    stages = set(cfg.stages)
    per_replica = cfg.extract.tensor_parallel_size * cfg.extract.pipeline_parallel_size
    engine_s = r["engine_s_per_bparam"] * max(0.0, total_b / per_replica - 0.135)

    regen = cfg.regenerate.enabled and ("regenerate" in stages or "extract" in stages)
    scale = cfg.regenerate.max_tokens / 512
    generated = num_tokens * min(r["regen_generated_per_token"] * scale, 0.77) if regen else 0.0
    tokens = num_tokens * r["regen_kept_per_token"] + generated if regen else float(num_tokens)

    online = cfg.train.source == "online" and "train" in stages
    layers = len(cfg.extract.layer_ids(n_layers))
    per_token = stored_bytes_per_token(num_layers=layers, hidden_size=hidden, hs_dtype=cfg.extract.hs_dtype) + 5
    bf16 = stored_bytes_per_token(num_layers=layers, hidden_size=hidden, hs_dtype="bfloat16") + 5
    fp8 = stored_bytes_per_token(num_layers=layers, hidden_size=hidden, hs_dtype="float8_e4m3fn") + 5
    written = tokens * cfg.prepare.heldout_fraction if online else tokens
    hs_bytes = int(written * per_token) if ("extract" in stages or online) else 0

    seconds: dict[str, float] = {}
    records = num_records if num_records is not None else cfg.prepare.max_samples
    if "prepare" in stages:
        seconds["prepare"] = over["prepare"] + (records or num_tokens / 1200) * r["prepare_s_per_record"]
    if cfg.doctor:
        seconds["doctor"] = over["doctor"]
    if regen:
        s_tok = r["regen_s_per_token"] + r["regen_s_per_token_per_bparam"] * active_b / per_replica
        seconds["regenerate"] = over["regenerate"] + engine_s + generated * s_tok / (gpus / per_replica)
    extract_s_tok = r["extract_s_per_token"] + r["extract_s_per_token_per_bparam"] * active_b / per_replica
    if "extract" in stages and not online:
        seconds["extract"] = over["extract"] + engine_s + tokens * extract_s_tok / (gpus / per_replica)
    steps = 0
    if "train" in stages:
        workers = cfg.train.num_workers
        per_step = r["tokens_per_step_fill"] * cfg.train.data.micro_batch_tokens * \
            cfg.train.data.gradient_accumulation_steps * workers
        steps = _steps(cfg, per_step, tokens)
        s_tok = r["train_s_per_token_per_hidden"] * hidden / workers
        if online:
            s_tok *= r["online_train_slowdown"]
        seconds["train"] = over["train"] + steps * per_step * s_tok + \
            ((r["online_engine_s"] + engine_s) if online else 0.0)
    if "eval" in stages and cfg.eval.enabled:
        seconds["eval"] = over["eval"] + engine_s
    # Prepare runs beside the doctor: the longer of the two counts.
    side = max(seconds.get("prepare", 0.0), seconds.get("doctor", 0.0))
    total = side + sum(v for k, v in seconds.items() if k not in ("prepare", "doctor"))

    need = int(hs_bytes * 1.2)
    fits = free_disk_bytes is None or hs_bytes == 0 or free_disk_bytes >= need
    recommend = []
    if not fits:
        if cfg.extract.hs_dtype == "bfloat16" and free_disk_bytes >= int(written * fp8 * 1.2):
            recommend.append(f"extract.hs_dtype: float8_e4m3fn ({fp8} bytes a token instead of {bf16})")
        if not online:
            recommend.append("train.source: online (only the held-out split's shards are written)")
        if not recommend:
            recommend.append("point output_dir at a larger volume, or extract fewer samples")
    return {
        "target": {"parameters": total_p, "active_parameters": active_p, "hidden_size": hidden,
                   "num_hidden_layers": n_layers},
        "num_gpus": gpus, "warm": warm, "mode": "online" if online else "offline",
        "num_tokens": int(num_tokens), "tokens_from": tokens_from, "num_records": records,
        "generated_tokens": int(generated), "train_tokens_per_pass": int(tokens), "train_steps": steps,
        "hidden_state_bytes": hs_bytes, "bytes_per_token": per_token, "bytes_bf16": int(written * bf16),
        "bytes_fp8": int(written * fp8), "free_disk_bytes": free_disk_bytes, "fits": fits, "recommend": recommend,
        "stages": {k: round(v, 1) for k, v in seconds.items()}, "seconds": round(total, 1),
        "rates": {k: v.to_dict() for k, v in RATES.items()},
        "overheads": {"which": "warm" if warm else "cold", "seconds": over,
                      "source": OVERHEAD_SOURCES["warm" if warm else "cold"]},
    }
