"""Train/serve, like with like, for a finished job's draft (what bounds the acceptance length).

The job's summary puts the draft's held-out accuracy (teacher-forced, every position of held-out
conversations) beside what vLLM accepted on the eval's prompts. The two can differ widely. Two
differences sit between them, and this measures them apart on one text: the eval's own prompts,
answered greedily by vLLM with the draft.

1. served: the job's draft in vLLM at k (an evaluator actor as the eval stage places it, eager) answers
   the job's eval prompts greedily (eval.max_tokens, ending at EOS unless eval.ignore_eos); vLLM's own
   counts of drafts and accepted tokens per position, and the answers' tokens.
2. extract: the target's hidden states of prompt + answer, through the job's extract settings
   (ray_jobs.extract.run_extract), the answer in the loss mask.
3. replay: the exported draft on those hidden states (eagle3.evaluate.draft_accuracy with rounds_k):
   speculators' accuracy (full_acc_i, every position, draft-vocabulary argmax), the strict one (the
   target's argmax over its whole vocabulary, as vLLM accepts), the share of positions whose argmax is
   outside the draft vocabulary, and the rounds of k tokens walked as vLLM walks them.

Greedy decoding with the draft gives the target's own greedy answer, so the replayed rounds count the
same events vLLM counted, on the same tokens: where they meet, serving is as trained and the gap is
the text and where rounds fall; where they part, serving differs from training.

    python -m benchmarks.train_serve --job runs/demo --k 3 [--num-prompts N] [--max-tokens M] [--out DIR]

Writes DIR/train_serve.json (DIR: JOB/train_serve by default) and prints one line per measure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def job_config_dict(job: Path) -> dict:
    """The finished job's resolved config, from its provenance.json."""
    prov = next((p for p in (job / "provenance.json", job / "train" / "provenance.json") if p.exists()), None)
    if prov is None:
        raise FileNotFoundError(f"{job}: no provenance.json (is it a job's output_dir?)")
    return json.loads(prov.read_text())["config"]


def job_config(config: dict, out: Path, max_model_len: int):
    """The job's config, writing under `out`, its prepare.max_length raised to hold a prompt and
    its answer (what run_extract reads)."""
    from eagle3.config import job_config_from_dict

    return job_config_from_dict({**config, "output_dir": str(out),
                                 "prepare": {**config["prepare"], "max_length": max_model_len}})


def served_answers(ray, cfg, target: str, draft: str, prompts: list[list[int]], k: int, max_tokens: int,
                   max_model_len: int) -> dict:
    """vLLM's counts and answers: the draft at k, greedy, on `prompts` (one evaluator actor)."""
    from actors.evaluator import place_evaluator

    actor = place_evaluator(cfg.extract.cpu_kvcache_space_gib, gpu=ray.cluster_resources().get("GPU", 0) >= 1)
    try:
        ray.get(actor.start.remote(target, draft, num_speculative_tokens=k, max_model_len=max_model_len,
                                   enforce_eager=True, dtype=cfg.target.dtype,
                                   trust_remote_code=cfg.target.trust_remote_code))
        return ray.get(actor.acceptance.remote(prompts, max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=cfg.eval.ignore_eos, output_token_ids=True))
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)


def answers_table(prompts: list[list[int]], answers: list[list[int]]):
    """prompt + answer per sample, the answer in the loss mask (eagle3.schema's tokens schema)."""
    import pyarrow as pa

    from eagle3.schema import TOKENS_SCHEMA

    rows = [{"sample_id": f"served{i:05d}", "input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a),
             "num_tokens": len(p) + len(a)} for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]
    return pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA)


def compare(served: dict, replay: dict) -> dict:
    """vLLM's counts beside the replayed rounds on the same tokens, per draft position."""
    rounds = replay["rounds"]
    return {"vllm": {"num_drafts": served["num_drafts"], "acceptance_rate_per_pos": served["acceptance_rate_per_pos"],
                     "acceptance_length": served["acceptance_length"]},
            "replayed_rounds": {"num_rounds": rounds["num_rounds"],
                                "acceptance_rate_per_pos": [round(r, 4) for r in rounds["acceptance_rate_per_pos"]],
                                "acceptance_length": rounds["acceptance_length"]},
            "every_position": {"speculators_full_acc": replay["full_acc"], "strict_full_acc": replay["strict_full_acc"],
                               "out_of_draft_vocab": replay["out_of_draft_vocab"],
                               "num_positions": replay["num_positions"]}}


