"""Ray actor hosting one regeneration engine replica (vLLM, plain generation).

Placed by ray_jobs/regenerate.py on its own placement group, as extraction's replicas are
(ray_jobs.extract.ReplicaPool). Delegates the work to eagle3.regenerate: this class only
starts the engine and the tokenizer, writes each shard's file and reports stats; the
driver commits the shard. Run with max_concurrency=1: the engine serves one shard at a
time, and a second shard handed out waits in the actor's queue, so the engine never
waits for the driver between shards.
"""

from __future__ import annotations

import os
import socket
import time


class RegeneratorActor:
    def __init__(self, model_dir: str, regen_cfg, extract_cfg, sampling, *, max_length: int, dtype: str,
                 trust_remote_code: bool, assistant_only_loss: bool, replica: int,
                 chat_template_kwargs: dict | None = None):
        import ray
        from transformers import AutoTokenizer

        from compat.vllm_engine import Engine, engine_env, generation_engine_kwargs
        from eagle3.extract import target_text_config
        from eagle3.precision import engine_dtype

        self.replica = replica
        self.node_id = ray.get_runtime_context().get_node_id()
        self.sampling = sampling
        self.max_length = max_length
        self.assistant_only_loss = assistant_only_loss
        self.chat_template_kwargs = chat_template_kwargs
        self.cut = regen_cfg.cut
        text_cfg = target_text_config(model_dir)
        self.max_model_len = min(max_length, text_cfg.get("max_position_embeddings") or max_length)
        dtype, self.dtype = engine_dtype(dtype)  # self.dtype: the choice and why, for logs
        t0 = time.perf_counter()
        os.environ.update(engine_env(in_process=False, cpu_kvcache_space_gib=extract_cfg.cpu_kvcache_space_gib))
        self.engine = Engine(**generation_engine_kwargs(
            model=model_dir, max_model_len=self.max_model_len, dtype=dtype,
            tensor_parallel_size=extract_cfg.tensor_parallel_size,
            pipeline_parallel_size=extract_cfg.pipeline_parallel_size, max_num_seqs=regen_cfg.max_num_seqs,
            gpu_memory_utilization=extract_cfg.engine_gpu_memory_utilization, enforce_eager=regen_cfg.enforce_eager,
            trust_remote_code=trust_remote_code))
        # Prepare's tokenizer, from the same directory: the regenerated samples are encoded as the
        # prepared ones were.
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        self.startup_s = time.perf_counter() - t0
        from ray.util.metrics import Gauge

        self._tokens_s = Gauge("eagle3_regenerate_tokens_per_s", description="Generated tokens/s of one replica",
                               tag_keys=("replica",))

    def info(self) -> dict:
        return {"replica": self.replica, "node_id": self.node_id, "host": socket.gethostname(), "pid": os.getpid(),
                "startup_s": self.startup_s, "dtype": self.dtype}

    def _generate(self, prompts, params):
        from compat.vllm_engine import generate_texts
        from eagle3.regenerate import Generation

        return [Generation(**g) for g in generate_texts(self.engine.llm, prompts, params)]

    def regenerate_shard(self, shard: int, samples: list, path: str) -> dict:
        """Regenerate `samples` [(sample_id, messages)], write the shard file at `path`; return stats."""
        from eagle3.regenerate import regenerate_conversations, write_shard_table

        table, stats = regenerate_conversations(self._generate, self.tokenizer, samples, self.sampling,
                                                max_model_len=self.max_model_len, max_length=self.max_length,
                                                assistant_only_loss=self.assistant_only_loss,
                                                chat_template_kwargs=self.chat_template_kwargs,
                                                cut=self.cut)
        t0 = time.perf_counter()
        nbytes = write_shard_table(table, path)
        if stats.generate_s > 0:
            self._tokens_s.set(stats.num_generated_tokens / stats.generate_s, tags={"replica": str(self.replica)})
        return {"shard": shard, "replica": self.replica, "node_id": self.node_id, **stats.to_dict(),
                "bytes": nbytes, "write_s": time.perf_counter() - t0}

    def shutdown(self) -> None:
        """Release the engine (compat.vllm_engine.Engine.close): its engine-core processes end."""
        self.engine.close()
