"""Evaluate stage: what an exported EAGLE-3 draft is worth inside vLLM speculative decoding, and its
own accuracy on stored hidden states.

- windows: what is measured at: the samplings, the timed windows per platform, eager or CUDA graphs
- engine: SpecDecodeEngine (one vLLM engine, with the draft or the target alone) and its
  measurements: acceptance, tokens/s over the timed windows (measure, merge_speed)
- stats: spread of repeated windows, speedup and its bootstrap interval over prompts
- report: eval.json from the engines' results (eval_report, SPEED_METHOD)
- verdict: the k to serve per batch size and where the draft is off, from eval.json (eval_verdict)
- selection: DraftSelection, the draft to export chosen by vLLM's acceptance during training
- accuracy: draft_accuracy, the trainer's metric for the exported draft (a train/serve comparison)
Engine settings are compat.vllm_engine's, placement actors.evaluator's and ray_jobs.evaluate's.
Nothing here imports torch or vllm at module level: the driver plans the eval and builds eval.json.
"""

from eagle3.evaluate.accuracy import draft_accuracy
from eagle3.evaluate.engine import SpecDecodeEngine, measure, merge_speed
from eagle3.evaluate.report import SPEED_METHOD, eval_report
from eagle3.evaluate.selection import DraftSelection, selection_line
from eagle3.evaluate.stats import BOOTSTRAP_RESAMPLES, ranges_apart, speedup, spread, wave_speedup
from eagle3.evaluate.verdict import batch_lines, eval_verdict
from eagle3.evaluate.windows import (CPU_WINDOWS, GPU_WINDOWS, DecodeSampling, SpeedWindow, eval_samplings,
                                     resolve_enforce_eager, speed_windows, timed_prompts)

__all__ = ["BOOTSTRAP_RESAMPLES", "CPU_WINDOWS", "GPU_WINDOWS", "SPEED_METHOD", "DecodeSampling", "SpecDecodeEngine",
           "DraftSelection", "SpeedWindow", "batch_lines", "draft_accuracy", "eval_report", "eval_samplings", "eval_verdict", "measure",
           "merge_speed", "ranges_apart", "resolve_enforce_eager", "selection_line", "speed_windows", "speedup", "spread", "timed_prompts",
           "wave_speedup"]
