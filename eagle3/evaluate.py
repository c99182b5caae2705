"""What an EAGLE-3 draft is worth: acceptance length inside vLLM speculative decoding, decode
throughput with and without it, and the draft's own first-token accuracy on stored hidden states.

Owns:
- `SpecDecodeEngine`: one vLLM engine (the target, with a draft or without), and what is measured on
  it; `close()` or a `with` block releases the engine. `acceptance`: acceptance length = 1 +
  accepted draft tokens / verification steps (drafts), the mean number of tokens one target forward
  produces, greedy (temperature 0) or sampled (temperature 1, a seed per request), with `ignore_eos`
  so every prompt generates exactly `max_tokens` tokens and runs with different
  num_speculative_tokens see the same number of tokens. Counters come from the engine's own
  Prometheus metrics (compat/vllm_engine.py), as differences before/after, so one engine serves
  several measurements. `throughput`: output tokens/s of the same prompts decoded `batch_size` at a
  time (waves of exactly batch_size requests with the same max_tokens, so each wave decodes at that
  batch size from start to end).
- `measure_acceptance`: the job's eval stage (one engine per num_speculative_tokens).
- `draft_accuracy`: the trainer's metric (speculators' full_acc_i: the draft's argmax equals the
  target's argmax at loss-masked positions, step i of the TTT unroll) for an exported draft on
  hidden-state shards: the training side of a train/serve comparison, through the exported files
  rather than the trainer's memory, so the export is part of what is compared.
Does not own: the engine settings (compat.vllm_engine.eagle3_engine_kwargs), placement (actors.
evaluator, ray_jobs.run, benchmarks.quality_bench).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Self


class SpecDecodeEngine:
    """A vLLM engine of `target_dir` with the EAGLE-3 draft `draft_dir` proposing
    num_speculative_tokens tokens per step, or the target alone (draft_dir None, k 0)."""

    def __init__(self, target_dir: str, draft_dir: str | None, *, num_speculative_tokens: int, max_model_len: int,
                 dtype: str = "auto", enforce_eager: bool = True, max_num_seqs: int | None = None,
                 gpu_memory_utilization: float = 0.85, trust_remote_code: bool = False,
                 kv_cache_memory_bytes: int | None = None):
        from compat.vllm_engine import Engine, eagle3_engine_kwargs
        from eagle3.precision import engine_dtype

        dtype, self.dtype = engine_dtype(dtype)  # self.dtype: the choice and why, for logs
        self.draft_dir, self.k = draft_dir, num_speculative_tokens
        self.enforce_eager = enforce_eager
        t0 = time.perf_counter()
        self.engine = Engine(**eagle3_engine_kwargs(
            target=target_dir, draft=draft_dir, num_speculative_tokens=num_speculative_tokens,
            max_model_len=max_model_len, dtype=dtype, enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code,
            kv_cache_memory_bytes=kv_cache_memory_bytes))
        self.startup_s = time.perf_counter() - t0

    @property
    def llm(self):
        return self.engine.llm

    def close(self) -> None:
        """Release the engine (compat.vllm_engine.Engine.close); idempotent."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float, seed: int):
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                 seed=None if temperature == 0 else seed + i) for i in range(len(prompts))]
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[list[int]]:
        """The generated token ids of each prompt (exactly max_tokens each: ignore_eos)."""
        return [list(o.outputs[0].token_ids) for o in self._generate(prompts, max_tokens=max_tokens,
                                                                      temperature=temperature, seed=seed)]

    def _counters(self) -> dict:
        from compat.vllm_engine import spec_decode_counters

        return spec_decode_counters(self.llm)

    def acceptance(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
                   seed: int = 0) -> dict:
        """Acceptance of this engine's draft on `prompts`. Also per draft position i (0-based) the
        fraction of drafts whose first i+1 tokens were all accepted, and from it
        `acceptance_length_prefix[j-1]` = 1 + the sum of the first j of those: the acceptance
        length the same drafts would give if they stopped after j tokens (a greedy draft's first j
        tokens do not depend on k; where a k=j engine starts its drafts does, so this estimates,
        and does not replace, a k=j measurement)."""
        if self.draft_dir is None:
            raise ValueError("acceptance needs an engine with a draft; this one serves the target alone")
        before = self._counters()
        t = time.perf_counter()
        outs = self._generate(prompts, max_tokens=max_tokens, temperature=temperature, seed=seed)
        gen_s = time.perf_counter() - t
        after = self._counters()
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
                   for i, a in enumerate(after["accepted_per_pos"])]
        if drafts == 0:
            raise RuntimeError(
                f"[vLLM] no speculative drafts were counted for {len(prompts)} prompts: the draft at {self.draft_dir} "
                "was not used (check the engine log for the speculative config it resolved)")
        rates = [p / drafts for p in per_pos]
        return {
            "num_speculative_tokens": self.k,
            "temperature": temperature,
            "seed": seed if temperature else None,
            "acceptance_length": 1.0 + accepted / drafts,
            "num_drafts": drafts,
            "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "num_accepted_tokens": accepted,
            "acceptance_rate_per_pos": [round(r, 4) for r in rates],
            "acceptance_length_prefix": [round(1.0 + sum(rates[:j]), 4) for j in range(1, len(rates) + 1)],
            "num_prompts": len(prompts),
            "num_generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "generate_s": gen_s,
            "engine_start_s": self.startup_s, "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
            "first_output_token_ids": list(outs[0].outputs[0].token_ids[:16]),
        }

    def throughput(self, prompts: list[list[int]], *, batch_size: int, max_tokens: int) -> dict:
        """Greedy output tokens/s over `prompts` in waves of `batch_size` (len(prompts) must be a
        multiple of it), after one untimed wave (first-call work: buffers, lazy kernels). Also the
        prefill-only time of the same waves (max_tokens=1), and from both the decode-only rate:
        (tokens - one per prompt) / (seconds - prefill seconds)."""
        if batch_size < 1 or not prompts or len(prompts) % batch_size:
            raise ValueError(f"{len(prompts)} prompts in waves of batch_size={batch_size}: give a positive multiple "
                             "of the batch size")
        waves = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
        self._generate(waves[0], max_tokens=max_tokens, temperature=0.0, seed=0)  # warm-up, untimed
        before = self._counters()

        def timed(n: int) -> tuple[float, int]:
            t, tokens = time.perf_counter(), 0
            for w in waves:
                tokens += sum(len(o.outputs[0].token_ids) for o in self._generate(w, max_tokens=n, temperature=0.0,
                                                                                   seed=0))
            return time.perf_counter() - t, tokens

        seconds, tokens = timed(max_tokens)
        after = self._counters()
        prefill_s, _ = timed(1)
        drafts = after["num_drafts"] - before["num_drafts"]
        decode_s = seconds - prefill_s
        return {
            "num_speculative_tokens": self.k,
            "batch_size": batch_size,
            "num_prompts": len(prompts),
            "max_tokens": max_tokens,
            "num_generated_tokens": tokens,
            "seconds": seconds,
            "output_tokens_per_s": tokens / seconds,
            "prefill_s": prefill_s,
            "decode_tokens_per_s": (tokens - len(prompts)) / decode_s if decode_s > 0 else None,
            "acceptance_length": (1.0 + (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / drafts
                                  if drafts else None),
            "enforce_eager": self.enforce_eager,
            "engine_start_s": self.startup_s,
        }


def measure_acceptance(target_dir: str, draft_dir: str, prompts: list[list[int]], *, num_speculative_tokens: int,
                       max_tokens: int, max_model_len: int, dtype: str = "auto",
                       trust_remote_code: bool = False, temperature: float = 0.0, seed: int = 0) -> dict:
    """The job's eval stage: a fresh engine, one acceptance measurement, the engine released."""
    with SpecDecodeEngine(target_dir, draft_dir, num_speculative_tokens=num_speculative_tokens,
                          max_model_len=max_model_len, dtype=dtype, trust_remote_code=trust_remote_code) as engine:
        return engine.acceptance(prompts, max_tokens=max_tokens, temperature=temperature, seed=seed)


def draft_accuracy(draft_dir: str | Path, target_dir: str | Path, data_files, *, micro_batch_tokens: int = 4096,
                   ttt_steps: int = 3, loss: str = "kl_div", max_batches: int | None = None) -> dict:
    """An exported draft's accuracy on hidden-state shards, one pass over every sample: full_acc_i
    (i = 0..ttt_steps-1) as the trainer computes it (speculators' compute_metrics, teacher-forced
    inputs), summed over batches: {"full_acc": [...], "num_positions": [...], "num_samples",
    "num_batches"}. The verifier's norm and lm_head, which the export leaves out, are read from
    `target_dir` (compat.speculators_verifier)."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    from compat.speculators_loss import loss_implementation
    from eagle3.data.packing import PackedBatches
    from eagle3.data.rows import HiddenStatesDataset
    from eagle3.data.staging import device_inputs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    # flex attention (speculators' default) compiles; sdpa is the same attention without that
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=config)
    _load_verifier_head(model, str(target_dir))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = model.to(device=device, dtype=dtype).eval()
    loss_config = resolve_loss_config(loss, loss_implementation())
    dataset = HiddenStatesDataset(data_files, seed=0, shuffle_buffer_size=1)
    batches = PackedBatches(dataset, micro_batch_tokens, dtype)
    correct = [0.0] * ttt_steps
    total = [0.0] * ttt_steps
    num_batches = num_samples = 0
    with torch.no_grad():
        while max_batches is None or num_batches < max_batches:
            rows = batches.take()
            if batches.epoch > 0:  # take() went on to the next epoch: every sample was seen
                break
            inputs = device_inputs(batches.pack(rows), device, dtype)
            _, _, metrics = model(**inputs, ttt_steps=ttt_steps, ttt_step_loss_decay=1.0, loss_config=loss_config)
            for i in range(ttt_steps):
                correct[i] += float(metrics[f"full_acc_{i}_sum"])
                total[i] += float(metrics[f"full_acc_{i}_total"])
            num_batches += 1
            num_samples += len(rows)
    if batches.num_truncated:
        raise ValueError(f"{batches.num_truncated} samples are longer than micro_batch_tokens={micro_batch_tokens}: "
                         "raise it so that every position is counted")
    return {"full_acc": [c / t if t else None for c, t in zip(correct, total)], "num_positions": total,
            "num_samples": num_samples, "num_batches": num_batches}


def _load_verifier_head(model, target_dir: str) -> None:
    """The target's final norm and lm_head (rows of the draft vocabulary) into the draft's frozen
    verifier_norm / verifier_lm_head, which the exported draft does not hold; the draft's own
    (trained) lm_head and embed_tokens stay as exported."""
    import torch

    from compat.speculators_verifier import read_text_model_tensors

    want = read_text_model_tensors(target_dir)
    head = want.get("lm_head.weight", want.get("embed_tokens.weight"))  # tied embeddings: no lm_head
    if head is None or "model.norm.weight" not in want:
        raise ValueError(f"{target_dir}: no lm_head / final norm tensors found; pass the draft's target directory")
    if getattr(model, "use_draft_vocab", False):
        head = head[model.t2d.to(torch.bool)]
    with torch.no_grad():
        for param, tensor in ((model.verifier_lm_head.weight, head), (model.verifier_norm.weight,
                                                                        want["model.norm.weight"])):
            if param.shape != tensor.shape:
                raise ValueError(f"{target_dir}: the target's tensor has shape {tuple(tensor.shape)}, the draft's "
                                 f"verifier head expects {tuple(param.shape)}: not this draft's target")
            param.copy_(tensor.to(param.dtype))
