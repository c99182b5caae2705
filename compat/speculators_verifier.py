"""Seam: how speculators reads the verifier (target) when building an EAGLE-3 draft.

Applies to speculators 0.9.x (checked against 0.9.0); compat/versions.py holds the range.

1. Multimodal targets. speculators' `load_verifier_weights` -> `utils.loading.load_model_layers`
   resolves "embed_tokens.weight", "lm_head.weight" and "model.norm.weight" by exact name,
   then by *suffix*, taking the shortest matching key. That covers the `language_model.` and
   `model.language_model.` prefixes of multimodal wrappers (checked in tests/test_train.py),
   but when another tower also has a key with that suffix (an audio tower's
   `audio_tower.embed_tokens.weight`, an omni model's `talker.model.embed_tokens.weight`)
   the shorter, wrong key wins, silently. `ensure_text_verifier_weights` re-reads the text
   model's tensors under their known spellings with safetensors and assigns them where
   speculators picked another tensor (with a warning). Remove once speculators resolves
   keys through the text model's prefix (no upstream issue filed yet); the test
   `test_compat_speculators_suffix_resolution_seam` fails when that behaviour changes.
2. `text_config`. speculators' `get_verifier_config` already unwraps `text_config`;
   `verifier_text_config` is that function, named here so only this file imports it.
3. Draft decoder config. speculators builds it in its CLI module
   (`speculators.train.cli.create_transformer_layer_config`, not a public API); called with
   every draft layer on full attention (the CLI default is sliding-window 2048 everywhere),
   the classic EAGLE-3 draft every vLLM eagle3 loader supports.
4. The draft vocabulary. speculators keeps `t2d` (a bool per target token: in the draft's
   vocabulary) and `d2t` (per draft token, the offset to its target id: target = draft + d2t),
   the format vLLM's eagle3 loader reads. Its accuracy metrics compare argmaxes inside the
   draft vocabulary; `draft_to_target_ids` gives each draft token's target id, so that a draft
   token can be compared with the target's argmax over its whole vocabulary, as vLLM accepts
   it. It checks that d2t and t2d name the same tokens, in order, so a change of the format
   fails there (tests/test_evaluate.py builds a draft with a vocabulary mapping).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# The text model's tensors under the spellings of plain and multimodal-wrapped checkpoints.
TEXT_MODEL_KEYS = {
    "embed_tokens.weight": ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
                            "model.language_model.embed_tokens.weight", "language_model.embed_tokens.weight"),
    "lm_head.weight": ("lm_head.weight", "language_model.lm_head.weight"),
    "model.norm.weight": ("model.norm.weight", "language_model.model.norm.weight",
                          "model.language_model.norm.weight", "language_model.norm.weight"),
}


def verifier_text_config(target_dir: str, trust_remote_code: bool = False):
    """The target's text-model config (`text_config` of a multimodal wrapper, else the config)."""
    from speculators.models.utils import get_verifier_config

    return get_verifier_config(target_dir, trust_remote_code=trust_remote_code)


def draft_layer_config(target_dir: str, num_layers: int, trust_remote_code: bool = False):
    """Llama decoder config for an EAGLE-3 draft of `num_layers` full-attention layers."""
    from speculators.train.cli import create_transformer_layer_config

    return create_transformer_layer_config(
        verifier_name_or_path=target_dir, num_layers=num_layers, draft_arch="llama", hidden_act=None,
        sliding_window=2048, full_attention_indices=list(range(num_layers)),
        trust_remote_code=trust_remote_code,
    )


def _weight_map(target_dir: Path) -> dict[str, str]:
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = target_dir / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{target_dir}: expected model.safetensors or model.safetensors.index.json; "
                         "found neither (only safetensors targets are supported)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def read_text_model_tensors(target_dir: str) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """The text model's embed_tokens / lm_head / final norm, by their known spellings only.
    Keys are speculators' names; a name none of whose spellings exists is left out."""
    from safetensors import safe_open

    root = Path(target_dir)
    weight_map = _weight_map(root)
    out = {}
    for name, spellings in TEXT_MODEL_KEYS.items():
        key = next((k for k in spellings if k in weight_map), None)
        if key is not None:
            with safe_open(str(root / weight_map[key]), framework="pt", device="cpu") as f:
                out[name] = f.get_tensor(key)
    return out


def full_lm_head(tensors: dict) -> "torch.Tensor | None":  # noqa: F821
    """The target's lm_head over its whole vocabulary from read_text_model_tensors' dict: its
    embed_tokens where the embeddings are tied (no lm_head tensor)."""
    return tensors.get("lm_head.weight", tensors.get("embed_tokens.weight"))


def ensure_text_verifier_weights(model, target_dir: str) -> list[str]:
    """Make the draft's frozen embed_tokens / lm_head / verifier_lm_head / verifier_norm equal
    the target's text-model tensors; return the names that had to be reassigned."""
    import torch

    want = read_text_model_tensors(target_dir)
    head = full_lm_head(want)
    if head is not None and getattr(model, "use_draft_vocab", False):
        head = head[model.t2d.to(torch.bool)]
    targets = [("embed_tokens.weight", model.embed_tokens.weight, want.get("embed_tokens.weight")),
               ("lm_head.weight", model.lm_head.weight, head),
               ("verifier_lm_head.weight", model.verifier_lm_head.weight, head),
               ("verifier_norm.weight", model.verifier_norm.weight, want.get("model.norm.weight"))]
    fixed = []
    with torch.no_grad():
        for name, param, tensor in targets:
            if tensor is None:
                continue
            tensor = tensor.to(param.dtype)
            if param.shape != tensor.shape:
                raise ValueError(f"[compat] {target_dir}: the target's tensor for draft {name} has shape "
                                 f"{tuple(tensor.shape)}, the draft expects {tuple(param.shape)}")
            if not torch.equal(param, tensor):
                param.copy_(tensor)
                fixed.append(name)
    if fixed:
        logger.warning("[compat] speculators loaded other tensors than the text model's for %s from %s "
                       "(suffix match picked another tower's key); reassigned from the text model",
                       fixed, target_dir)
    return fixed


def draft_to_target_ids(model) -> "torch.Tensor | None":  # noqa: F821
    """Each draft token's target id (draft id + d2t), or None when the draft predicts the target's
    own vocabulary (no mapping). Raises if d2t does not name t2d's tokens in increasing order."""
    import torch

    if not getattr(model, "use_draft_vocab", False):
        return None
    d2t, t2d = model.d2t.long(), model.t2d.bool()
    ids = torch.arange(len(d2t), device=d2t.device) + d2t
    if not (bool(t2d[ids].all()) and int(t2d.sum()) == len(ids) and bool((ids[1:] > ids[:-1]).all())):
        raise RuntimeError("[compat] the draft's d2t does not map onto the tokens t2d marks (draft id + d2t = "
                           "target id, increasing): speculators' vocabulary-mapping format changed")
    return ids
