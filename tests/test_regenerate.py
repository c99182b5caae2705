"""Regenerate stage: turn by turn, rejects, reasoning blocks and the re-encoded tokens on the tiny
tokenizer with a scripted generator (no engine); the scheduler (turns of different conversations
and shards overlapping) against a scripted step engine; the warnings on data that can't be
trusted; the vLLM seam; the scheduler on a real vLLM engine; and the stage through real Ray +
real vLLM (CPU) on the tiny target, committed once per shard and resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3 import tiny
from eagle3.config import RegenerateConfig
from tests.helpers import job_config
from eagle3.prepare.regenerate import (SHARD_SCHEMA, Generation, Sampling, TurnScheduler, cut_warning, fallback_warning,
                               finalize, regenerate_conversations, render_shard, resolve_sampling,
                               sampling_fallbacks, split_reasoning, turn_seed, write_shard_table)

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo_conversations.jsonl"
GREEDY = Sampling(temperature=0.0, top_p=1.0, max_tokens=32, seed=0)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_tokenizer")
    tiny.build_tokenizer(tiny.corpus_texts(DEMO), d)
    return str(d)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def conv(*turns: str) -> list[dict]:
    """user, assistant, user, assistant, ... from the given texts."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


class Scripted:
    """Answers each prompt with the text `script` gives for (the prompt's text, its sampling);
    records every call so a test can see the rounds. Stands in for the engine only where the
    stage's own logic is under test; the engine is covered by the vLLM tests below."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def __call__(self, prompts, params):
        texts = [self.tok.decode(p) for p in prompts]
        self.calls.append((texts, params))
        out = []
        for text, kw in zip(texts, params):
            answer, reason = self.script(text, kw)
            out.append(Generation(answer, len(self.tok(answer, add_special_tokens=False)["input_ids"]), reason))
        return out


class Stepped:
    """A step engine (eagle3.prepare.regenerate.StepEngine, our interface) whose request takes one step per
    word of the answer `script` gives for (the prompt's text, its sampling), at most `max_running`
    at once (the rest wait, first come first served, as in vLLM's queue). Stands in for the engine
    only where the scheduler's own logic is under test."""

    def __init__(self, tok, script, max_running: int = 1000):
        self.tok, self.script, self.max_running = tok, script, max_running
        self.queue: list[list] = []  # [request id, steps left, generation]
        self.most_in_engine = 0
        self.steps = 0

    def add(self, request_id, prompt, params):
        answer, reason = self.script(self.tok.decode(prompt), params)
        gen = Generation(answer, len(self.tok(answer, add_special_tokens=False)["input_ids"]), reason)
        self.queue.append([request_id, max(1, len(answer.split())), gen])
        self.most_in_engine = max(self.most_in_engine, len(self.queue))

    def step(self):
        self.steps += 1
        done = []
        for req in self.queue[:self.max_running]:
            req[1] -= 1
            if req[1] == 0:
                done.append((req[0], req[2]))
        self.queue = [r for r in self.queue if r[1] > 0]
        return done


def masked_texts(tok, ids, mask) -> list[str]:
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append(tok.decode(ids[start:i]))
            start = None
    return spans


def test_rounds_see_the_regenerated_history_and_masks_cover_the_new_text(tok):
    samples = [("a", conv("Tell me about rivers.", "old 1", "More.", "old 2")),
               ("b", conv("Explain space.", "old 3")),
               ("c", conv("Hi.", "old 4", "Again.", "old 5", "Once more.", "old 6"))]
    answers = iter(f"new {i}." for i in range(100))
    gen = Scripted(tok, lambda text, kw: (next(answers), "stop"))
    sampled = Sampling(temperature=0.7, top_p=0.9, max_tokens=32, seed=0)
    table, stats = regenerate_conversations(gen, tok, samples, sampled, max_model_len=512, max_length=512)
    # One batch per round: round 0 has all three conversations, round 1 two, round 2 one.
    assert [len(texts) for texts, _ in gen.calls] == [3, 2, 1]
    # Round 1's prompt of 'a' holds round 0's new answer, not the original one.
    round1_a = gen.calls[1][0][0]
    assert "new 0." in round1_a and "old 1" not in round1_a and round1_a.endswith("<|assistant|>\n")
    assert table.schema == SHARD_SCHEMA and table.column("sample_id").to_pylist() == ["a", "b", "c"]
    assert stats.num_samples == 3 and stats.num_rejected == 0 and stats.num_turns == 6
    for row in table.to_pylist():
        new = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert all(t.startswith("new ") for t in new)
        # The loss mask covers exactly the regenerated answers and their end-of-turn token.
        assert masked_texts(tok, row["input_ids"], row["loss_mask"]) == [t + "<|end|>" for t in new]
        assert row["num_tokens"] == len(row["input_ids"])
    # Each turn's seed depends on the sample and the turn, not on the batch it was in.
    seeds = [kw["seed"] for _, params in gen.calls for kw in params]
    assert seeds[0] == turn_seed(0, "a", 0) and len(set(seeds)) == len(seeds)
    assert gen.calls[0][1][0]["temperature"] == 0.7 and gen.calls[0][1][0]["top_p"] == 0.9
    # Greedy decoding is given no seed (no generator: nothing to seed).
    greedy = Scripted(tok, lambda text, kw: ("new.", "stop"))
    regenerate_conversations(greedy, tok, samples[:1], GREEDY, max_model_len=512, max_length=512)
    assert all("seed" not in kw for _, params in greedy.calls for kw in params)
    # regenerate.seed null: sampled without per-turn seeds (the engine's own generator).
    unseeded = Scripted(tok, lambda text, kw: ("new.", "stop"))
    regenerate_conversations(unseeded, tok, samples[:1], Sampling(0.7, 0.9, 32, None), max_model_len=512,
                             max_length=512)
    assert unseeded.calls and all("seed" not in kw for _, params in unseeded.calls for kw in params)
    assert job_config({"regenerate.seed": None}).regenerate.seed is None


def test_turns_of_different_conversations_overlap_without_rounds(tok):
    """A conversation's next turn is submitted as soon as its previous turn is back: 'quick''s
    second turn goes in while 'slow''s first is still decoding, and no step waits for a round."""
    samples = [("slow", conv("Write a long one.", "x")),
               ("quick", conv("Hi.", "x", "Again.", "x", "Third.", "x"))]

    def script(text, kw):
        return ("one two three four five six seven eight." if "long one" in text else "ok."), "stop"

    engine = Stepped(tok, script)
    sched = TurnScheduler(engine, tok, GREEDY, max_model_len=512, trace=True)
    sched.add_shard(0, samples)
    [run] = sched.run()
    ev = sched.events
    assert ev.index(("submit", "quick", 1)) < ev.index(("end", "slow", 0))
    assert ev.index(("submit", "quick", 2)) < ev.index(("end", "slow", 0))
    assert engine.steps == 8  # the slowest turn's length, not the sum of each round's slowest
    table, stats = render_shard(run, tok, max_length=512)
    assert stats.num_turns == 4 and stats.num_turns_ended == 4 and stats.num_samples == 2
    assert table.column("sample_id").to_pylist() == ["slow", "quick"]  # input order, not finishing order


def test_shards_share_the_engine_and_finish_on_their_own(tok):
    """Several shards in flight: a later shard's conversations fill the engine beside an earlier
    shard's slow one and it is done first; at most max_in_engine requests are in the engine, the
    rest wait oldest shard first; the rows equal those of the round-by-round path."""
    def script(text, kw):
        return ("a b c d e f g h i j k l." if "Slow" in text else "fine."), "stop"

    shard0 = [("s0a", conv("Slow one.", "x")), ("s0b", conv("Hi.", "x"))]
    shard1 = [(f"s1{k}", conv("Hi.", "x", "More.", "x")) for k in range(3)]
    engine = Stepped(tok, script)
    sched = TurnScheduler(engine, tok, GREEDY, max_model_len=512, max_in_engine=3, trace=True)
    sched.add_shard(0, shard0)
    sched.add_shard(1, shard1)
    finished = []
    while not sched.idle:
        finished += [(run.key, engine.steps) for run in sched.step()]
    assert [k for k, _ in finished] == [1, 0] and finished[0][1] < finished[1][1]
    assert engine.most_in_engine == 3
    # Oldest shard first: shard 0's two turns went in before any of shard 1's.
    submits = [sid for kind, sid, _ in sched.events if kind == "submit"]
    assert submits[:2] == ["s0a", "s0b"] and submits[2].startswith("s1")
    # Same conversations, same rows as the round-by-round path (BatchStepEngine).
    sched = TurnScheduler(Stepped(tok, script), tok, GREEDY, max_model_len=512, max_in_engine=2)
    sched.add_shard("x", shard0 + shard1)
    [run] = sched.run()
    stepped, _ = render_shard(run, tok, max_length=512)
    batched, _ = regenerate_conversations(Scripted(tok, script), tok, shard0 + shard1, GREEDY, max_model_len=512,
                                          max_length=512)
    assert stepped.equals(batched)
    with pytest.raises(ValueError, match="max_in_engine=0"):
        TurnScheduler(engine, tok, GREEDY, max_model_len=512, max_in_engine=0)


def test_turns_the_target_ended_are_counted_apart_from_cut_ones_and_untrusted_data_warns(tok, tmp_path):
    samples = [("a", conv("Tell me about rivers.", "x", "More.", "x")), ("b", conv("Hi.", "x"))]
    sampling = Sampling(temperature=1.0, top_p=1.0, max_tokens=32, seed=0)
    _, stats = regenerate_conversations(
        Scripted(tok, lambda t, kw: ("a b c", "length") if "rivers" in t else ("fine.", "stop")), tok, samples,
        sampling, max_model_len=512, max_length=512, cut="end")
    assert (stats.num_turns, stats.num_turns_ended, stats.num_turns_cut, stats.num_turns_cut_at_max_tokens) == (2, 1, 1, 1)
    # Cut by the context's end is a cut, but not one that regenerate.max_tokens would fix.
    _, stats = regenerate_conversations(Scripted(tok, lambda t, kw: ("a b c", "length")), tok, samples[1:], sampling,
                                        max_model_len=20, max_length=512, cut="end")
    assert (stats.num_turns_cut, stats.num_turns_cut_at_max_tokens) == (1, 0)

    # T=1 because the target gives no sampling: named, with the settings to change.
    assert sampling_fallbacks(RegenerateConfig(), str(tmp_path)) == ["temperature", "top_p"]
    msg = fallback_warning(["temperature", "top_p"], sampling)
    assert "temperature 1, top_p 1" in msg and "regenerate.temperature and regenerate.top_p" in msg
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2}))
    assert sampling_fallbacks(RegenerateConfig(), str(tmp_path)) == ["top_p"]
    assert fallback_warning(["top_p"], sampling) is None
    assert sampling_fallbacks(RegenerateConfig(temperature=0.5, top_p=0.9), str(tmp_path)) == []
    # Most turns cut at max_tokens: warned with the numbers and the setting, once there are enough turns.
    msg = cut_warning(100, 85, sampling, ["temperature"])
    assert "85 of 100 turns" in msg and "(85%)" in msg and "regenerate.max_tokens=32" in msg
    assert "fell back to temperature 1" in msg
    assert "regenerate.temperature / top_p" in cut_warning(100, 85, Sampling(0.7, 0.9, 32, 0), [])
    assert cut_warning(100, 50, sampling, []) is None  # half is not most
    assert cut_warning(10, 9, sampling, []) is None  # too few to judge mid-stage ...
    assert "9 of 10 turns" in cut_warning(10, 9, sampling, [], final=True)  # ... but said at the end
    # The job's final summary shows the turns ended apart from the cut ones, and the warnings.
    from ray_jobs.summary import format_summary

    text = format_summary({"seconds": {"total": 10}, "output_dir": "/o", "target": "t", "stages": {"regenerate": {
        "num_samples": 5, "num_generated_tokens": 100, "num_rejected": 1, "num_shards": 1, "shards_skipped": 0,
        "num_turns": 100, "num_turns_ended": 15, "num_turns_cut": 85, "num_turns_cut_at_max_tokens": 85,
        "untrusted": [msg]}}})
    assert "100 turns: 15 ended by the target, 85 cut (85 at regenerate.max_tokens)" in text
    assert f"WARNING {msg}" in text


