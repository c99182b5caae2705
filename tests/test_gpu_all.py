"""The one-report wrapper of the GPU benchmarks judges each target from the measured JSON."""

from __future__ import annotations

import json

from benchmarks.gpu_all import main, report, target_values, verdict


def _extract_doc(shape: str, **row) -> dict:
    base = {"shape": shape, "hidden_size": 2048, "num_layers": 16, "num_prompts": 8, "prompt_len": 1024,
            "plain_prefill_tok_s": 100.0}
    return {"meta": {"date": "d", "machine": "m", "versions": {"packages": {}, "git_commit": "c"}, "dd_gib": 1,
                     "disk_gb_s": 2.0},
            "results": [{**base, **row}]}


def test_verdicts_from_measured_figures(tmp_path):
    docs = [
        _extract_doc("1b", object_store_tok_s=96.0, object_store_ratio=0.96, arrow_disk_tok_s=40.0,
                     arrow_disk_ratio=0.4, arrow_disk_write_gb_s=1.5, arrow_disk_fp8_tok_s=70.0,
                     arrow_disk_fp8_ratio=0.7),
        _extract_doc("8b", arrow_disk_tok_s=90.0, arrow_disk_ratio=0.9, arrow_disk_steady_ratio=0.98, hf_tok_s=50.0,
                     hf_ratio=0.5),
        {"ours": {"steady": {"tokens_per_s": 30.0}}, "speculators": {"error": "[speculators] exit 1: X\nmore"}},
        {"meta": {"args": {"disk_dir": "/dev/shm"}},
         "results": [{"replicas": 1, "tok_s": 10.0, "speedup": 1.0}, {"replicas": 2, "tok_s": 19.5, "speedup": 1.95}]},
        {"meta": {"args": {"disk_dir": "/tmp"}},
         "results": [{"replicas": 1, "tok_s": 10.0, "speedup": 1.0}, {"replicas": 2, "tok_s": 14.0, "speedup": 1.4}]},
    ]
    want = [("8B: (3) Arrow on disk / (1) plain prefill", 0.9, "missed by 0.07"),
            ("1B: (2) object store / (1) plain prefill", 0.96, "met"),
            ("1B: Arrow writing / (5) dd", 0.75, "missed by 0.05"),
            ("1B: fp8 on disk / bf16 on disk", 1.75, "missed by 0.05"),
            ("(7) two replicas / one >= 1.9, Arrow into memory", 1.95, "met"),
            ("(7) the same, Arrow on the local disk", 1.4, "missed by 0.50"),
            ("(6) ours / speculators' trainer tokens/s", None, "not measured")]
    got = target_values(docs)
    assert len(got) == len(want)
    for (name, value, threshold), (want_name, want_value, want_verdict) in zip(got, want):
        assert name.startswith(want_name) and (value, verdict(value, threshold)) == (want_value, want_verdict), name

    doc, md = report(docs, ["a.json"])
    assert [t["verdict"] for t in doc["targets"]].count("met") == 2
    assert "speculators' trainer not measured: [speculators] exit 1: X" in md

    # the command line form writes both files from part results
    paths = []
    for i, d in enumerate(docs):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(d))
    assert main(["--summarize", *map(str, paths), "--out", str(tmp_path / "out"), "--tag", "t"]) == 0
    written = json.loads((tmp_path / "out" / "gpu-all-t.json").read_text())
    assert written["targets"] == doc["targets"] and written["sources"] == [p.name for p in paths]


def test_missing_parts_are_not_measured():
    assert {verdict(v, th) for _, v, th in target_values([])} == {"not measured"}
