"""The recipes in configs/recipes/: complete jobs a user edits only for paths. Each loads through the
job's own config checks; sets every value its figure depends on itself, so a change of the job's
defaults cannot change it; names its figure and the results file that holds it, or says it is not yet
measured; captures layers that exist in its target. The slow test runs the doctor's dry run of each
recipe's architecture (a config.json with the model's real dimensions, cut to 2 layers, dummy weights)
through the real vLLM CPU engine, with the recipe's extraction settings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3.config import load_job_config
from eagle3.schema import stored_bytes_per_token

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "configs" / "recipes"

# Each recipe's target, as its config.json on the Hugging Face hub gives it (dimensions, rope, MoE),
# without weights: the dry run loads vLLM's dummy weights into a 2-layer cut of it.
ARCHITECTURES = {
    "smollm2-135m-instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16",
    },
    "qwen2.5-coder-1.5b-instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 21,
        "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b-instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 36, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001, "output_router_logits": False, "hidden_act": "silu",
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
}
# Which architecture each recipe trains for (the all-records SmolLM2 recipe shares SmolLM2's).
ARCH_OF = {name: name for name in ARCHITECTURES} | {"smollm2-135m-instruct-all-records": "smollm2-135m-instruct"}
MEASURED = {"smollm2-135m-instruct", "smollm2-135m-instruct-all-records", "qwen2.5-coder-1.5b-instruct"}

# Every value a recipe's figure depends on, set in the file itself: the job's defaults change (the
# training length, the eval's prompts and tokens did), a recipe must not change with them.
SET_IN_EVERY_RECIPE = [
    "output_dir", "doctor", "stages",
    "target.model", "target.dtype", "target.trust_remote_code",
    "prepare.conversations", "prepare.max_length", "prepare.over_length", "prepare.max_samples",
    "prepare.leading_assistant", "prepare.assistant_only_loss", "prepare.num_eval_prompts",
    "prepare.heldout_fraction", "prepare.heldout_min_conversations", "prepare.chat_template_kwargs",
    "regenerate.enabled", "regenerate.temperature", "regenerate.top_p", "regenerate.max_tokens", "regenerate.cut",
    "regenerate.seed", "regenerate.max_num_seqs",
    "extract.aux_hidden_state_layer_ids", "extract.num_replicas", "extract.tensor_parallel_size",
    "extract.replicas_per_gpu", "extract.hs_dtype", "extract.max_num_batched_tokens", "extract.gpu_memory_utilization",
    "train.source", "train.num_workers", "train.num_steps", "train.seed", "train.eval_every_steps",
    "train.heldout_first_tokens",
    "train.optimizer.lr", "train.optimizer.min_lr", "train.optimizer.warmup_steps", "train.optimizer.weight_decay",
    "train.optimizer.grad_clip", "train.optimizer.zero_stage", "train.optimizer.bf16",
    "train.draft.ttt_steps", "train.draft.ttt_step_loss_decay", "train.draft.num_draft_layers",
    "train.draft.draft_vocab_size", "train.draft.loss",
    "train.data.micro_batch_tokens", "train.data.gradient_accumulation_steps",
    "eval.enabled", "eval.num_speculative_tokens", "eval.speed_k", "eval.speed_batch_sizes", "eval.speed_repeats",
    "eval.engines_at_once", "eval.start_during_training", "eval.num_prompts", "eval.max_tokens", "eval.ignore_eos",
    "eval.seed",
]
SET_WHEN_ONLINE = ["train.online.gpu_split", "train.online.epochs"]
# The paths a user edits, and nothing else: the placeholders every recipe uses.
PLACEHOLDERS = {"prepare.conversations": "data/sharegpt.json"}


def _recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "chat_template_kwargs":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _header(path: Path) -> str:
    """The comment lines before the first key, as one line of words."""
    lines = path.read_text().splitlines()
    head = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    return " ".join(" ".join(line.lstrip("#").split()) for line in head)


def test_every_architecture_has_its_recipe_and_every_recipe_an_architecture():
    assert set(_recipe_names()) == set(ARCH_OF), "a recipe added or removed: list it in ARCH_OF (and ARCHITECTURES)"


@pytest.mark.parametrize("name", _recipe_names())
def test_recipe_loads_as_a_complete_job_that_sets_what_its_figure_depends_on(name):
    """Loaded as the job loads it (every type, range and limit between stages checked; loading reads
    no path, so the placeholders stay); every key of SET_IN_EVERY_RECIPE is in the file itself."""
    path = RECIPES / f"{name}.yaml"
    cfg = load_job_config(path)
    raw = _flat(yaml.safe_load(path.read_text()))
    wanted = SET_IN_EVERY_RECIPE + (SET_WHEN_ONLINE if cfg.train.source == "online" else [])
    missing = [key for key in wanted if key not in raw]
    assert not missing, f"{name}: left to the job's defaults: {missing}"
    assert cfg.train.num_steps == raw["train.num_steps"] and cfg.eval.num_prompts == raw["eval.num_prompts"]
    for key, value in PLACEHOLDERS.items():
        assert raw[key] == value
    assert cfg.output_dir.startswith("runs/") and not cfg.target.model.startswith(("/", "~"))
    assert 3 in cfg.eval.num_speculative_tokens and cfg.eval.speed_k == 3


@pytest.mark.parametrize("name", _recipe_names())
def test_recipe_header_names_its_figure_or_says_it_is_not_measured(name):
    """A measured recipe names its AL(k=3) and the results files that hold it (they exist); a starting
    point says it is not yet measured and claims no figure."""
    header = _header(RECIPES / f"{name}.yaml")
    named = re.findall(r"benchmarks/results/\S+\.md", header)
    if name in MEASURED:
        assert "AL(k=3)" in header and named, header
        for result in named:
            assert (REPO / result).is_file(), f"{name} names {result}, which is not there"
    else:
        assert "not yet measured" in header and "AL(k=3)" not in header and not named, header


@pytest.mark.parametrize("name", _recipe_names())
def test_recipe_captures_layers_of_its_target_and_states_their_size(name):
    """The captured layers are the job's own rule on the target's real depth, (2, n // 2, n - 3), so a
    recipe moved to another target is caught; a starting point states the bytes a token of hidden
    states takes in bf16 (4 layers with the last), as its disk advice depends on it."""
    arch = ARCHITECTURES[ARCH_OF[name]]
    cfg = load_job_config(RECIPES / f"{name}.yaml")
    n = arch["num_hidden_layers"]
    assert tuple(cfg.extract.aux_hidden_state_layer_ids) == (2, n // 2, n - 3)
    assert list(cfg.extract.layer_ids(n)) == [2, n // 2, n - 3, n]
    if name not in MEASURED:
        per_token = stored_bytes_per_token(num_layers=4, hidden_size=arch["hidden_size"], hs_dtype="bfloat16")
        assert f"{per_token // 1024} KB a token in bf16" in _header(RECIPES / f"{name}.yaml")


# --- the doctor's dry run of each recipe's architecture ------------------------------------------------
# In a fresh child process, as the doctor runs it (a max_calls=1 Ray task): vLLM sets up its parallel
# state once per process. The recipe's extraction settings go in as they are, but for the parallelism a
# CPU cannot give (tensor and pipeline parallel 1).

DRY_RUN_CHILD = """
import json, sys
from eagle3.config import load_job_config
from eagle3.doctor import dry_run

if __name__ == "__main__":
    recipe, target = sys.argv[1], sys.argv[2]
    cfg = load_job_config(recipe, {"target.model": target, "extract.tensor_parallel_size": 1,
                                   "extract.pipeline_parallel_size": 1, "extract.num_replicas": None})
    check = dry_run(target, cfg.extract, dtype=cfg.target.dtype, trust_remote_code=cfg.target.trust_remote_code)
    print("CHECK " + json.dumps(check.to_dict()))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_doctor_dry_run_passes_on_the_recipes_architecture(name, tmp_path):
    """The doctor's dry run (eagle3.doctor.dry_run: the target's config cut to 2 layers, vLLM's dummy
    weights, one sample through the extraction path, shapes checked) on a config.json with the real
    dimensions of the recipe's target: the real hidden size, heads, vocabulary, rope and experts."""
    arch = ARCHITECTURES[name]
    target = tmp_path / name
    target.mkdir()
    (target / "config.json").write_text(json.dumps(arch, indent=1))
    script = tmp_path / "dry_run_child.py"
    script.write_text(DRY_RUN_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a child decides for itself
    out = subprocess.run([sys.executable, str(script), str(RECIPES / f"{name}.yaml"), str(target)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=840)
    lines = [line for line in out.stdout.splitlines() if line.startswith("CHECK ")]
    assert lines, f"rc {out.returncode}\n{out.stderr[-4000:]}"
    check = json.loads(lines[-1][len("CHECK "):])
    assert check["ok"], f"{check['detail']}\n{check['fix']}"
    assert check["detail"].startswith(f"{arch['architectures']} cut to 2 layers, dummy weights, backend vllm")
    # The recipe's aux layers (none is 0) land on the cut model's layer 1, with its last layer 2.
    want = (16, 2, arch["hidden_size"])
    assert f"hidden states {want} (want {want}), layers [1, 2]" in check["detail"], check["detail"]
    print(f"{name}: {check['detail']}")
