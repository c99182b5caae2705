"""The job's summary, printed at its end: one line per stage from report.json's record (counts,
accuracy against vLLM's acceptance, speedup, start-up and dtypes), so that a run reads at a glance.
"""

from __future__ import annotations

from pathlib import Path


def _startup_line(startup: dict) -> str | None:
    """Each engine's start and the trainer's set-up, in the form 'doctor dry run Ns; extract engine Ns;
    eval engines Ns, Ns side by side; trainer set-up Ns, first step N.Ns'."""
    parts = []
    for key, what in (("doctor_dry_run", "doctor dry run"), ("regenerate", "regenerate engine"),
                      ("extract", "extract engine"), ("online", "online engine"), ("eval", "eval engine")):
        starts = [s["startup_s"] for s in startup.get(key, []) if s.get("startup_s") is not None]
        if starts:
            side = any((s.get("engines_at_once") or 1) > 1 for s in startup.get(key, []))
            during = any(s.get("during_training") for s in startup.get(key, []))
            parts.append(f"{what}{'s' if len(starts) > 1 else ''} " + ", ".join(f"{v:.0f}s" for v in starts)
                         + (" side by side" if side else "") + (" while the draft trained" if during else ""))
    t = startup.get("train")
    if t:
        parts.append(f"trainer set-up {t['setup_s']:.0f}s"
                     + (f", first step {t['first_step_s']:.1f}s" if t.get("first_step_s") is not None else ""))
    return "; ".join(parts) or None


def _dtype_line(startup: dict) -> str | None:
    """The engines' compute dtypes (as resolved in their processes) and the trainer's precision."""
    dtypes = sorted({s["dtype"] for key in ("regenerate", "extract", "online", "eval") for s in startup.get(key, [])
                     if s.get("dtype")})
    parts = [f"engines {', '.join(dtypes)}"] if dtypes else []
    if startup.get("train", {}).get("precision"):
        parts.append(f"trainer {startup['train']['precision']}")
    return "; ".join(parts) or None


def _resumed(stage: dict) -> str:
    """What a resumed stage took from an earlier run, e.g. '; 6 of 19 shards already committed', and
    from a smaller input, e.g. '(kept from an input of 12000)'."""
    skipped = stage.get("shards_skipped", 0)
    grown = f" (kept from an input of {stage['grown']['num_samples']})" if stage.get("grown") else ""
    return f"; {skipped} of {stage['num_shards']} shards already committed{grown}" if skipped else ""


def _accuracy_lines(st: dict) -> list[str]:
    """The train/serve check, like with like: the draft's accuracy per draft position on the
    held-out conversations (speculators' full_acc_i: positions 0..i all right) beside the training
    accuracy (averaged over the steps before that evaluation) and vLLM's rate of drafts whose
    first i+1 tokens were all accepted (the eval with the largest k), on held-out prompts."""
    held = (st.get("train") or {}).get("heldout")
    if not held:
        return []

    def fmt(values) -> str:
        return "-" if values is None else " ".join(f"{v:.3f}" for v in values)

    lines = [f"  accuracy         per draft position at step {held['step']}: held-out {fmt(held['full_acc'])} "
             f"({held['num_positions']} positions, {held['num_samples']} samples"
             + (f"; over the first {held['first_tokens']} tokens of each turn {fmt(held['first_full_acc'])}, "
                f"{held['first_num_positions']} positions" if "first_tokens" in held else "")
             + f"), training {fmt(held['train_full_acc'])}"]
    # greedy: the trainer's accuracy is the draft's argmax against the target's
    evals = [r for r in (st.get("eval") or {}).get("acceptance", [])
             if (r.get("greedy") or {}).get("acceptance_rate_per_pos")]
    if evals:
        widest = max(evals, key=lambda r: r["num_speculative_tokens"])
        lines[-1] += (f", vLLM accepted (k={widest['num_speculative_tokens']}, greedy) "
                      f"{fmt(widest['greedy']['acceptance_rate_per_pos'])}")
    if "rounds_al" in held:  # the same held-out predictions counted per round, as vLLM counts its drafts
        lines.append(f"                   held-out in rounds of {len(held['rounds_acc'])}, as vLLM counts drafts: "
                     f"{fmt(held['rounds_acc'])} (AL {held['rounds_al']:.2f}, {held['num_rounds']} rounds)")
    if bound := _bound_line(st, held):
        lines.append(f"                   {bound}")
    return lines


# How much more the draft may score at its first position on its training data than on held-out
# conversations before the summary calls it short of data: above it, more data still raised AL on
# SmolLM2; below it, held-out accuracy no longer moved (benchmarks/RESULTS.md).
DATA_BOUND_GAP = 0.05


