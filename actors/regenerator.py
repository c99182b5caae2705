"""Ray actor hosting one regeneration engine replica (vLLM, plain generation).

Placed by ray_jobs/regenerate.py on its own placement group, as extraction's replicas are
(actors.replica_pool.ReplicaPool). Delegates the work to eagle3.prepare.regenerate: this class starts
the engine and the tokenizer, drives the engine from one thread (eagle3.prepare.regenerate.TurnScheduler
over compat.vllm_engine.VLLMStepEngine), writes each shard's file and reports stats; the
driver commits the shard.
Several shards are in flight at once: run with max_concurrency >= the driver's shards per
replica + 1. Each `regenerate_shard` call (a thread of the actor) hands its shard to the engine
thread and waits for it; all open shards' conversations share the engine, a conversation's next
turn going in as soon as its previous one is back, so the engine never waits for the slowest
conversation of a shard, nor for the driver between shards.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import Future


class RegeneratorActor:
    def __init__(self, model_dir: str, regen_cfg, extract_cfg, sampling, *, max_length: int, dtype: str,
                 trust_remote_code: bool, assistant_only_loss: bool, replica: int,
                 chat_template_kwargs: dict | None = None):
        import ray
        from transformers import AutoTokenizer

        from compat.vllm_engine import Engine, VLLMStepEngine, core_in_process, engine_env, generation_engine_kwargs
        from eagle3.evaluate import resolve_enforce_eager
        from eagle3.extract.extractor import target_text_config
        from eagle3.prepare.regenerate import TurnScheduler
        from eagle3.precision import engine_dtype

        self.replica = replica
        self.node_id = ray.get_runtime_context().get_node_id()
        self.max_length = max_length
        self.assistant_only_loss = assistant_only_loss
        self.chat_template_kwargs = chat_template_kwargs
        self.cut = regen_cfg.cut
        text_cfg = target_text_config(model_dir)
        self.max_model_len = min(max_length, text_cfg.get("max_position_embeddings") or max_length)
        dtype, self.dtype = engine_dtype(dtype)  # self.dtype: the choice and why, for logs
        gpu = bool(ray.get_gpu_ids())
        self.enforce_eager = resolve_enforce_eager(regen_cfg.enforce_eager, gpu=gpu)
        self.in_process = core_in_process(on_gpu=gpu)
        os.environ.update(engine_env(in_process=self.in_process,
                                     cpu_kvcache_space_gib=extract_cfg.cpu_kvcache_space_gib))
        from vllm import LLM  # noqa: F401 - after its environment, before the clock: startup_s is the engine's start

        t0 = time.perf_counter()
        self.engine = Engine(**generation_engine_kwargs(
            model=model_dir, max_model_len=self.max_model_len, dtype=dtype,
            tensor_parallel_size=extract_cfg.tensor_parallel_size,
            pipeline_parallel_size=extract_cfg.pipeline_parallel_size, max_num_seqs=regen_cfg.max_num_seqs,
            gpu_memory_utilization=extract_cfg.engine_gpu_memory_utilization,
            kv_cache_memory_bytes=extract_cfg.kv_cache_memory_bytes if gpu else None,
            enforce_eager=self.enforce_eager,
            trust_remote_code=trust_remote_code))
        # Prepare's tokenizer, from the same directory: the regenerated samples are encoded as the
        # prepared ones were.
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        self.scheduler = TurnScheduler(VLLMStepEngine(self.engine.llm), self.tokenizer, sampling,
                                       max_model_len=self.max_model_len, cut=self.cut,
                                       chat_template_kwargs=chat_template_kwargs,
                                       max_in_engine=max_in_engine(regen_cfg.max_num_seqs))
        self.startup_s = time.perf_counter() - t0
        self._cv = threading.Condition()
        self._incoming: list[tuple[int, list, Future]] = []
        self._waiting: dict[int, Future] = {}
        self._error: BaseException | None = None
        self._closing = False
        self.busy_s = 0.0  # time the engine thread had turns in the engine
        self._thread = threading.Thread(target=self._drive, name=f"regenerate-engine-{replica}", daemon=True)
        self._thread.start()
        from ray.util.metrics import Gauge

        self._tokens_s = Gauge("eagle3_regenerate_tokens_per_s", description="Generated tokens/s of one replica",
                               tag_keys=("replica",))
        self._num_tokens = 0

    def info(self) -> dict:
        return {"replica": self.replica, "node_id": self.node_id, "host": socket.gethostname(), "pid": os.getpid(),
                "startup_s": self.startup_s, "dtype": self.dtype, "enforce_eager": self.enforce_eager,
                "in_process": self.in_process}

    def _drive(self) -> None:
        """The engine thread: the only one that touches the engine."""
        try:
            while True:
                with self._cv:
                    while not self._incoming and self.scheduler.idle and not self._closing:
                        self._cv.wait()
                    if self._closing:
                        return
                    for shard, samples, fut in self._incoming:
                        self.scheduler.add_shard(shard, samples)
                        self._waiting[shard] = fut
                    self._incoming.clear()
                t = time.perf_counter()
                done = self.scheduler.step()
                self.busy_s += time.perf_counter() - t
                for run in done:
                    with self._cv:
                        fut = self._waiting.pop(run.key)
                    fut.set_result(run)
        except BaseException as e:  # noqa: BLE001 - handed to every waiting shard, which raises it
            with self._cv:
                self._error = e
                for fut in [*self._waiting.values(), *(f for _, _, f in self._incoming)]:
                    fut.set_exception(e)
                self._waiting.clear()
                self._incoming.clear()

    def regenerate_shard(self, shard: int, samples: list, path: str) -> dict:
        """Regenerate `samples` [(sample_id, messages)], write the shard file at `path`; return stats.
        Returns when the shard's last conversation is done; other shards keep the engine busy meanwhile."""
        from eagle3.prepare.regenerate import render_shard, write_shard_table

        fut: Future = Future()
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"[regenerate] replica {self.replica}'s engine thread failed: {self._error!r}") \
                    from self._error
            self._incoming.append((shard, samples, fut))
            self._cv.notify()
        run = fut.result()
        table, stats = render_shard(run, self.tokenizer, max_length=self.max_length,
                                    assistant_only_loss=self.assistant_only_loss,
                                    chat_template_kwargs=self.chat_template_kwargs, cut=self.cut)
        t0 = time.perf_counter()
        nbytes = write_shard_table(table, path)
        self._num_tokens += stats.num_generated_tokens
        if self.busy_s > 0:
            self._tokens_s.set(self._num_tokens / self.busy_s, tags={"replica": str(self.replica)})
        return {"shard": shard, "replica": self.replica, "node_id": self.node_id, **stats.to_dict(),
                "replica_busy_s": self.busy_s, "bytes": nbytes, "write_s": time.perf_counter() - t0}

    def shutdown(self) -> None:
        """Stop the engine thread, then release the engine (compat.vllm_engine.Engine.close): its
        engine-core processes end."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout=60)
        self.engine.close()


def max_in_engine(max_num_seqs: int) -> int:
    """Requests kept in a replica's engine at once: its max_num_seqs running, and a quarter more
    waiting in its queue, so a finished sequence's slot is refilled in the engine's next step
    (without waiting for this process) while the order of the rest stays ours (oldest shard first)."""
    return max_num_seqs + max(1, max_num_seqs // 4)
