"""The draft to export, chosen by vLLM's acceptance rather than by the training loss: while the draft
trains, the trainer exports it every eval.select_every_steps steps (train/candidates/step_NNNNNNN,
actors.trainer); an eval draft engine takes each in place (compat.draft_reload) and measures its
greedy acceptance length on held-out prompts apart from the eval's own, so that the eval's figures
are not measured on the prompts that chose the draft: as they come, where the engines start beside
training (ray_jobs.evaluate.EarlyEval), else all of them at the eval stage's start. The job exports
the best, the last step's unless an earlier one beats it.
Plain files and a measure function: the driver gives the engine (ray_jobs.evaluate).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("eagle3")

CANDIDATES = "candidates"
"""Under the train directory: the drafts the trainer exported for measuring, one directory a step."""
BEST = "best_draft"
"""Under the train directory: the best candidate so far."""
LAST = "last_draft"
"""Under the train directory: the last step's draft, kept where an earlier one replaced it in draft/."""
METRIC = "vllm_acceptance_length"
"""The key of the rows this module appends to metrics.jsonl (one per measured step)."""

_STEP_DIR = re.compile(r"step_(\d+)$")


def candidate_format(train_dir: str | Path) -> str:
    """Where the trainer exports the draft of step N: candidate_format(...).format(step=N)."""
    return str(Path(train_dir) / CANDIDATES / "step_{step:07d}")


def candidate_dir(train_dir: str | Path, step: int) -> Path:
    return Path(candidate_format(train_dir).format(step=step))


def selection_prompts(prepared_dir: str | Path, *, num_eval_prompts: int, num_prompts: int) -> list[list[int]]:
    """The held-out prompts that choose the draft: those after the eval's first num_eval_prompts in
    prepared/eval_prompts.jsonl, num_prompts at most (empty where there are none)."""
    from eagle3.prepare.tokens import read_eval_prompts

    return read_eval_prompts(prepared_dir)[num_eval_prompts: num_eval_prompts + num_prompts]


def pending_candidates(train_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of each whole candidate (renamed into place: actors.trainer.write_provisional_draft),
    oldest first."""
    root = Path(train_dir) / CANDIDATES
    found = []
    for d in root.iterdir() if root.is_dir() else ():
        m = _STEP_DIR.match(d.name)
        if m and (d / "config.json").exists():
            found.append((int(m.group(1)), d))
    return sorted(found)


class DraftSelection:
    """The acceptance of each candidate draft, and the best so far kept under the train directory.
    measure(draft_dir) -> greedy acceptance length: an engine that takes draft_dir's weights and
    decodes the selection prompts (EarlyEval's draft engine). A row per measured step goes to
    metrics.jsonl, beside the trainer's rows (curves.png plots both)."""

    def __init__(self, train_dir: str | Path, measure: Callable[[str], float], *, k: int, num_prompts: int,
                 max_tokens: int):
        self.train_dir = Path(train_dir)
        self.measure = measure
        self.k, self.num_prompts, self.max_tokens = k, num_prompts, max_tokens
        self.measured: list[dict] = []
        self.skipped: list[int] = []
        self.best: tuple[int, float] | None = None  # (step, acceptance length) of train/best_draft

    @staticmethod
    def clear(train_dir: str | Path) -> None:
        """An earlier run's candidates and best: a resumed run chooses among its own steps."""
        for name in (CANDIDATES, BEST):
            shutil.rmtree(Path(train_dir) / name, ignore_errors=True)

    def consume(self) -> None:
        """Measure the newest waiting candidate; older ones that waited behind it are dropped (the
        trainer outran the engine): the curve then has fewer points, the newest draft is never missed."""
        pending = pending_candidates(self.train_dir)
        if not pending:
            return
        *older, (step, path) = pending
        for s, p in older:
            self.skipped.append(s)
            shutil.rmtree(p, ignore_errors=True)
        self._offer(step, path)

    def consume_all(self) -> None:
        """Measure every waiting candidate, oldest first (the eval stage after training)."""
        for step, path in pending_candidates(self.train_dir):
            self._offer(step, path)

    def _offer(self, step: int, path: Path) -> None:
        al = self._measure(step, path)
        if self.best is None or al > self.best[1]:
            best = self.train_dir / BEST
            shutil.rmtree(best, ignore_errors=True)
            os.replace(path, best)
            self.best = (step, al)
        else:
            shutil.rmtree(path, ignore_errors=True)

    def _measure(self, step: int, path: Path) -> float:
        al = float(self.measure(str(path)))
        self.measured.append({"step": step, "acceptance_length": round(al, 4)})
        with open(self.train_dir / "metrics.jsonl", "a") as f:  # one write a line: beside rank 0's appends
            f.write(json.dumps({"step": step, METRIC: al, "selection_prompts": self.num_prompts}) + "\n")
        log.info("eval: step %d draft, vLLM greedy acceptance length %.3f at k=%d on %d held-out prompts",
                 step, al, self.k, self.num_prompts)
        return al

    def finish(self, draft_dir: str | Path, last_step: int) -> dict:
        """The last step's draft (draft_dir, the trainer's export) measured the same way, then the
        better of it and the best candidate in draft_dir: where a candidate beats it strictly, the
        last step's draft moves to train/last_draft and the candidate's weights take its place.
        Returns the record (eval.json's selection)."""
        draft_dir = Path(draft_dir)
        last_al = self._measure(last_step, draft_dir)
        record = {"k": self.k, "num_prompts": self.num_prompts, "max_tokens": self.max_tokens,
                  "measured": self.measured, "skipped_steps": self.skipped, "last_step": last_step,
                  "last_acceptance_length": round(last_al, 4)}
        best = self.train_dir / BEST
        if self.best is not None and self.best[1] > last_al:
            last = self.train_dir / LAST
            shutil.rmtree(last, ignore_errors=True)
            shutil.copytree(draft_dir, last)
            # the same config (the trainer's export at every step); only the weights differ
            os.replace(best / "model.safetensors", draft_dir / "model.safetensors")
            record |= {"chosen_step": self.best[0], "chosen_acceptance_length": round(self.best[1], 4),
                       "last_draft": str(last)}
        else:
            record |= {"chosen_step": last_step, "chosen_acceptance_length": round(last_al, 4)}
        shutil.rmtree(best, ignore_errors=True)
        shutil.rmtree(self.train_dir / CANDIDATES, ignore_errors=True)
        return record


def selection_line(sel: dict) -> str:
    """The summary's line: which step's draft was exported, and why."""
    head = (f"step {sel['chosen_step']} of {sel['last_step']}, greedy acceptance length "
            f"{sel['chosen_acceptance_length']:.2f} at k={sel['k']} on {sel['num_prompts']} held-out prompts apart "
            "from the eval's")
    if sel["chosen_step"] == sel["last_step"]:
        return head + f" (the last step's; {len(sel['measured']) - 1} earlier drafts measured, none higher)"
    return head + f"; the last step's {sel['last_acceptance_length']:.2f} (kept in {sel['last_draft']})"