def _bound_line(st: dict, held: dict) -> str | None:
    """What more of, data or steps, would raise the draft's accuracy: the gap between its training
    and held-out accuracy at the first draft position (whole turns), and its passes over the data."""
    train, heldout = held.get("train_full_acc"), held.get("full_acc")
    if not train or not heldout:
        return None
    gap = train[0] - heldout[0]
    t, data = st.get("train") or {}, (st.get("extract") or {}).get("num_tokens")
    passes = f", {t['tokens'] / data:.1f} passes over {data} tokens" if t.get("tokens") and data else ""
    if gap >= DATA_BOUND_GAP:
        return (f"short of data: the draft scores {gap:.3f} more at position 1 on its training data than held out"
                f"{passes}; more conversations (prepare.max_samples, a larger source) should raise it")
    return (f"not short of data: training and held-out accuracy meet at position 1 ({gap:+.3f}{passes}); more "
            "data alone will not raise it, more steps (train.num_steps) may")


def format_summary(report: dict) -> str:
    """The lines printed at the job's end, from the report run() returns (report.json)."""
    st = report["stages"]
    lines = [f"eagle3 job finished in {report['seconds']['total']:.0f}s; outputs under {report['output_dir']}"]
    t = st.get("target", {})
    lines.append(f"  target           {report['target']}"
                 + (f" ({t['model']}, resolved on the {t['resolved_on']})" if t.get("resolved_on") else ""))
    if "prepare" in st:
        p = st["prepare"]
        lines.append(f"  prepared/        {p['num_samples']} samples, {p['num_tokens']} tokens "
                     f"({p['num_loss_tokens']} in the loss), {p['num_rejected']} rejected; "
                     f"{p.get('num_heldout_conversations', 0)} conversations ({p.get('num_heldout_samples', 0)} "
                     "samples) held out of training")
    if "regenerate" in st:
        g = st["regenerate"]
        lines.append(f"  regenerated/     {g['num_samples']} conversations, {g['num_generated_tokens']} tokens generated, "
                     f"{g['num_rejected']} rejected{_resumed(g)}")
        if "num_turns_ended" in g:
            lines.append(f"                   {g['num_turns']} turns: {g['num_turns_ended']} ended by the target, "
                         f"{g['num_turns_cut']} cut ({g['num_turns_cut_at_max_tokens']} at regenerate.max_tokens)")
        for msg in g.get("untrusted", []):
            lines.append(f"                   WARNING {msg}")
    if "extract" in st:
        e = st["extract"]
        lines.append(f"  hidden_states/   {e['num_samples']} samples, {e['num_tokens']} tokens, {e['bytes'] / 1e6:.1f} MB, "
                     f"{e['bytes_per_token']:.0f} bytes/token, layers {e['layer_ids']}, {e['num_rejected']} rejected"
                     f"{_resumed(e)}")
    if "train" in st and "online" in st["train"]:
        o = st["train"]["online"]
        lines.append(f"  online           {o['num_extractions']} shard extractions ({o['num_reextracted']} redone, "
                     f"{o['num_lost']} lost), peak {o['peak_bytes_in_flight'] / 1e6:.1f} MB in flight (bound "
                     f"{o['max_inflight_bytes'] / 1e6:.1f} MB), engines waited {o['engine_idle_budget_s']:.0f}s "
                     f"for the trainer, the trainer {sum(o['trainer_wait_s']):.0f}s for engines")
    if "train" in st:
        t = st["train"]
        def loss(v):  # None: a checkpoint written before loss_last was kept in it
            return "-" if v is None else f"{v:.4f}"
        done = (f"{t.get('tokens_per_s', 0):.0f} tokens/s" if t.get("tokens_this_run", 1)
                else f"all done at step {t.get('resumed_from_step')} already, nothing trained in this run")
        if t.get("tokens_this_run", 1) and t.get("steady_tokens_per_s"):  # the first step compiles on CUDA
            done += f" ({t['steady_tokens_per_s']:.0f} after a first step of {t['first_step_s']:.1f}s)"
        lines.append(f"  train/           {t.get('steps')} steps, loss {loss(t.get('loss_first'))} -> "
                     f"{loss(t.get('loss_last'))}, {done}")
        lines += [f"                   {t['passes']:.2f} passes over the training data"] if t.get("passes") else []
        lines.append(f"  draft/           speculators-format EAGLE-3 draft: {report.get('draft')}")
    lines.extend(_accuracy_lines(st))
    if "eval" in st:
        lines += _eval_summary(st["eval"])
    lines += _serve_lines(report)
    lines.append("  time per stage   " + ", ".join(f"{k} {v:.0f}s" for k, v in report["seconds"].items()))
    if (startup := _startup_line(report.get("startup", {}))) is not None:
        lines.append("  start-up         " + startup)
    if (dtypes := _dtype_line(report.get("startup", {}))) is not None:
        lines.append("  compute dtype    " + dtypes)
    return "\n".join(lines)


