"""Seam: speculators' Eagle3SpeculatorConfig as vLLM reads it when serving the draft.

vLLM versions: 0.26 - 0.32 (vllm/transformers_utils/configs/speculators/algos.py
`update_eagle3`); speculators 0.9.
- A llama-type draft sizes its fc input from `transformer_layer_config.num_aux_hidden_states`
  (default 3), not from the top-level `eagle_aux_hidden_state_layer_ids`: with another number
  of aux layers vLLM fails to load the weights ("1024 vs 768"). We write it explicitly.
- `norm_before_residual`: vLLM's default is True, speculators' False; written explicitly so
  both read the value the draft was trained with (speculators serialises it; kept here so a
  future speculators that omits defaults cannot flip it).
Remove when: vLLM reads the aux-layer count from the top-level list for every draft type.
"""

from __future__ import annotations


def vllm_draft_config_fixups(config) -> None:
    aux = config.eagle_aux_hidden_state_layer_ids or [None, None, None]
    config.transformer_layer_config.num_aux_hidden_states = len(aux)
    config.norm_before_residual = bool(config.norm_before_residual)
