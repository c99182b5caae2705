"""The whole job on a target whose chat template rewrites earlier turns: the tiny target
built with the Qwen3-like template (target.tiny_chat_template=qwen3), through prepare, extract,
train, export and vLLM speculative decoding. Extraction uses the transformers backend here: the
vLLM engine's capture is covered by tests/test_e2e.py, and what this test is about is that every
stage accepts conversations split into one sample per assistant turn."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_whole_job_runs_on_a_qwen3_like_target(tmp_path, shared_ray):
    from transformers import AutoTokenizer

    out = tmp_path / "qwen3"
    # tiny_pretrain_steps=0 (random weights; ~16 s less): nothing asserted depends on what the
    # target generates (the samples' text is the conversations' under the template, eval ignores eos)
    proc = subprocess.run(
        [sys.executable, "-m", "ray_jobs.run", "--config", "configs/demo.yaml", "--set", f"output_dir={out}",
         "--set", "target.model=tiny",  # the tiny target, built in the job (the demo's is SmolLM2)
         "--set", "target.tiny_chat_template=qwen3", "--set", "target.tiny_pretrain_steps=0",
         "--set", f"ray.address={shared_ray}",  # the session's shared cluster (conftest)
         "--set", "prepare.max_samples=60", "--set", "prepare.num_eval_prompts=4",
         "--set", "extract.backend=hf", "--set", "doctor=false", "--set", "train.num_steps=4",
         "--set", "eval.num_speculative_tokens=[1]", "--set", "eval.num_prompts=4", "--set", "eval.max_tokens=16",
         "--set", "eval.speed_batch_sizes=[]"],  # the speedup is tests/test_e2e.py's: no baseline engine here
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    tok = AutoTokenizer.from_pretrained(out / "target")
    assert tok.eos_token == "<|im_end|>"
    tokens = pq.read_table(out / "prepared" / "tokens.parquet")
    ids = tokens.column("sample_id").to_pylist()
    # Multi-turn demo conversations become one sample per assistant turn ('<id>#t<k>').
    assert any("#t2" in i for i in ids), ids[:10]
    for input_ids, mask in zip(tokens.column("input_ids").to_pylist()[:20], tokens.column("loss_mask").to_pylist()[:20]):
        # Each sample trains one turn: its masked tokens are one contiguous span, the target's
        # own think block and answer, ending in the template's end of turn.
        on = [i for i, m in enumerate(mask) if m]
        assert on and on == list(range(on[0], on[-1] + 1))
        text = tok.decode([input_ids[i] for i in on])
        assert text.startswith("<think>") and text.endswith("<|im_end|>"), text
        assert "<|im_start|>" not in text

    report = json.loads((out / "report.json").read_text())
    assert report["stages"]["extract"]["num_samples"] == tokens.num_rows
    assert report["stages"]["train"]["steps"] == 4
    ev = json.loads((out / "eval.json").read_text())
    assert ev["speed"] is None and [e["num_speculative_tokens"] for e in ev["engines"]] == [1]
    [ev] = ev["acceptance"]
    assert ev["greedy"]["num_drafts"] > 0 and ev["greedy"]["num_generated_tokens"] == 4 * 16
