"""What the eval measures at: the samplings (greedy and the served one), the timed windows the job
derives from the platform, and eager or CUDA graphs. Pure: the driver plans the eval with these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeSampling:
    """How measured requests sample: mode 'greedy' (temperature 0) or 'sampled' (the sampling the
    target is served with)."""

    mode: str
    temperature: float
    top_p: float = 1.0


def eval_samplings(temperature: float, top_p: float) -> tuple[DecodeSampling, ...]:
    """Greedy, and `temperature`/`top_p` (the regeneration's resolved sampling: what the draft was
    trained on and the target is served with) unless that is greedy too."""
    greedy = DecodeSampling("greedy", 0.0, 1.0)
    if temperature == 0:
        return (greedy,)
    return greedy, DecodeSampling("sampled", float(temperature), float(top_p))


@dataclass(frozen=True)
class SpeedWindow:
    """One timed window: num_prompts held-out prompts in waves of batch_size requests, each answer
    ending where the target ends it (EOS, or max_tokens), as `vllm serve` answers; every engine
    times it `repeats` times, a number fixed before timing."""

    batch_size: int
    num_prompts: int
    max_tokens: int
    repeats: int

    def __post_init__(self):
        if min(self.batch_size, self.num_prompts, self.max_tokens, self.repeats) < 1 or self.num_prompts % self.batch_size:
            raise ValueError(f"{self}: every size must be >= 1 and num_prompts a multiple of batch_size")

    @property
    def num_waves(self) -> int:
        return self.num_prompts // self.batch_size


# The job's windows by platform. GPU: every held-out prompt at batch 1, at least two waves at larger
# batches, three rounds. CPU: a few short answers, so that the demo and the tests show the
# measurement without spending minutes on it.
GPU_WINDOWS = {"prompts_at_batch_1": None, "min_waves": 2, "max_tokens": None, "repeats": 3}
CPU_WINDOWS = {"prompts_at_batch_1": 4, "min_waves": 1, "max_tokens": 24, "repeats": 2}


def speed_windows(batch_sizes: tuple[int, ...], *, gpu: bool, num_prompts: int, max_tokens: int,
                  repeats: int | None = None) -> tuple[SpeedWindow, ...]:
    """The windows the eval times at each batch size over `num_prompts` held-out prompts, answers of
    at most max_tokens tokens (the CPU caps both); repeats None: the platform's."""
    p = GPU_WINDOWS if gpu else CPU_WINDOWS
    n1 = min(num_prompts, p["prompts_at_batch_1"] or num_prompts)
    tokens = min(max_tokens, p["max_tokens"] or max_tokens)
    return tuple(SpeedWindow(batch_size=b, num_prompts=n1 if b == 1 else b * max(p["min_waves"], num_prompts // b),
                             max_tokens=tokens, repeats=repeats or p["repeats"]) for b in batch_sizes)


def timed_prompts(prompts: list[list[int]], *, max_tokens: int, k: int,
                  max_length: int | None = None) -> tuple[list[list[int]], int]:
    """(the prompts the speed windows decode, the engines' max_model_len): room after each prompt for a
    whole answer of max_tokens, the k drafted tokens and 8 spare, within max_length (the job's
    prepare.max_length; None: no cap). Answers are timed where they are measured, so a prompt without
    that room is left out. The job's eval (ray_jobs.evaluate) and benchmarks/served_speedup.py both pick
    their prompts here, so that both time the same waves."""
    room = max_tokens + k + 8
    max_len = max(len(p) for p in prompts) + room
    if max_length is not None:
        max_len = min(max_length, max_len)
    return [p for p in prompts if len(p) + room <= max_len], max_len


def resolve_enforce_eager(setting: bool | str, *, gpu: bool) -> bool:
    """eval.enforce_eager and regenerate.enforce_eager: 'auto' is eager on the CPU (vLLM has no CUDA
    graphs there, and torch.compile's warm-up costs a minute) and CUDA graphs on a GPU, as `vllm
    serve` runs."""
    if setting == "auto":
        return not gpu
    return bool(setting)
