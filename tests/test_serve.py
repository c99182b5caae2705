"""Serving the job's draft: the summary's `vllm serve` command and verdict built from eval.json
(eagle3.serve), and the helpers tests/test_e2e.py uses to serve the demo job's draft with vLLM's
OpenAI-compatible server on the CPU."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import urllib.request

import pytest

from eagle3.serve import (api_server_argv, batch_verdicts, choose_k, serve_command, serving_record, verdict_lines,
                          write_serving_file)
from tests.conftest import DEMO


def _result(batch, ratio, ci, mode="greedy", k=None):
    r = {"batch_size": batch, "mode": mode, "temperature": 0.0 if mode == "greedy" else 0.7,
         "top_p": 1.0 if mode == "greedy" else 0.9, "speedup": {"ratio": ratio, "ci95": ci}}
    return r | ({"num_speculative_tokens": k} if k is not None else {})


def _eval(results, speed_k=3, ks=(1, 3)):
    return {"acceptance": [{"num_speculative_tokens": k} for k in ks],
            "speed": {"num_speculative_tokens": speed_k, "results": results} if results is not None else None}


def test_serve_command_is_vllm_serve_with_the_speculative_config_as_json():
    cmd = serve_command("/m/target", "/runs/x/draft", 3)
    assert cmd == ("vllm serve /m/target --speculative-config "
                   """'{"method": "eagle3", "model": "/runs/x/draft", "num_speculative_tokens": 3}'""")
    # the shell gives vLLM's argument parser one JSON word, whatever the paths hold
    argv = shlex.split(serve_command("/my models/t'x", "/d", 2))
    assert argv[:3] == ["vllm", "serve", "/my models/t'x"] and argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 2}
    cpu = api_server_argv("/t", "/d", 2, port=9, python="py")
    assert cpu[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"] and cpu[cpu.index("--port") + 1] == "9"
    assert json.loads(cpu[cpu.index("--speculative-config") + 1])["num_speculative_tokens"] == 2


def test_k_is_the_best_batch_1_speedup_where_timed_else_the_eval_k():
    # one k timed (the eval today): that k, whatever the acceptance engines measured
    assert choose_k(_eval([_result(1, 1.2, [1.1, 1.3]), _result(16, 0.9, [0.8, 0.95])])) == (3, "the k the eval timed")
    # several k timed: the best greedy batch-1 speedup, not the best at a larger batch or sampled
    ev = _eval([_result(1, 1.1, None, k=1), _result(1, 1.4, None, k=2), _result(1, 1.3, None, k=3),
                _result(1, 2.0, None, mode="sampled", k=1), _result(16, 3.0, None, k=3)])
    k, why = choose_k(ev)
    assert k == 2 and why == "the best batch-1 speedup (1.40x) of k=1, 2, 3"
    # no speed: 3 where the eval measured it, else its largest k; no eval: the draft's default
    assert choose_k(_eval(None, ks=(1, 3, 5)))[0] == 3
    assert choose_k(_eval(None, ks=(1, 2)))[0] == 2
    assert choose_k(None, default=4) == (4, "the draft's default (no eval)")


def test_verdict_says_which_batch_sizes_the_draft_slows():
    ev = _eval([_result(1, 1.26, [1.21, 1.31]), _result(16, 0.69, [0.65, 0.72])])
    assert verdict_lines(ev) == ["the draft speeds up batch 1 (1.26x)",
                                 "the draft slows batch 16 (0.69x): serve without it above batch 1"]
    rows = batch_verdicts(ev)
    assert [(r["batch_size"], r["helps"], r["verdict"]) for r in rows] == [(1, True, "helps"), (16, False, "slows")]
    # every batch slower: serve the target alone
    ev = _eval([_result(1, 0.67, [0.6, 0.7]), _result(16, 0.63, [0.6, 0.66])])
    assert verdict_lines(ev) == ["the draft slows batch 1 (0.67x); batch 16 (0.63x): serve the target without it"]
    # an interval spanning 1 (or none: one wave) is no verdict either way; a slower sampling slows its batch
    ev = _eval([_result(1, 1.02, [0.95, 1.09]), _result(4, 1.3, None), _result(16, 1.1, [1.05, 1.2]),
                _result(16, 0.9, [0.85, 0.95], mode="sampled")])
    assert verdict_lines(ev) == [
        "no clear difference at batch 1 (1.02x greedy); batch 4 (1.30x greedy): no 95% interval wholly above or below 1",
        "the draft slows batch 16 (0.90x T=0.7 top_p=0.9): T=0.7 top_p=0.9: serve without it above batch 4; greedy: no "
        "batch size slower"]
    # slower at a small batch only: no 'above'
    ev = _eval([_result(1, 0.9, [0.85, 0.95]), _result(16, 1.2, [1.1, 1.3])])
    assert verdict_lines(ev)[-1] == "the draft slows batch 1 (0.90x): serve without it at batch 1"
    # slower sampled, not greedy: the advice names the sampling
    ev = _eval([_result(1, 1.5, [1.4, 1.6]), _result(1, 0.9, [0.8, 0.95], mode="sampled"),
                _result(16, 1.1, [1.05, 1.2]), _result(16, 0.9, [0.85, 0.95], mode="sampled")])
    assert verdict_lines(ev) == ["the draft slows batch 1 (0.90x T=0.7 top_p=0.9); batch 16 (0.90x T=0.7 top_p=0.9): "
                                 "T=0.7 top_p=0.9: serve the target without it; greedy: no batch size slower"]
    assert verdict_lines(_eval(None)) == [
        "no decode speed timed (eval.speed_batch_sizes is empty): whether the draft pays is not measured"]


def test_serving_file_records_the_command_k_and_each_batch_size(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"speculators_config": {"proposal_methods": [
        {"proposal_type": "greedy", "speculative_tokens": 5}]}}))
    rec = json.loads(write_serving_file(draft, "/t").read_text())  # as export writes it: no eval yet
    assert rec["num_speculative_tokens"] == 5 and rec["batch_sizes"] == [] and rec["verdict"][0].startswith("not measured")
    ev = _eval([_result(1, 1.26, [1.21, 1.31]), _result(16, 0.69, [0.65, 0.72])])
    rec = json.loads(write_serving_file(draft, "/t", ev).read_text())
    assert rec == serving_record("/t", draft, ev) and sorted(os.listdir(draft)) == ["config.json", "serving.json"]
    # the draft slows batch 16: one server drafts at k=3 at batch 1, not above (vLLM's schedule)
    assert rec["k_schedule"] == [[1, 1, 3], [2, 16, 0]]
    assert rec["speculative_config"] == {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
                                         "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 16, 0]]}
    assert rec["vllm_serve"] == serve_command("/t", draft, 3, rec["k_schedule"])
    assert rec["k_chosen_by"] == ("the k the eval timed; batch 1: k=3; 2 and above: off "
                                  "(vLLM's num_speculative_tokens_per_batch_size, from k_per_batch)")
    assert [(b["batch_size"], b["speedup"], b["ci95"], b["helps"]) for b in rec["batch_sizes"]] == [
        (1, 1.26, [1.21, 1.31], True), (16, 0.69, [0.65, 0.72], False)]
    assert rec["verdict"] == verdict_lines(ev)
    # one timed batch size, or the same k at every one: no schedule, the plain config
    for results in ([_result(1, 1.26, [1.21, 1.31])], [_result(1, 1.26, [1.21, 1.31]), _result(16, 1.1, [1.05, 1.2])]):
        rec = serving_record("/t", draft, _eval(results))
        assert rec["k_schedule"] is None and rec["speculative_config"] == {
            "method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _wait_healthy(server: subprocess.Popen, url: str, log, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if _get(url + "/health", 2) is not None:
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the server was not healthy within {deadline_s:.0f}s:\n{log.read_text()[-4000:]}")


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the API server and its engine core), SIGKILL after 30 s."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def _user_turns(n: int) -> list[str]:
    from eagle3.prepare.conversations import load_conversations

    turns = []
    for _, messages in load_conversations(DEMO):
        turns.append(next(m["content"] for m in messages if m["role"] == "user"))
        if len(turns) == n:
            return turns
    raise AssertionError(f"{DEMO} has fewer than {n} conversations")


def test_served_speedup_times_the_setting_serving_json_serves(tmp_path):
    """benchmarks/served_speedup.py --serving: the k and k_schedule the draft's serving.json gives
    (its speculative_config), else --k's with no schedule."""
    from benchmarks.served_speedup import served_setting

    draft = tmp_path / "draft"
    draft.mkdir()
    ev = _eval([_result(1, 1.26, [1.21, 1.31]), _result(16, 0.69, [0.65, 0.72])])
    path = write_serving_file(draft, "/t", ev)
    spec = json.loads(path.read_text())["speculative_config"]
    assert served_setting(str(path), [1]) == ([spec["num_speculative_tokens"]],
                                              spec["num_speculative_tokens_per_batch_size"]) == ([3], [[1, 1, 3], [2, 16, 0]])
    assert served_setting(None, [3, 1]) == ([3, 1], None)
    path = write_serving_file(draft, "/t", _eval([_result(1, 1.26, [1.21, 1.31])]))
    assert served_setting(str(path), [1]) == ([3], None)
