"""The held-out split: training conversations kept out of training, on which the draft's accuracy
is measured while it trains (eagle3.train.trainer), beside the training accuracy and vLLM's acceptance.

Owns: which conversations are held out, and the record of that choice (`HeldoutSplit`, written by
prepare as prepared/heldout.json). Does not own: the config fields (eagle3.config.PrepareConfig
heldout_fraction, heldout_min_conversations), measuring accuracy on the split (eagle3.train.trainer).

The mark is a function, not a column: a conversation is held out when a hash of its id (the
sample id without the '#t<k>' suffix, eagle3.prepare.chat_template.Sample.id_suffix) falls below a
threshold. Sample ids pass unchanged through regenerate (a regenerated conversation keeps its id,
its samples '<id>#t<k>') and extract (the shards keep the sample_id column), so every stage after
prepare keeps the held-out conversations with the rest (they are regenerated and extracted like
any other) and the trainer finds them again from the ids alone, on any rank, after any resume:
no schema version, regenerate or extract change. All samples of a conversation land on the same
side, since only the conversation id is hashed. prepare chooses the threshold once, over the
conversations it kept (from heldout_fraction, raised to reach heldout_min_conversations), and
the job passes that one number to training; conversations that regenerate or extract reject
later leave the split without moving any other across it. Online mode (train.source online):
the ranks skip the split's rows as offline, and the engines extract it again into shards of its
own (ray_jobs/online.py), since a table from the object store reaches one rank once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

HELDOUT_FILE = "heldout.json"

_TURN_SUFFIX = re.compile(r"#t\d+$")
_KEY_SPACE = 1 << 64


def conversation_id(sample_id: str) -> str:
    """The conversation behind a sample id: '<id>#t<k>' (one sample per assistant turn) -> '<id>'."""
    return _TURN_SUFFIX.sub("", sample_id)


def split_key(conversation: str) -> int:
    """A conversation's place in [0, 2**64), uniform and the same on every machine and run."""
    return int.from_bytes(hashlib.sha256(conversation.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class HeldoutSplit:
    """Held out: the conversations whose split_key is below `threshold` (0: none)."""

    threshold: int
    fraction: float
    min_conversations: int
    num_conversations: int
    """Conversations the threshold was chosen over (prepare's kept ones)."""
    num_heldout_conversations: int
    num_heldout_samples: int

    def is_heldout(self, sample_id: str) -> bool:
        return split_key(conversation_id(sample_id)) < self.threshold

    def to_dict(self) -> dict:
        return asdict(self)

    def write(self, out_dir: str | Path) -> Path:
        path = Path(out_dir) / HELDOUT_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path


def is_heldout(sample_id: str, threshold: int) -> bool:
    return split_key(conversation_id(sample_id)) < threshold


def heldout_rows(tokens, threshold: int):
    """The rows of a table with a sample_id column inside the split of `threshold` (0: none), in
    order: online mode's held-out samples, which its engines extract apart (ray_jobs/online.py)."""
    import pyarrow as pa

    ids = tokens.column("sample_id").to_pylist()
    return tokens.filter(pa.array([bool(threshold) and is_heldout(s, threshold) for s in ids], pa.bool_()))


def choose_split(sample_ids: Iterable[str], fraction: float, min_conversations: int) -> HeldoutSplit:
    """The split of these samples' conversations: those whose key is below fraction * 2**64 (about
    `fraction` of them, a choice that does not depend on the others), and when that is fewer than
    min(min_conversations, half of them), the threshold is raised to the next keys in order, so a
    small data set still has a split to measure on. fraction 0: nothing held out."""
    counts: dict[str, int] = {}
    for s in sample_ids:
        c = conversation_id(s)
        counts[c] = counts.get(c, 0) + 1
    threshold = 0
    if fraction > 0:
        keys = sorted((split_key(c), c) for c in counts)
        threshold = int(fraction * _KEY_SPACE)
        want = min(min_conversations, len(keys) // 2)
        if want and sum(k < threshold for k, _ in keys) < want:
            threshold = keys[want - 1][0] + 1
    held = [c for c in counts if split_key(c) < threshold]
    return HeldoutSplit(threshold=threshold, fraction=fraction, min_conversations=min_conversations,
                        num_conversations=len(counts), num_heldout_conversations=len(held),
                        num_heldout_samples=sum(counts[c] for c in held))


def read_split(prepared_dir: str | Path) -> HeldoutSplit | None:
    """prepared/heldout.json, or None where prepare wrote none (a prepared directory from before
    the split existed: re-run prepare to get one)."""
    path = Path(prepared_dir) / HELDOUT_FILE
    if not path.exists():
        return None
    return HeldoutSplit(**json.loads(path.read_text()))


def training_threshold(prepared_dir: str | Path) -> int:
    """The threshold training leaves out (and measures): prepared/heldout.json's, or 0 (no split,
    with a warning) where prepare wrote none, i.e. it ran before the split existed."""
    split = read_split(prepared_dir)
    if split is None:
        import logging

        logging.getLogger(__name__).warning(
            "%s has no %s (prepared before the held-out split existed): training on every conversation, no "
            "held-out accuracy; re-run the prepare stage for a split", prepared_dir, HELDOUT_FILE)
        return 0
    return split.threshold