def _eval_summary(ev: dict) -> list[str]:
    """The eval lines of the summary: acceptance length per k and sampling, and the decode speedup
    of each timed k per batch size and sampling, with the windows' range and whether it excludes 1."""
    modes = list(ev["samplings"])
    from eagle3.evaluate.verdict import sampling_label

    label = {m: sampling_label({"mode": m, **s}) for m, s in ev["samplings"].items()}
    als = ", ".join(f"k={a['num_speculative_tokens']}: " + " / ".join(f"{a[m]['acceptance_length']:.2f}" for m in modes)
                    for a in ev["acceptance"])
    ending = "past EOS" if ev.get("ignore_eos") else "answers ending at EOS"
    lines = [f"  eval.json        acceptance length in vLLM ({' / '.join(label[m] for m in modes)}; {ending}): {als}"]
    if "selection" in ev:
        from eagle3.evaluate.selection import selection_line

        lines.append(f"  draft chosen     {selection_line(ev['selection'])}")
    elif "selection_error" in ev:
        lines.append(f"  draft chosen     the last step's (measuring the drafts failed: {ev['selection_error']})")
    for sp in (ev.get("speed_by_k") or {"": ev.get("speed")}).values():
        if sp:
            lines += _speed_lines(sp, label)
    return lines


def _speed_lines(sp: dict, label: dict) -> list[str]:
    """The decode speedup of one timed k per batch size and sampling (eval.json's speed record)."""
    lines = [f"  eval.json        decode speedup, draft at k={sp['num_speculative_tokens']} over the target "
             f"alone ({'eager' if sp['enforce_eager'] else 'CUDA graphs'}; output tokens/s on answers ending "
             f"at EOS, {sp['results'][0]['speedup']['rounds']} rounds, "
             f"{'the engines taking turns' if sp.get('interleaved') else 'one engine after the other'}; "
             "95% interval over prompts):"]
    from eagle3.evaluate.verdict import pooled_rate

    for r in sp["results"]:
        s = r["speedup"]
        al = r["with_draft"].get("acceptance_length")
        # every round and wave pooled, as the ratio pools them (a mean of per-round rates need not divide to it)
        rate0, rate1 = pooled_rate(r["without_draft"]), pooled_rate(r["with_draft"])
        ci = f"{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}x" if s.get("ci95") else "no interval (one wave)"
        slower = "  <- the draft slows this batch size" if s.get("ci95") and s["ci95"][1] < 1 else ""
        lines.append(f"                   batch {r['batch_size']:>3} {label[r['mode']]:<22} {s['ratio']:.2f}x "
                     f"({rate0:.0f} -> {rate1:.0f}"
                     f" tokens/s; {ci}{f', AL {al:.2f}' if al else ''}; {r['num_prompts']} prompts, answers of "
                     f"at most {r['max_tokens']} tokens){slower}")
    return lines


def _serve_lines(report: dict) -> list[str]:
    """The `vllm serve` command for the job's draft at the k the eval found best, whether the draft
    pays at each batch size timed, and the k to serve at each (eagle3.serve; the job wrote the same
    record to the draft's serving.json)."""
    from eagle3.evaluate.verdict import batch_lines
    from eagle3.serve import SERVING_FILE, serving_record, verdict_of

    ev = report["stages"].get("eval")
    draft = report.get("draft") or (ev or {}).get("draft")
    target = report.get("target") or (ev or {}).get("target")
    if not draft or not target:
        return []
    rec = serving_record(target, draft, ev)
    where = f"; in {Path(draft) / SERVING_FILE}" if (Path(draft) / SERVING_FILE).exists() else ""
    lines = [f"  serve            {rec['vllm_serve']}",
             f"                   k={rec['num_speculative_tokens']}: {rec['k_chosen_by']}{where}"]
    if ev:
        # whether the draft pays at the served k (said so where several k were timed), then the k per
        # batch size: the best timed one, a better one the step-cost model predicts named (eagle3.evaluate.verdict)
        pays = rec["verdict"]
        if len(ev.get("speed_by_k") or {}) > 1:
            pays = [f"at k={rec['num_speculative_tokens']}, {v}" for v in pays]
        lines += [f"  {'verdict' if i == 0 else '':<16} {v}" for i, v in enumerate(pays + batch_lines(verdict_of(ev)))]
    return lines