def test_rejects_name_the_turn_and_the_reason(tok):
    samples = [("cut", conv("Tell me about rivers.", "x")),
               ("empty", conv("Explain space.", "x")),
               ("long", conv("word " * 60, "x")),  # the prompt alone fills max_model_len
               ("ok", conv("Hi.", "x", "Again.", "x")),
               ("late", conv("Hi.", "x", "cut me later.", "x"))]

    def script(text, kw):
        if "rivers" in text or "cut me later" in text:
            return "a b c", "length"
        if "space" in text:
            return "  \n", "stop"
        return "fine.", "stop"

    table, stats = regenerate_conversations(Scripted(tok, script), tok, samples, GREEDY, max_model_len=48,
                                            max_length=48)
    reasons = {r["sample_id"]: r["reason"] for r in stats.rejects}
    assert table.column("sample_id").to_pylist() == ["ok"]
    assert stats.num_samples + stats.num_rejected == len(samples)
    assert "assistant turn 0" in reasons["cut"] and "finish_reason 'length'" in reasons["cut"]
    assert "regenerate.max_tokens" in reasons["cut"]
    assert reasons["empty"].startswith("assistant turn 0: empty generation")
    assert "no room to generate within max_model_len=48" in reasons["long"]
    assert reasons["late"].startswith("assistant turn 1:")  # turn 0 went through, turn 1 was cut
    # A conversation that encodes longer than max_length after regeneration is a reject too.
    _, stats = regenerate_conversations(Scripted(tok, lambda t, kw: ("many words " * 20, "stop")), tok,
                                        [("grew", conv("Hi.", "x"))], GREEDY, max_model_len=512, max_length=40)
    assert stats.rejects[0]["sample_id"] == "grew" and "> prepare.max_length=40" in stats.rejects[0]["reason"]


