"""Seam: the sample and micro-batch format speculators' Eagle3DraftModel trains on.

speculators 0.9.x (checked against 0.9.0): samples are shifted by
`speculators.models.eagle3.data.shift_batch` (position t pairs token x_{t+1}, target y_{t+1}
and hidden state g_t) and packed by `speculators.train.data.CollateFn` into [1, max_len]
tensors, with `document_ids` (-1 for padding) and the last sample truncated to fit.
Our trainer builds that batch straight from the stored rows (eagle3.train.data.packing.pack, which
copies each value once; why: its module docstring). This module holds only what follows
speculators' version: `speculators_sample`, one stored row as speculators' own sample (through
shift_batch). tests/test_compat.py checks that `pack` returns exactly what shift_batch +
CollateFn return (keys, shapes, dtypes, values, truncation); it fails when speculators changes
the format.
Remove when: speculators' collate writes into caller-provided (pinned) buffers from views; the
trainer then calls it and `pack` goes.
"""

from __future__ import annotations

import numpy as np
import torch


def speculators_sample(input_ids: np.ndarray, loss_mask: np.ndarray, hs_TLD: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stored row (input_ids [T], loss_mask [T], hidden states [T, L, H], fp8 already dequantised)
    as one speculators sample, shifted by speculators' own shift_batch: input_ids [T-1] long,
    loss_mask [T-1] bool, hidden_states [T-1, (L-1)*H] (the aux layers, concatenated in layer order),
    verifier_last_hidden_states [T-1, H] (the last layer), lengths [1], position_ids [T-1] (from 1)."""
    from speculators.models.eagle3.data import shift_batch

    T, num_layers, hidden_size = hs_TLD.shape
    return shift_batch({
        "input_ids": torch.from_numpy(input_ids.astype(np.int64)),
        "loss_mask": torch.from_numpy(loss_mask.astype(bool)),
        "hidden_states": hs_TLD[:, :-1, :].reshape(T, (num_layers - 1) * hidden_size),
        "verifier_last_hidden_states": hs_TLD[:, -1, :].clone(),
        "lengths": torch.tensor([T], dtype=torch.long),
        "position_ids": torch.arange(T, dtype=torch.long),
    })
