"""The trainer's accuracy metric for an exported draft on hidden-state shards, read through the
exported files so that the export is part of a train/serve comparison. torch and speculators are
imported when it runs.
"""

from __future__ import annotations

from pathlib import Path


def draft_accuracy(draft_dir: str | Path, target_dir: str | Path, data_files, *, micro_batch_tokens: int = 4096,
                   ttt_steps: int = 3, loss: str = "kl_div", max_batches: int | None = None,
                   heldout_threshold: int = 0, heldout: bool = False, rounds_k: int | None = None) -> dict:
    """An exported draft's accuracy on hidden-state shards, one pass over every sample: full_acc_i
    (i = 0..ttt_steps-1) as the trainer computes it (speculators' compute_metrics, teacher-forced
    inputs), summed over batches: {"full_acc": [...], "num_positions": [...], "num_samples",
    "num_batches"}. The verifier's norm and lm_head, which the export leaves out, are read from
    `target_dir` (compat.speculators_verifier). heldout_threshold / heldout: only the rows outside
    (or, with `heldout`, inside) the held-out split (eagle3.prepare.heldout), as the trainer reads them.
    rounds_k: also the same predictions judged as vLLM judges them (eagle3.train.rounds): against the
    target's argmax over its whole vocabulary ("strict_full_acc"; "out_of_draft_vocab": the share of
    positions whose argmax the draft cannot propose), and counted in rounds of rounds_k tokens
    (walk_rounds over each answer: "rounds"), which on the target's own greedy text replays what
    vLLM counts."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    from compat.speculators_loss import loss_implementation
    from compat.speculators_verifier import draft_to_target_ids, full_lm_head, read_text_model_tensors
    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.staging import device_inputs
    from eagle3.train.rounds import strict_rounds

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    # flex attention (speculators' default) compiles; sdpa is the same attention without that
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=config)
    target_tensors = read_text_model_tensors(str(target_dir))
    _load_verifier_head(model, target_tensors, str(target_dir))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = model.to(device=device, dtype=dtype).eval()
    loss_config = resolve_loss_config(loss, loss_implementation())
    dataset = HiddenStatesDataset(data_files, seed=0, shuffle_buffer_size=1, heldout_threshold=heldout_threshold,
                                  heldout=heldout)
    batches = PackedBatches(dataset, micro_batch_tokens, dtype)
    correct = [0.0] * ttt_steps
    total = [0.0] * ttt_steps
    num_batches = num_samples = 0
    if rounds_k is not None:
        if not 1 <= rounds_k <= ttt_steps:
            raise ValueError(f"rounds_k={rounds_k}: must be 1..ttt_steps={ttt_steps}")
        full_head = full_lm_head(target_tensors).to(device=device, dtype=dtype)
        to_target = draft_to_target_ids(model)
        strict = {"correct": [0] * ttt_steps, "total": [0] * ttt_steps, "oov": 0, "rounds": 0,
                  "accepted": [0] * rounds_k}
    with torch.no_grad():
        while max_batches is None or num_batches < max_batches:
            rows = batches.take()
            if batches.epoch > 0:  # take() went on to the next epoch: every sample was seen
                break
            inputs = device_inputs(batches.pack(rows), device, dtype)
            draft_tokens, _, metrics = model(**inputs, ttt_steps=ttt_steps, ttt_step_loss_decay=1.0,
                                             loss_config=loss_config)
            if rounds_k is not None:
                strict_rounds(model, inputs, draft_tokens, full_head, to_target, rounds_k, strict)
            for i in range(ttt_steps):
                correct[i] += float(metrics[f"full_acc_{i}_sum"])
                total[i] += float(metrics[f"full_acc_{i}_total"])
            num_batches += 1
            num_samples += len(rows)
    if batches.num_truncated:
        raise ValueError(f"{batches.num_truncated} samples are longer than micro_batch_tokens={micro_batch_tokens}: "
                         "raise it so that every position is counted")
    out = {"full_acc": [c / t if t else None for c, t in zip(correct, total)], "num_positions": total,
           "num_samples": num_samples, "num_batches": num_batches}
    if rounds_k is not None:
        rates = [a / strict["rounds"] if strict["rounds"] else None for a in strict["accepted"]]
        out |= {"strict_full_acc": [c / t if t else None for c, t in zip(strict["correct"], strict["total"])],
                "out_of_draft_vocab": strict["oov"] / strict["total"][0] if strict["total"][0] else None,
                "rounds": {"k": rounds_k, "num_rounds": strict["rounds"], "num_accepted_tokens_per_pos":
                           strict["accepted"], "acceptance_rate_per_pos": rates,
                           "acceptance_length": 1.0 + sum(rates) if strict["rounds"] else None}}
    return out


def _load_verifier_head(model, want: dict, target_dir: str) -> None:
    """The target's final norm and lm_head (rows of the draft vocabulary; `want`: its tensors, as
    compat.speculators_verifier.read_text_model_tensors reads them from target_dir) into the draft's
    frozen verifier_norm / verifier_lm_head, which the exported draft does not hold; the draft's own
    (trained) lm_head and embed_tokens stay as exported."""
    import torch

    from compat.speculators_verifier import full_lm_head

    head = full_lm_head(want)
    if head is None or "model.norm.weight" not in want:
        raise ValueError(f"{target_dir}: no lm_head / final norm tensors found; pass the draft's target directory")
    if getattr(model, "use_draft_vocab", False):
        head = head[model.t2d.to(torch.bool)]
    with torch.no_grad():
        for param, tensor in ((model.verifier_lm_head.weight, head), (model.verifier_norm.weight,
                                                                        want["model.norm.weight"])):
            if param.shape != tensor.shape:
                raise ValueError(f"{target_dir}: the target's tensor has shape {tuple(tensor.shape)}, the draft's "
                                 f"verifier head expects {tuple(param.shape)}: not this draft's target")
            param.copy_(tensor.to(param.dtype))