def test_the_closing_warning_counts_rejects_cut_at_a_length_limit_and_names_the_settings(tok):
    """On ShareGPT the 1.5B's regeneration rejected 43% of its conversations for a turn cut at 512
    tokens, and the job's warning gave only the count: it now says why and what keeps them."""
    from eagle3.prepare.regenerate import reject_warning

    samples = [("cut", conv("Tell me about rivers.", "x")), ("ok", conv("Hi.", "x")), ("empty", conv("Explain space.", "x"))]

    def script(text, kw):
        if "rivers" in text:
            return "a b c", "length"
        return ("  \n", "stop") if "space" in text else ("fine.", "stop")

    _, stats = regenerate_conversations(Scripted(tok, script), tok, samples, Sampling(0.0, 1.0, 3, 0),
                                        max_model_len=48, max_length=48)
    # max_tokens beyond the room the prompt leaves: the same answer is cut by the context's end.
    _, ctx = regenerate_conversations(Scripted(tok, script), tok, [("ctx", conv("Tell me about rivers.", "x"))],
                                      Sampling(0.0, 1.0, 100, 0), max_model_len=48, max_length=48)
    rejects = stats.rejects + ctx.rejects
    assert [r["sample_id"] for r in rejects] == ["cut", "empty", "ctx"]
    msg = reject_warning(rejects, 4, "reject", 3, "r/rejects.jsonl")
    assert msg.startswith("regenerate rejected 3 of 4 conversations (75%); reasons in r/rejects.jsonl. ")
    assert "1 for a turn cut at regenerate.max_tokens=3, 1 at the context's end" in msg
    assert "set regenerate.cut: end" in msg and "raise regenerate.max_tokens" in msg
    assert "regenerate.cut" not in reject_warning(rejects[1:2], 4, "reject", 3, "r")  # the empty one alone
    assert "regenerate.cut" not in reject_warning(rejects, 4, "end", 3, "r")  # nothing to change there
    assert reject_warning([], 4, "reject", 3, "r") is None


