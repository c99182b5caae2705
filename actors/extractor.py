"""Ray actor hosting one extraction engine replica (vLLM, or the transformers reference).

Placed by ray_jobs/extract.py on its own placement group (tensor_parallel_size *
pipeline_parallel_size GPUs of one node, or one CPU bundle on a CPU cluster). Its
outputs leave as Ray object refs: `extract_shard` has two returns, the encoded Arrow
table (which the driver hands to its node's writer actor without fetching it) and small stats.
Run it with max_concurrency=max_concurrency(extract_cfg): one thread per shard in flight, so
that while earlier calls' tables are serialised into the object store, the next call already
has the engine (Extractor holds an engine lock: one call at a time uses it).
"""

from __future__ import annotations

import os
import socket
import time


def max_concurrency(extract_cfg) -> int:
    """Threads of an ExtractorActor: one per shard the driver keeps in flight on it."""
    return max(2, extract_cfg.max_inflight_shards)


class ExtractorActor:
    def __init__(self, model_dir: str, extract_cfg, *, max_length: int, dtype: str, trust_remote_code: bool,
                 replica: int):
        import ray

        # torch (the codec's) before the clock, so that startup_s is the backend's start as it was: the
        # extractor module no longer imports torch itself, for the drivers that read only its config helpers.
        from eagle3.extract.codec import encode_hidden_states  # noqa: F401
        from eagle3.extract.extractor import Extractor

        self.replica = replica
        self.node_id = ray.get_runtime_context().get_node_id()
        t0 = time.perf_counter()
        self.extractor = Extractor(model_dir, extract_cfg, max_length=max_length, dtype=dtype,
                                   trust_remote_code=trust_remote_code)
        self.startup_s = time.perf_counter() - t0
        self._tokens_s = _gauge("eagle3_extract_tokens_per_s", "Extraction tokens/s of one engine replica", ("replica",))

    def info(self) -> dict:
        return {"replica": self.replica, "node_id": self.node_id, "host": socket.gethostname(), "pid": os.getpid(),
                "startup_s": self.startup_s, "layer_ids": self.extractor.layer_ids,
                "dtype": self.extractor.dtype}

    def extract_shard(self, shard: int, tokens):
        table, stats = self.extractor.extract(tokens)
        if stats.seconds > 0:
            self._tokens_s.set(stats.num_tokens / stats.seconds, tags={"replica": str(self.replica)})
        return table, {"shard": shard, "replica": self.replica, "node_id": self.node_id,
                       "num_samples": stats.num_samples, "num_rejected": stats.num_rejected,
                       "num_tokens": stats.num_tokens, "seconds": stats.seconds, "rejects": stats.rejects}

    def shutdown(self) -> None:
        """Release the engine (Extractor.close); the driver calls it before ray.kill."""
        self.extractor.close()


def _gauge(name: str, description: str, tag_keys: tuple[str, ...]):
    from ray.util.metrics import Gauge

    return Gauge(name, description=description, tag_keys=tag_keys)