def run(job: Path, k: int, out: Path, num_prompts: int | None = None, max_tokens: int | None = None,
        ray_address: str | None = None) -> dict:
    import pyarrow.parquet as pq
    import ray

    from eagle3.evaluate import draft_accuracy
    from eagle3.prepare.tokens import read_eval_prompts
    from ray_jobs.cluster import init_ray
    from ray_jobs.extract import run_extract

    t0 = time.perf_counter()
    report = json.loads((job / "report.json").read_text())
    target, draft = report["target"], str(job / "draft")
    config = job_config_dict(job)
    out.mkdir(parents=True, exist_ok=True)
    prompts = read_eval_prompts(job / "prepared")[: num_prompts or config["eval"]["num_prompts"]]
    max_tokens = max_tokens or config["eval"]["max_tokens"]
    max_model_len = max(map(len, prompts)) + max_tokens + k + 8
    cfg = job_config(config, out, max_model_len)
    init_ray(ray_address, num_cpus=cfg.ray.num_cpus, cache_dir=cfg.cache_dir)  # the job's own address is not reused:
    # the cluster it ran on may be gone; `ray job submit` sets RAY_ADDRESS
    served = served_answers(ray, cfg, target, draft, prompts, k, max_tokens, max_model_len)
    answers = served.pop("output_token_ids")
    pq.write_table(answers_table(prompts, answers), out / "tokens.parquet")
    ext = run_extract(cfg, str(out / "tokens.parquet"), target, str(out / "hidden_states"), progress=False)
    replay = draft_accuracy(draft, target, ext["files"], micro_batch_tokens=max_model_len, ttt_steps=max(3, k),
                            rounds_k=k)
    result = {"job": str(job), "target": target, "draft": draft, "k": k, "num_prompts": len(prompts),
              "max_tokens": max_tokens, "ignore_eos": cfg.eval.ignore_eos,
              "num_answer_tokens": sum(map(len, answers)), **compare(served, replay),
              "seconds": round(time.perf_counter() - t0, 1)}
    (out / "train_serve.json").write_text(json.dumps(result, indent=1))
    return result


def lines(r: dict) -> list[str]:
    v, rr, e = r["vllm"], r["replayed_rounds"], r["every_position"]
    fmt = lambda xs: " / ".join(f"{x:.3f}" if x is not None else "-" for x in xs)  # noqa: E731
    return [f"train/serve on {r['num_prompts']} eval prompts, k={r['k']}, greedy, {r['num_answer_tokens']} answer tokens:",
            f"  vLLM             {v['num_drafts']} drafts, accepted per position {fmt(v['acceptance_rate_per_pos'])}, "
            f"AL {v['acceptance_length']:.3f}",
            f"  replayed rounds  {rr['num_rounds']} rounds, accepted per position {fmt(rr['acceptance_rate_per_pos'])}, "
            f"AL {rr['acceptance_length']:.3f}",
            f"  every position   speculators' full_acc {fmt(e['speculators_full_acc'])}; strict {fmt(e['strict_full_acc'])}; "
            f"argmax outside the draft vocabulary {e['out_of_draft_vocab']:.4f}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_serve", description=__doc__.split("\n")[0])
    ap.add_argument("--job", type=Path, required=True, help="a finished job's output_dir (report.json, draft/, prepared/)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, help="default: the job's eval.num_prompts")
    ap.add_argument("--max-tokens", type=int, help="default: the job's eval.max_tokens")
    ap.add_argument("--out", type=Path, help="default: JOB/train_serve")
    ap.add_argument("--ray-address")
    args = ap.parse_args(argv)
    r = run(args.job, args.k, args.out or args.job / "train_serve", args.num_prompts, args.max_tokens, args.ray_address)
    print("\n".join(lines(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