def test_cut_end_keeps_what_came_before_the_cut(tok):
    """regenerate.cut 'end': the same conversations as above end at their cut instead of being
    rejected, keeping exactly the turns generated before it (a cut answer as the last turn)."""
    samples = [("cut", conv("Tell me about rivers.", "x", "More.", "x")),
               ("empty", conv("Explain space.", "x")),
               ("late", conv("Hi.", "x", "cut me later.", "x", "Third.", "x")),
               ("room", conv("Hi.", "x", "word " * 30, "x"))]  # turn 1's prompt fills max_model_len

    def script(text, kw):
        if text.endswith("rivers.<|end|>\n<|assistant|>\n") or "cut me later.<|end|>\n<|assistant|>\n" in text[-40:]:
            return "a b c", "length"
        if "space" in text:
            return "  \n", "stop"
        return "fine.", "stop"

    gen = Scripted(tok, script)
    table, stats = regenerate_conversations(gen, tok, samples, GREEDY, max_model_len=48, max_length=48, cut="end")
    rows = {r["sample_id"]: r for r in table.to_pylist()}
    answers = {k: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for k, r in rows.items()}
    assert answers == {"cut": ["a b c"], "late": ["fine.", "a b c"], "room": ["fine."]}
    # An empty answer is still a reject; nothing else is.
    assert [r["sample_id"] for r in stats.rejects] == ["empty"]
    assert stats.num_samples == 3 and stats.num_ended_early == 3
    # Round 1 generates only 'late' (cut 'cut' ends, 'room' has no room); no round 2 ('late' ended).
    assert [len(texts) for texts, _ in gen.calls] == [4, 1]
    # The cut answer is trained like any other answer (the template closes the turn).
    assert masked_texts(tok, rows["cut"]["input_ids"], rows["cut"]["loss_mask"]) == ["a b c<|end|>"]
    # Over max_length after regeneration: cut after the last whole assistant turn that fits.
    table, stats = regenerate_conversations(
        Scripted(tok, lambda t, kw: ("ok." if "First" in t[-30:] else "many words " * 20, "stop")), tok,
        [("grew", conv("First.", "x", "Second.", "x"))], GREEDY, max_model_len=512, max_length=40, cut="end")
    assert stats.num_rejected == 0 and stats.num_ended_early == 1
    assert [m["content"] for m in table.to_pylist()[0]["messages"] if m["role"] == "assistant"][0] == "ok."
    assert max(table.column("num_tokens").to_pylist()) <= 40
    with pytest.raises(ValueError, match="cut='keep'"):
        regenerate_conversations(gen, tok, samples, GREEDY, max_model_len=48, max_length=48, cut="keep")


def test_a_think_block_becomes_reasoning_content(tok):
    assert split_reasoning("<think>\nweigh it\n</think>\n\nThe answer.") == {
        "role": "assistant", "content": "The answer.", "reasoning_content": "weigh it"}
    # The template's generation prompt opened the block: only the closing tag is generated.
    assert split_reasoning("weigh it</think>The answer.")["reasoning_content"] == "weigh it"
    assert split_reasoning("No block.") == {"role": "assistant", "content": "No block."}
    table, stats = regenerate_conversations(
        Scripted(tok, lambda t, kw: ("<think>hmm</think>Done.", "stop")), tok, [("r", conv("Hi.", "x"))], GREEDY,
        max_model_len=512, max_length=512)
    msg = table.to_pylist()[0]["messages"][1]
    assert msg == {"role": "assistant", "content": "Done.", "reasoning_content": "hmm"}
    # Reasoning with no answer after it is an empty generation.
    _, stats = regenerate_conversations(Scripted(tok, lambda t, kw: ("<think>hmm</think>", "stop")), tok,
                                        [("r", conv("Hi.", "x"))], GREEDY, max_model_len=512, max_length=512)
    assert "empty generation after its reasoning" in stats.rejects[0]["reason"]


def test_reasoning_template_turns_become_one_sample_each_with_their_reasoning_in_the_mask():
    """A Qwen3-like template drops reasoning from earlier turns: each regenerated turn is its own
    sample (ids '#t<k>', as prepare names them), trained on its reasoning and answer."""
    from eagle3.prepare.chat_template import TEMPLATES
    from eagle3.prepare.regenerate import conversation_ids
    from tests.templates import FAMILIES, make_tokenizer

    qtok = make_tokenizer(TEMPLATES["qwen3"])
    answers = iter([("think one", "The Nile."), ("think two", "The Danube.")])

    def script(text, kw):
        r, a = next(answers)
        return f"<think>\n{r}\n</think>\n\n{a}", "stop"

    gen = Scripted(qtok, script)
    table, stats = regenerate_conversations(gen, qtok, [("q", conv("Tell me something about rivers.", "old",
                                                                   "Another.", "old"))],
                                            GREEDY, max_model_len=512, max_length=512)
    # Round 1's prompt holds round 0's answer in the template's history form (no reasoning).
    assert "The Nile." in gen.calls[1][0][0] and "think one" not in gen.calls[1][0][0]
    rows = table.to_pylist()
    assert [r["sample_id"] for r in rows] == ["q#t1", "q#t2"] and stats.num_samples == 1
    assert rows[0]["messages"][1] == {"role": "assistant", "content": "The Nile.", "reasoning_content": "think one"}
    want = FAMILIES["qwen3-thinking"].generated
    assert masked_texts(qtok, rows[0]["input_ids"], rows[0]["loss_mask"]) == [want("think one", "The Nile.")]
    assert masked_texts(qtok, rows[1]["input_ids"], rows[1]["loss_mask"]) == [want("think two", "The Danube.")]
    # Such a conversation's prepared samples map back to one conversation to regenerate.
    assert conversation_ids(["a", "q#t1", "q#t2", "b"]) == ["a", "q", "b"]


