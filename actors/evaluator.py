"""Ray actor holding one vLLM engine (target + EAGLE-3 draft, or the target alone) and running
eagle3.evaluate's measurements on it. One actor per engine setting (num_speculative_tokens, CUDA
graphs or eager are engine settings): a fresh process, its share of the device, freed when the
actor is killed. The job's eval stage starts its engines (`start` on each actor, several at once
when they share the device) and measures them (`measure_started`: acceptance side by side, timed
windows alone; `speed` for engines that take turns at the timed windows); `shutdown` releases an
engine."""

from __future__ import annotations

import os
import time


class EvaluatorActor:
    def __init__(self, cpu_kvcache_space_gib: int = 1, *, in_process: bool = False):
        """in_process: the engine core in this actor's process (compat.vllm_engine.core_in_process:
        on a CPU)."""
        self.created_at = time.time()  # the driver compares it with when it placed this actor
        import psutil

        # ... and when this process started: the wait for the actor's resources (an earlier stage's
        # GPU to be freed) comes before it, the process's own start (Ray's worker, its imports) after
        self.process_started_at = psutil.Process().create_time()
        from compat.vllm_engine import engine_env

        os.environ.update(engine_env(in_process=in_process, cpu_kvcache_space_gib=cpu_kvcache_space_gib))
        self.engine = None

    def start(self, target_dir: str, draft_dir: str | None, **engine_kwargs) -> float:
        """Start this actor's engine (eagle3.evaluate.SpecDecodeEngine); returns its start seconds."""
        from eagle3.evaluate import SpecDecodeEngine

        if self.engine is not None:
            raise RuntimeError("this evaluator already holds an engine: start another actor for another setting")
        self.engine = SpecDecodeEngine(target_dir, draft_dir, **engine_kwargs)
        return self.engine.startup_s

    def measure_started(self, **kwargs) -> dict:
        """eagle3.evaluate.measure on the engine from `start`."""
        from eagle3.evaluate import measure

        return measure(self._need_engine(), **kwargs) | {"actor_created_at": self.created_at,
                                                          "process_started_at": self.process_started_at}

    def reload_draft(self, draft_dir: str) -> dict:
        """SpecDecodeEngine.reload_draft on this actor's engine."""
        return self._need_engine().reload_draft(draft_dir)

    def _need_engine(self):
        if self.engine is None:
            raise RuntimeError("no engine: call start(target_dir, draft_dir, ...) first")
        return self.engine

    def acceptance(self, prompts: list[list[int]], **kwargs) -> dict:
        return self._need_engine().acceptance(prompts, **kwargs)

    def speed(self, prompts: list[list[int]], windows, samplings, **kwargs) -> list[dict]:
        return self._need_engine().speed(prompts, windows, samplings, **kwargs)

    def generate(self, prompts: list[list[int]], **kwargs) -> list[list[int]]:
        return self._need_engine().generate(prompts, **kwargs)

    def shutdown(self) -> None:
        """Release this actor's engine (SpecDecodeEngine.close), if it holds one; call before ray.kill,
        which ends the process without running any of our code."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


def place_evaluator(cpu_kvcache_space_gib: int, *, gpu: bool, gpu_share: float = 1.0):
    """An EvaluatorActor placed as the job's eval stage places each engine: one CPU, gpu_share of a
    GPU where the cluster has one (the whole GPU, or its share when engines start side by side), and
    its engine core where compat.vllm_engine.core_in_process puts it."""
    import ray

    from compat.vllm_engine import core_in_process

    return ray.remote(EvaluatorActor).options(num_cpus=1, num_gpus=gpu_share if gpu else 0).remote(
        cpu_kvcache_space_gib, in_process=core_in_process(on_gpu=gpu))
