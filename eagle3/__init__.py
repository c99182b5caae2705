"""Plain (Ray-free) building blocks of the EAGLE-3 job: configs, schemas, stage logic.

Actors in `actors/` wrap these for Ray; drivers in `ray_jobs/` wire them together.
Nothing here imports vllm at module level, and the config/schema modules import no torch.

One folder a stage, in the order data flows through them:
- prepare/     conversations -> tokens.parquet (templates, loss masks, the held-out split), and
               regeneration: the target rewrites the answers, tokenized again into the same table
- extract/     tokens -> committed hidden-states shards (the engine loop, the shard schedule, the
               commit protocol, the shard files and their encoding)
- train/       shards -> a trained draft, exported for vLLM (the input pipeline in train/data/,
               DeepSpeed, online mode's feed)
- evaluate/    the exported draft inside vLLM: acceptance, speedup (windows, engine, statistics,
               eval.json), and its accuracy on stored hidden states
At the top, what every stage or no single stage uses:
- config, eval_config, typed_config, config_reference: the job's config file (each stage's
  dataclass, in its folder's config.py, composed into one), its type checks and the generated
  reference page
- schema: the Arrow contracts between stages (prepare -> extract -> train), versioned
- precision, provenance: the compute dtype behind `auto`; what is written next to every output
- doctor, gpu_processes: the pre-flight checks and who holds GPU memory
- tiny: the seeded tiny target (`target.model: tiny`, the tests'); the real pretrained targets
  (`target.model: pypi:smollm2`, the demo's) are built by scripts/real_targets.py
A stage imports earlier stages, never a later one (tests/test_layering.py): the held-out split is
prepare's (training reads it back) and export is train's (the trainer calls it; evaluation reads
its output). The schema sits at the top because prepare writes it and extract and train read it.
"""