def test_chat_template_kwargs_reach_the_served_prompt_and_the_samples():
    """prepare.chat_template_kwargs (here thinking off) is how the target is served: the prompt it
    regenerates from ends in the template's empty think block, and the sample keeps no reasoning."""
    from eagle3.prepare.chat_template import TEMPLATES
    from tests.templates import make_tokenizer

    qtok = make_tokenizer(TEMPLATES["qwen3"])
    gen = Scripted(qtok, lambda t, kw: ("The Nile.", "stop"))
    table, _ = regenerate_conversations(gen, qtok, [("q", conv("Tell me about rivers.", "old"))], GREEDY,
                                        max_model_len=512, max_length=512,
                                        chat_template_kwargs={"enable_thinking": False})
    assert gen.calls[0][0][0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    [row] = table.to_pylist()
    assert row["messages"][1] == {"role": "assistant", "content": "The Nile.", "reasoning_content": None}
    assert masked_texts(qtok, row["input_ids"], row["loss_mask"]) == ["The Nile.<|im_end|>"]


def test_source_messages_read_the_records_as_prepare_read_them(tmp_path):
    """The stage re-reads messages by sample id with prepare's leading_assistant, so a record
    prepare kept without its leading assistant turn is regenerated from the same turns."""
    from eagle3.prepare.regenerate import source_messages

    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"id": "chunk", "conversations": [
        {"from": "gpt", "value": "r0"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}) + "\n")
    got = source_messages(str(src), None, {"chunk"}, leading_assistant="drop")
    assert got == {"chunk": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(ValueError, match="not in prepare.conversations"):
        source_messages(str(src), None, {"chunk"})  # rejected when read as prepare's default does


def test_sampling_defaults_come_from_the_targets_generation_config(tmp_path):
    assert resolve_sampling(RegenerateConfig(), str(tmp_path)) == Sampling(1.0, 1.0, 1024, 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    assert resolve_sampling(RegenerateConfig(), str(tmp_path)) == Sampling(0.6, 0.95, 1024, 0)
    assert resolve_sampling(RegenerateConfig(temperature=0, seed=3), str(tmp_path)) == Sampling(0.0, 0.95, 1024, 3)
    with pytest.raises(ValueError, match=r"config regenerate.top_p=1.5: must be in \(0, 1\]"):
        RegenerateConfig(top_p=1.5)


def test_regenerate_stage_needs_the_switch():
    with pytest.raises(ValueError, match="lists regenerate but regenerate.enabled is false"):
        job_config({"stages": ["prepare", "regenerate"]})
    cfg = job_config({"regenerate.enabled": True, "stages": ["prepare", "regenerate"]})
    assert cfg.regenerate.enabled and cfg.stages == ("prepare", "regenerate")


def test_the_job_stops_before_ray_when_regeneration_cannot_read_the_conversations(tmp_path):
    """A carried prepared/ without the conversations file: regeneration would fail after the
    target resolved and the doctor started an engine (a 1.5B job on the H200 did, 93 s in); the job
    says so before Ray starts. A finished regenerated/ needs no file."""
    from ray_jobs.run import check_inputs, run

    out = tmp_path / "job"
    (out / "prepared").mkdir(parents=True)
    (out / "prepared" / "tokens.parquet").write_bytes(b"")
    cfg = job_config({"output_dir": str(out), "regenerate.enabled": True,
                                 "stages": ["regenerate", "train"], "prepare.conversations": str(tmp_path / "gone.json")})
    with pytest.raises(SystemExit, match=r"regenerate will read the conversations, and cannot: .*gone.json.* does not exist"):
        run(cfg)
    check_inputs(job_config({"output_dir": str(out), "stages": ["train"],  # regeneration off: no reader
                                        "prepare.conversations": str(tmp_path / "gone.json")}), out)
    (out / "regenerated").mkdir()
    (out / "regenerated" / "tokens.parquet").write_bytes(b"")
    check_inputs(cfg, out)


def test_finalize_writes_tokens_in_shard_order_with_the_tokens_schema(tok, tmp_path):
    from eagle3.extract.manifest import Manifest
    from eagle3.prepare.tokens import read_tokens

    manifest = Manifest(tmp_path, "parquet")
    manifest.open({"test": 1})
    gen = Scripted(tok, lambda t, kw: ("fine.", "stop"))
    for shard, ids in ((1, ["c"]), (0, ["a", "b"])):  # committed out of order
        table, stats = regenerate_conversations(gen, tok, [(i, conv("Hi.", "x")) for i in ids], GREEDY,
                                                max_model_len=512, max_length=512)
        write_shard_table(table, manifest.data_path(shard))
        manifest.commit(shard, stats.to_dict())
    with pytest.raises(RuntimeError, match=r"shards \[2\] uncommitted"):
        finalize(manifest, 3)
    summary = finalize(manifest, 2)
    tokens = read_tokens(tmp_path)  # refuses any other schema
    assert tokens.column("sample_id").to_pylist() == ["a", "b", "c"] and summary["num_samples"] == 3
    assert (tmp_path / "rejects.jsonl").read_text() == ""


def test_an_input_that_only_grew_keeps_its_full_shards(tmp_path):
    """A larger max_samples resubmitted into the same output_dir (a ShareGPT run grew from 12,000 to
    17,672 records and needed a script of its own, extend_regenerated.py, to keep 44 regenerated shards):
    where the old samples are the new input's first ones, in order, and nothing else changed, the
    shards full in the old plan hold the same samples in the new one and stay; the old last one, not
    full, is dropped. Anything else that differs is refused, nothing deleted."""
    from eagle3.extract.manifest import Grown, Manifest
    from eagle3.prepare.regenerate import regenerate_fingerprint

    def fp(ids, **kw):
        return regenerate_fingerprint(ids, 3, GREEDY, target="t", max_length=512, assistant_only_loss=True, **kw)

    ids = [f"c{i}" for i in range(8)]
    manifest = Manifest(tmp_path, "parquet")
    assert manifest.open(fp(ids[:5]), sample_ids=ids[:5]) is None
    for shard in (0, 1):  # rows 0-2 (full) and 3-4 (the old plan's last, not full)
        manifest.data_path(shard).write_bytes(b"x")
        manifest.commit(shard, {"num_samples": 3 - shard})
    for other, given in ((fp(ids[1:7]), ids[1:7]),  # not the old samples first
                         (fp(ids[:4]), ids[:4]),  # shrunk
                         (fp(ids, cut="end"), ids),  # grown, and another setting
                         (fp(ids), None)):  # grown, the ids not given
        with pytest.raises(ValueError, match="holds shards of another input"):
            manifest.open(other, sample_ids=given)
    assert sorted(manifest.committed()) == [0, 1] and manifest.data_path(1).exists()

    assert manifest.open(fp(ids), sample_ids=ids) == Grown(5, [1])
    assert sorted(manifest.committed()) == [0] and not manifest.data_path(1).exists()
    assert manifest.open(fp(ids), sample_ids=ids) is None  # the manifest names the new input now
    # All shards of 8 done (the last, rows 6-7, not full); grown to 9, then to 11: the last shard goes
    # only where it was not full.
    for shard in (1, 2):
        manifest.data_path(shard).write_bytes(b"x")
        manifest.commit(shard, {})
    assert manifest.open(fp(ids + ["c8"]), sample_ids=ids + ["c8"]) == Grown(8, [2])
    manifest.data_path(2).write_bytes(b"x")
    manifest.commit(2, {})  # rows 6-8: full
    more = ids + ["c8", "c9", "c10"]
    assert manifest.open(fp(more), sample_ids=more) == Grown(9, [])
    assert sorted(manifest.committed()) == [0, 1, 2]
    # The job's summary line says what a stage kept, and from what
    from ray_jobs.summary import _resumed

    stage = {"num_shards": 4, "shards_skipped": 3, "grown": Grown(9, [])._asdict()}
    assert _resumed(stage) == "; 3 of 4 shards already committed (kept from an input of 9)"


@pytest.fixture(scope="module")
def weightless_target(tok_dir, tmp_path_factory) -> str:
    """The tiny tokenizer and a Llama config, no weights: enough for vLLM to resolve engine args."""
    import shutil

    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("weightless")
    shutil.copytree(tok_dir, d, dirs_exist_ok=True)
    LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096).save_pretrained(str(d))
    return str(d)


def test_generation_engine_args_and_sampling_resolve_in_vllm(weightless_target):
    """The seam compat.vllm_engine.generation_engine_kwargs / generate_texts stand on: vLLM
    takes our engine arguments as given (prefix caching on, our length), and SamplingParams
    keeps each turn's sampling and seed. Fails if vLLM renames or overrides one of them."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from compat.vllm_engine import generation_engine_kwargs

    kw = generation_engine_kwargs(model=weightless_target, max_model_len=384, dtype="bfloat16", max_num_seqs=8,
                                  enforce_eager=True)
    cfg = EngineArgs(**kw).create_engine_config()
    assert cfg.cache_config.enable_prefix_caching is True
    assert cfg.model_config.max_model_len == 384 and cfg.scheduler_config.max_num_seqs == 8
    assert not cfg.model_config.skip_tokenizer_init  # generate_texts reads outputs as text
    # On CPU no request is part-prefilled: vLLM 0.32 would rewind a seeded request's CPU generator
    # (compat.vllm_engine.cpu_seeded_sampling_kwargs). A GPU engine keeps vLLM's own scheduling.
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        assert not cfg.scheduler_config.enable_chunked_prefill
        assert cfg.scheduler_config.max_num_batched_tokens >= 384
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, seed=turn_seed(0, "s", 1))
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.seed) == (0.7, 0.9, 5, turn_seed(0, "s", 1))
    assert sp.skip_special_tokens  # end-of-turn tokens stay out of the regenerated text


@pytest.mark.slow
def test_scheduler_overlaps_turns_on_a_real_vllm_engine(tiny_target, monkeypatch):
    """TurnScheduler over a real vLLM engine (compat.vllm_engine.VLLMStepEngine; multiprocess engine
    core, CPU): every turn comes back under its own id, a conversation's next turn is submitted
    while another conversation's turn of the same rank is still decoding (no rounds), two shards
    share the engine, and seeded turns give the same text alone as beside other conversations."""
    from transformers import AutoTokenizer

    from compat.vllm_engine import Engine, VLLMStepEngine, engine_env, generation_engine_kwargs
    from eagle3.prepare.conversations import iter_records

    for k, v in engine_env(in_process=False, cpu_kvcache_space_gib=1).items():
        monkeypatch.setenv(k, v)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    records = [(r.sample_id, r.messages) for r in iter_records(str(DEMO), 12) if r.reason is None]
    sampled = Sampling(temperature=0.8, top_p=0.95, max_tokens=40, seed=5)
    with Engine(**generation_engine_kwargs(model=tiny_target, max_model_len=512, dtype="float32", max_num_seqs=4,
                                           enforce_eager=True)) as engine:
        sched = TurnScheduler(VLLMStepEngine(engine.llm), tok, sampled, max_model_len=512, cut="end",
                              max_in_engine=5, trace=True)
        sched.add_shard(0, records[:6])
        sched.add_shard(1, records[6:])
        runs = {run.key: run for run in sched.run()}
        alone = TurnScheduler(VLLMStepEngine(engine.llm), tok, sampled, max_model_len=512, cut="end")
        alone.add_shard(0, records[:1])
        [alone_run] = alone.run()
    assert sorted(runs) == [0, 1] and not sched.num_in_engine
    tables = {k: render_shard(run, tok, max_length=512, cut="end") for k, run in runs.items()}
    stats = [st for _, st in tables.values()]
    assert sum(st.num_samples + st.num_rejected for st in stats) == len(records)
    ev = sched.events
    assert len(ev) == 2 * sum(st.num_turns for st in stats) and sum(st.num_turns for st in stats) > len(records)
    ends = {(sid, t): i for i, (kind, sid, t) in enumerate(ev) if kind == "end"}
    overlapped = [(sid, t) for i, (kind, sid, t) in enumerate(ev) if kind == "submit" and t >= 1
                  and any(j > i for (other, u), j in ends.items() if other != sid and u == t - 1)]
    print("turns:", sum(st.num_turns for st in stats), "submitted before a turn of the rank before ended:",
          len(overlapped), overlapped[:4])
    assert overlapped  # e.g. B's turn 1 went in before A's turn 0 was back
    # Seeded sampling per turn: the same conversation alone in the engine reads the same.
    alone_table, _ = render_shard(alone_run, tok, max_length=512, cut="end")
    first = tables[0][0].to_pylist()
    assert alone_table.to_pylist()[0]["messages"] == next(r["messages"] for r in first
                                                          if r["sample_id"] == records[0][0])


# ----------------------------------------------------------------------- real Ray + real vLLM

def _job(tmp_path, conversations, **regen):
    return job_config({
        "output_dir": str(tmp_path), "stages": ["prepare", "regenerate", "extract"],
        "prepare.conversations": str(conversations), "prepare.max_length": 512, "prepare.num_eval_prompts": 1,
        "extract.num_replicas": 1, "extract.placement_timeout_s": 60,
        **{f"regenerate.{k}": v for k, v in {"enabled": True, **regen}.items()}})


@pytest.mark.slow
def test_vllm_regenerates_each_conversation_once_and_resumes(tiny_target, tmp_path, ray_local):
    from transformers import AutoTokenizer

    from eagle3.prepare.tokens import prepare_dataset, read_tokens
    from ray_jobs.regenerate import run_regenerate

    lines = DEMO.read_text().splitlines()[:6]  # the first one is held out for eval
    (tmp_path / "conv.jsonl").write_text("\n".join(lines) + "\n")
    cfg = _job(tmp_path, tmp_path / "conv.jsonl", temperature=0, max_tokens=48, samples_per_shard=2,
               enforce_eager=True)
    prepare_dataset(cfg.prepare, tiny_target, str(tmp_path / "prepared"))
    prepared = read_tokens(tmp_path / "prepared")
    assert prepared.num_rows == 5
    out = tmp_path / "regenerated"
    first = run_regenerate(cfg, str(tmp_path / "prepared" / "tokens.parquet"), tiny_target, str(out), progress=False)
    assert first["num_shards"] == 3 and first["shards_skipped"] == 0
    assert first["num_samples"] + first["num_rejected"] == 5 and first["num_samples"] >= 1
    assert first["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 48, "seed": 0}
    assert first["num_generated_tokens"] > 0
    assert first["num_turns"] == first["num_turns_ended"] + first["num_turns_cut"] > 0  # "stop" or "length"
    # Several shards in flight on the one replica: a shard started before another one was done.
    recs = [json.loads(p.read_text()) for p in sorted((out / "committed").glob("shard-*.json"))]
    assert len(recs) == 3 and any(b["started_at"] < a["finished_at"] for a in recs for b in recs if a is not b)
    tokens = read_tokens(out)
    kept = tokens.column("sample_id").to_pylist()
    rejected = [json.loads(line)["sample_id"] for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert sorted(kept + rejected) == sorted(prepared.column("sample_id").to_pylist())  # each exactly once
    tok = AutoTokenizer.from_pretrained(tiny_target)
    convs = {r["sample_id"]: r["messages"] for f in first["files"] for r in pq.read_table(f).to_pylist()}
    originals = {r["sample_id"]: r for r in prepared.to_pylist()}
    changed = 0
    for row in tokens.to_pylist():
        new = [m["content"] for m in convs[row["sample_id"]] if m["role"] == "assistant"]
        assert all(t.strip() for t in new)
        assert masked_texts(tok, row["input_ids"], row["loss_mask"]) == [t + "<|end|>" for t in new]
        changed += row["input_ids"] != originals[row["sample_id"]]["input_ids"]
    assert changed >= 1  # the target's own text, not the source's

    # A crash after shard 1's file was written but before its commit, and a half-written file:
    # the rerun redoes shard 1 only, and greedy decoding gives the same conversations again.
    (out / "committed" / "shard-000001.json").unlink()
    (out / "data" / "shard-000001.parquet").write_bytes(b"partial")
    second = run_regenerate(cfg, str(tmp_path / "prepared" / "tokens.parquet"), tiny_target, str(out),
                            progress=False)
    assert second["shards_skipped"] == 2
    assert [s for rep in second["replicas"] for s in rep["shards"]] == [1]
    assert read_tokens(out).equals(tokens)

    # A finished run starts no engine; other sampling settings are refused, nothing lost.
    third = run_regenerate(cfg, str(tmp_path / "prepared" / "tokens.parquet"), tiny_target, str(out), progress=False)
    assert third["shards_skipped"] == 3 and "replicas" not in third
    with pytest.raises(ValueError, match="holds shards of another input"):
        run_regenerate(_job(tmp_path, tmp_path / "conv.jsonl", temperature=0.5, max_tokens=48, samples_per_shard=2),
                       str(tmp_path / "prepared" / "tokens.parquet"), tiny_target, str(out), progress=False)
    assert read_tokens(out).equals(tokens)

    # More records into a copy of that output (a larger max_samples, resubmitted): the shards that were
    # full stay, the old last one (one conversation of two) is dropped, and only it and the new ones are
    # regenerated; each conversation once.
    import shutil

    shutil.copytree(out, tmp_path / "grown")
    (tmp_path / "conv9.jsonl").write_text("\n".join(DEMO.read_text().splitlines()[:9]) + "\n")
    cfg9 = _job(tmp_path, tmp_path / "conv9.jsonl", temperature=0, max_tokens=48, samples_per_shard=2,
                enforce_eager=True)
    prepare_dataset(cfg9.prepare, tiny_target, str(tmp_path / "prepared9"))
    ids9 = read_tokens(tmp_path / "prepared9").column("sample_id").to_pylist()
    assert ids9[:5] == prepared.column("sample_id").to_pylist() and len(ids9) > 6
    grown = run_regenerate(cfg9, str(tmp_path / "prepared9" / "tokens.parquet"), tiny_target, str(tmp_path / "grown"),
                           progress=False)
    assert grown["grown"] == {"num_samples": 5, "dropped": [2]} and grown["shards_skipped"] == 2
    assert sorted(s for rep in grown["replicas"] for s in rep["shards"]) == list(range(2, (len(ids9) + 1) // 2))
    kept9 = read_tokens(tmp_path / "grown").column("sample_id").to_pylist()
    rejected9 = [json.loads(line)["sample_id"] for line in (tmp_path / "grown" / "rejects.jsonl").read_text().splitlines()]
    assert sorted(kept9 + rejected9) == sorted(ids9)

    # Sampled with per-turn seeds: the CPU engine takes seeded requests (no part-prefilled ones,
    # compat.vllm_engine.cpu_seeded_sampling_kwargs), and each conversation is kept or rejected once.
    sampled = run_regenerate(_job(tmp_path, tmp_path / "conv.jsonl", temperature=0.8, top_p=0.9, seed=1, max_tokens=48,
                                  samples_per_shard=5, enforce_eager=True),
                             str(tmp_path / "prepared" / "tokens.parquet"), tiny_target, str(tmp_path / "sampled"),
                             progress=False)
    print("greedy:", {k: first[k] for k in ("num_samples", "num_rejected", "num_generated_tokens",
                                            "tokens_per_s_per_replica")},
          "sampled:", {k: sampled[k] for k in ("num_samples", "num_rejected", "num_generated_tokens")})
    assert sampled["num_samples"] + sampled["num_rejected"] == 5 and sampled["num_generated_tokens"] > 0

    # Extraction reads the regenerated tokens (hf backend: the orchestration, no second engine).
    from ray_jobs.extract import run_extract

    ecfg = job_config({"output_dir": str(tmp_path), "prepare.max_length": 512, "extract.backend": "hf",
                                  "stages": ["extract"]})
    ext = run_extract(ecfg, str(out / "tokens.parquet"), tiny_target, str(tmp_path / "hs"), progress=False,
                      tokens_source="regenerated")
    assert ext["num_samples"] == len(kept)
    assert json.loads((tmp_path / "hs" / "MANIFEST.json").read_text())["tokens_source"] == "regenerated"
