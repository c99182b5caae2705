"""The draft's predictions counted as vLLM counts its drafts, shared by the trainer's held-out
evaluation (eagle3.train.trainer) and the exported draft's (eagle3.evaluate.draft_accuracy).

speculators' accuracy (full_acc_i) counts a draft from every position of the text, with its labels
the target's argmax within the draft's vocabulary. vLLM counts rounds: a round drafts k tokens,
the target keeps the leading run of right ones and adds one, and the next round starts there, so
rounds start where the draft just failed, more often in the stretches it gets wrong; and a draft
token counts only if it is the target's argmax over its whole vocabulary. `strict_rounds` judges
a packed batch's predictions that way and `walk_rounds` walks one answer's rounds. On the target's
own greedy answers they replay vLLM's own count (tests/test_quality.py; benchmarks/train_serve.py).
Imports torch only inside strict_rounds.
"""

from __future__ import annotations


def strict_rounds(model, inputs: dict, draft_tokens: list, full_head, to_target, k: int, acc: dict) -> None:
    """Adds one packed batch's strict counts to `acc`: the target's argmax over its whole
    vocabulary (its final norm and lm_head on the verifier's last hidden states, as speculators
    computes its targets but without the draft-vocabulary cut) against each TTT step's draft token
    mapped to a target id; step i from start p is judged at p + i (speculators' align_for_step),
    within the loss mask and the same sample. Then each answer (a run of loss-masked starts in one
    sample) walked in rounds of k (walk_rounds). On the target's own greedy answers this replays
    vLLM's count (tests/test_quality.py: the same number of rounds as vLLM's drafts, the same
    accepted tokens at positions 0 and 1), but for a round at an answer's end: vLLM verifies its
    draft tokens past the end too, where the text has no target to judge them by."""
    import torch

    h = model.verifier_norm(inputs["verifier_last_hidden_states"][0])
    # On a CPU in float32: torch's bf16 matmul there is emulated, several times slower.
    compute = torch.float32 if h.device.type == "cpu" else h.dtype
    h, head = h.to(compute), full_head.to(compute)
    target = torch.cat([(h[i:i + 1024] @ head.T).argmax(-1) for i in range(0, len(h), 1024)])
    mask, docs, n = inputs["loss_mask"][0].bool(), inputs["document_ids"][0], len(target)
    if to_target is not None:
        in_vocab = torch.zeros(full_head.shape[0], dtype=torch.bool, device=target.device)
        in_vocab[to_target] = True
        acc["oov"] += int((mask & ~in_vocab[target]).sum())
    right = []
    prefix = torch.ones(n, dtype=torch.bool, device=target.device)
    for i, tokens in enumerate(draft_tokens):
        pred = tokens[0] if to_target is None else to_target[tokens[0]]
        ok = torch.zeros(n, dtype=torch.bool, device=target.device)
        valid = mask[i:] & (docs[i:] == docs[:n - i]) & mask[:n - i]
        ok[:n - i] = (pred[:n - i] == target[i:]) & valid
        prefix &= ok
        acc["correct"][i] += int(prefix.sum())
        acc["total"][i] += int(valid.sum())
        right.append(ok)
    right = torch.stack(right[:k]).cpu()
    mask, docs = mask.cpu(), docs.cpu()
    starts = torch.nonzero(mask & torch.cat([torch.tensor([True]), ~mask[:-1] | (docs[1:] != docs[:-1])])).flatten()
    mask, docs = mask.tolist(), docs.tolist()
    for a in starts.tolist():
        b = a
        while b < n and mask[b] and docs[b] == docs[a]:
            b += 1
        # The answer's last start is left out: its input is the answer's last token, after which vLLM
        # drafts no more (the request has ended).
        r, accepted = walk_rounds(right[:, a:b - 1].tolist(), k)
        acc["rounds"] += r
        acc["accepted"] = [x + y for x, y in zip(acc["accepted"], accepted)]


def walk_rounds(correct: list[list[bool]], k: int) -> tuple[int, list[int]]:
    """vLLM's count of one answer's drafts, replayed on teacher-forced predictions: correct[i][p]
    says whether the draft's token i from start p (draft vocabulary mapped to the target's) is the
    target's argmax there, for every start p of the answer (False past its end). As vLLM decodes,
    a round drafts k tokens from start p, accepts the leading run of right ones (n), the target adds
    one, and the next round starts at p + n + 1: rounds start where the draft just failed, more
    often in the stretches it gets wrong than the trainer's every-position accuracy counts them.
    Returns (rounds, accepted[i]: rounds whose first i + 1 tokens were all accepted)."""
    rounds, accepted = 0, [0] * k
    p, end = 0, len(correct[0]) if correct else 0
    while p < end:
        n = 0
        while n < k and correct[n][p]:
            n += 1
        for i in range(n):
            accepted[i] += 1
        rounds += 1
        p += n + 1
    return rounds, accepted
