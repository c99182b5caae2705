"""Export a trained draft as a speculators-format directory that vLLM loads as an eagle3 draft.

Owns: the export directory's contents -
    config.json        speculators' Eagle3SpeculatorConfig (speculators_model_type "eagle3",
                       speculators_config.verifier.name_or_path = the target directory, which
                       vLLM needs to accept the draft for that target)
    model.safetensors  the draft weights via speculators' save_pretrained: fc, layers.*, norm,
                       input_norm (if any), embed_tokens, lm_head, d2t/t2d (if the draft vocab
                       is smaller); verifier_lm_head / verifier_norm are left out by speculators
    provenance.json    eagle3.provenance: train config, git commit, package versions, schema version
    serving.json       eagle3.serve: the `vllm serve` command for this draft at its default k,
                       unmeasured until the job's eval fills in its speedups
Weights are saved in the dtype they were trained in (fp32, or bf16 with bf16 training);
vLLM casts them to its own dtype.
Does not own: starting vLLM (the eval stage does), gathering ZeRO-3 shards
(eagle3.train.deepspeed_backend.gather_full_state_dict).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def export_draft(model_or_engine, out_dir: str | Path, target_dir: str | Path, *, train_config=None,
                 extra_provenance: dict | None = None) -> Path | None:
    """Write the draft (a speculators Eagle3DraftModel, or a DeepSpeed engine wrapping one) to
    out_dir in speculators format, pointing its verifier at target_dir.

    With a ZeRO-3 engine this is a collective (parameters are gathered): call it on every
    rank. Rank 0 writes and returns out_dir; other ranks return None.
    """
    from speculators.config import VerifierConfig

    from eagle3.train.deepspeed_backend import gather_full_state_dict

    module = getattr(model_or_engine, "module", model_or_engine)
    if not hasattr(module, "config") or getattr(module.config, "speculators_model_type", None) != "eagle3":
        raise TypeError(f"expected a speculators Eagle3DraftModel or an engine wrapping one, found "
                        f"{type(module).__name__}")
    state_dict = gather_full_state_dict(module)
    if _rank() != 0:
        return None
    target = Path(target_dir).resolve()
    if not (target / "config.json").exists():
        raise ValueError(f"target_dir {str(target)!r} has no config.json: pass the target model directory the "
                         "draft was trained against (vLLM must find it as the draft's verifier)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(module.config)
    config.speculators_config.verifier = VerifierConfig.from_pretrained(str(target))
    from compat.draft_config import vllm_draft_config_fixups

    vllm_draft_config_fixups(config)
    original = module.config
    module.config = config  # save_pretrained writes self.config; restored below
    try:
        module.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
    finally:
        module.config = original
    from eagle3.provenance import write_provenance

    write_provenance(out, {"train": dataclasses.asdict(train_config)} if train_config is not None else {},
                     "export", {"verifier": str(target), **(extra_provenance or {})})
    from eagle3.serve import write_serving_file

    write_serving_file(out.resolve(), target)
    logger.info("exported draft to %s (verifier %s)", out, target)
    return out
