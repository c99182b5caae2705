"""Session 25's regenerated/ (the first 12,000 ShareGPT records) as the start of a larger prepare's
regeneration, so that a lease regenerates only the conversations it has not seen. Run on the CPU VM,
before the carry (README.md beside this file, "How to run it").

usage: python benchmarks/results/leases/session28-h200/extend_regenerated.py CONFIG JOB_DIR
JOB_DIR holds prepared/ (CONFIG's prepare, the larger one) and regenerated/ (session 25's); CONFIG's
target.model must be readable here (its generation_config.json resolves the sampling).

Why a script: regenerate's MANIFEST.json fingerprints every sample id of the run
(eagle3.prepare.regenerate.regenerate_fingerprint), so a larger prepare finds session 25's shards
"of another input" and stops (eagle3.extract.manifest.Manifest.open), although its first shards hold
the same conversations. Shard k holds conversations [256k, 256(k+1)) of prepare's ids, and a turn's
seed is a function of (seed, sample id, turn) alone (turn_seed), so a full shard of the old run is
what the new run would write for that shard. This script keeps a committed shard only where that is
shown, not assumed:
1. the old fingerprint is regenerate_fingerprint's for the new prepare's first num_samples ids with
   this config's settings: the old ids are a prefix of the new ones, and the target, sampling,
   max_length, cut and samples_per_shard are the same;
2. the shard is full in the old plan (its rows are the same in both plans), and its data file's
   conversations with its commit's rejects are exactly the new plan's ids for it.
Every other shard (session 25's last, partial one) loses its data and commit files, and so do
tokens.parquet and rejects.jsonl (the stage's finalize writes them again from all shards); the new
fingerprint goes into MANIFEST.json; EXTENDED.json records what was kept and why. The regenerate
stage then reports "N of M shards committed" and starts engines for the rest only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from eagle3.config import load_job_config
from eagle3.extract.manifest import Manifest, ShardPlan, atomic_write_text
from eagle3.prepare.regenerate import conversation_ids, regenerate_fingerprint, resolve_sampling


def main(config: str, job_dir: str) -> int:
    cfg = load_job_config(config)
    job = Path(job_dir)
    target = cfg.target.model
    ids = conversation_ids(pq.read_table(job / "prepared" / "tokens.parquet", columns=["sample_id"])
                           .column("sample_id").to_pylist())
    sps = cfg.regenerate.samples_per_shard
    new_plan = ShardPlan(len(ids), sps)
    sampling = resolve_sampling(cfg.regenerate, target)

    def fingerprint(sample_ids: list[str]) -> dict:
        return regenerate_fingerprint(sample_ids, sps, sampling, target=target, max_length=cfg.prepare.max_length,
                                      assistant_only_loss=cfg.prepare.assistant_only_loss,
                                      chat_template_kwargs=cfg.prepare.chat_template_kwargs, cut=cfg.regenerate.cut)

    new_fp = fingerprint(ids)
    root = job / "regenerated"
    old_fp = json.loads((root / "MANIFEST.json").read_text())
    if old_fp == new_fp:
        print(f"{root}: already this prepare's regeneration; nothing to do")
        return 0
    n_old = old_fp["num_samples"]
    prefix_fp = fingerprint(ids[:n_old])
    if n_old > len(ids) or prefix_fp != old_fp:
        found = {k: (old_fp.get(k), prefix_fp.get(k)) for k in sorted(set(old_fp) | set(prefix_fp))
                 if old_fp.get(k) != prefix_fp.get(k)}
        raise SystemExit(f"{root} is not the regeneration of this prepare's first {n_old} conversations with these "
                         f"settings (differs in {found}, as (old, now)): no shard of it can be kept")
    old_plan = ShardPlan(n_old, sps)
    manifest = Manifest(root, "parquet")
    kept, dropped = [], []
    for shard, rec in sorted(manifest.committed().items()):
        lo, hi = new_plan.rows(shard)
        full_in_old = old_plan.rows(shard) == (lo, hi)
        found = set(conversation_ids(pq.read_table(manifest.data_dir / rec["file"], columns=["sample_id"])
                                     .column("sample_id").to_pylist()))
        found |= {r["sample_id"] for r in rec.get("rejects", [])}
        if full_in_old and found == set(ids[lo:hi]):
            kept.append(shard)
            continue
        if full_in_old:  # a full shard whose ids do not match the plan: the fingerprint check should have said so
            raise SystemExit(f"shard {shard}: its conversations are not rows [{lo}, {hi}) of this prepare")
        dropped.append(shard)
        (manifest.commit_dir / f"shard-{shard:06d}.json").unlink()
        manifest.data_path(shard).unlink(missing_ok=True)
    if kept != list(range(len(kept))):
        raise SystemExit(f"kept shards {kept} are not 0..{len(kept) - 1}")
    for name in ("tokens.parquet", "rejects.jsonl"):
        (root / name).unlink(missing_ok=True)
    if (root / "provenance.json").exists():
        (root / "provenance.json").rename(root / "provenance-before-extended.json")
    atomic_write_text(root / "EXTENDED.json", json.dumps({
        "old_fingerprint": old_fp, "new_fingerprint": new_fp, "kept_shards": len(kept), "dropped_shards": dropped,
        "num_shards": new_plan.num_shards, "conversations_kept": kept and new_plan.rows(kept[-1])[1],
        "why": "old ids a prefix of the new (sha256 of the first num_samples); each kept shard full in both plans "
               "and its conversations + rejects the new plan's rows"}, indent=1))
    atomic_write_text(root / "MANIFEST.json", json.dumps(new_fp, indent=1, sort_keys=True))
    print(f"{root}: kept shards 0-{len(kept) - 1} ({new_plan.rows(len(kept) - 1)[1] if kept else 0} conversations), "
          f"dropped {dropped}; the new plan has {new_plan.num_shards} shards of {sps} over {len(ids)} conversations, "
          f"{new_plan.num_shards - len(kept)} to regenerate")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    sys.exit(main(sys.argv[1], sys.argv[2]))
