"""The Arrow contracts between stages, declared once and versioned.

Owns: the prepared-token schema (prepare -> extract) and the hidden-states schema
(extract -> train), the encoding of hidden states in Arrow, and the reader check that
refuses a version mismatch. Imports no torch: encode/decode work on numpy arrays; the
trainer views the decoded uint16 buffer as torch.bfloat16 without a copy.

Arrow has no bfloat16. Hidden states are stored per sample as one `large_binary` value
holding the raw little-endian bytes of a row-major [num_tokens, num_layers, hidden_size]
tensor. (A list<uint16> would be the typed spelling, but Parquet has no 16-bit physical
type and widens it to INT32: twice the bytes on disk.)
- hs_dtype "bfloat16": bf16 bit patterns, 2 bytes a value, lossless w.r.t. a bf16 engine.
- hs_dtype "float8_e4m3fn": e4m3 bytes, and `hs_scale` is list<float32> of
  [num_tokens, num_layers]: one scale per token and layer (amax / 448), so
  value = e4m3 * scale. Half the bytes of bf16, ~2-3 significant digits.
Layer order inside a token is the order of `layer_ids` in the schema metadata; the last
id is the target's final layer (before its final norm), the others are the EAGLE-3
auxiliary layers.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1
HS_DTYPES = ("bfloat16", "float8_e4m3fn")
FP8_E4M3_MAX = 448.0

TOKENS_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
    ],
    metadata={"eagle3.kind": "tokens", "eagle3.schema_version": str(SCHEMA_VERSION)},
)


def hidden_states_schema(*, layer_ids: list[int], hidden_size: int, hs_dtype: str = "bfloat16") -> pa.Schema:
    if hs_dtype not in HS_DTYPES:
        raise ValueError(f"hs_dtype={hs_dtype!r} is not one of {HS_DTYPES}")
    return pa.schema(
        list(TOKENS_SCHEMA)
        + [
            pa.field("hidden_states", pa.large_binary(), nullable=False),
            pa.field("hs_scale", pa.list_(pa.float32()), nullable=True),
        ],
        metadata={
            "eagle3.kind": "hidden_states",
            "eagle3.schema_version": str(SCHEMA_VERSION),
            "eagle3.layer_ids": json.dumps(list(layer_ids)),
            "eagle3.hidden_size": str(hidden_size),
            "eagle3.hs_dtype": hs_dtype,
        },
    )


def stored_bytes_per_token(*, num_layers: int, hidden_size: int, hs_dtype: str) -> int:
    """Hidden-state bytes one token takes in a shard: 2 per value in bf16; 1 per value and a
    float32 scale per layer in fp8."""
    if hs_dtype == "bfloat16":
        return num_layers * hidden_size * 2
    return num_layers * (hidden_size + 4)


def check_schema(schema: pa.Schema, kind: str) -> dict:
    """Refuse data written under another schema version; return its eagle3 metadata."""
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items() if k.startswith(b"eagle3.")}
    found_kind = meta.get("eagle3.kind")
    if found_kind != kind:
        raise ValueError(f"expected an eagle3 '{kind}' dataset, found kind={found_kind!r} (metadata: {meta})")
    version = int(meta.get("eagle3.schema_version", -1))
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"dataset has schema_version {version}, this code reads {SCHEMA_VERSION}: "
            "re-run the stage that wrote it with this version, or use the matching release"
        )
    return meta


def hs_layout(schema: pa.Schema) -> tuple[list[int], int, str]:
    meta = check_schema(schema, "hidden_states")
    return json.loads(meta["eagle3.layer_ids"]), int(meta["eagle3.hidden_size"]), meta["eagle3.hs_dtype"]


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns (what torch's .to(bfloat16) does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode_hidden_states(hs_TLD, hs_dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """[T, L, D] array (numpy float32, or numpy uint16 holding bf16 bits) -> (flat values, scale).
    The flat values' bytes (`values.tobytes()`, or the buffer itself) are what the
    `hidden_states` column stores.

    A torch tensor is accepted too: bf16 tensors are taken bit-exact via a uint16 view.
    """
    if hasattr(hs_TLD, "dtype") and str(hs_TLD.dtype) == "torch.bfloat16":
        import torch

        bits = hs_TLD.contiguous().view(torch.uint16).numpy()
        if hs_dtype == "bfloat16":
            return bits.reshape(-1), None
        hs_TLD = bf16_bits_to_f32(bits)
    elif hasattr(hs_TLD, "numpy"):
        hs_TLD = hs_TLD.float().numpy()
    if hs_dtype == "bfloat16":
        if hs_TLD.dtype == np.uint16:
            return hs_TLD.reshape(-1), None
        return _f32_to_bf16_bits(hs_TLD).reshape(-1), None
    if hs_dtype == "float8_e4m3fn":
        import torch

        q, scale = quantize_fp8(torch.from_numpy(np.ascontiguousarray(hs_TLD, dtype=np.float32)))
        return q.numpy().reshape(-1), scale.numpy().reshape(-1)
    raise ValueError(f"hs_dtype={hs_dtype!r} is not one of {HS_DTYPES}")


def quantize_fp8(hs_TLD):
    """A [T, L, D] torch tensor (any float dtype, any device) -> (e4m3 bytes as uint8 [T, L, D],
    float32 scales [T, L]): one scale per token and layer, amax / 448. The one definition of the
    fp8 encoding, used on the host here and on the device by the hidden-states connector."""
    import torch

    x = hs_TLD.float()
    scale = x.abs().amax(dim=-1) / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_fp8(q, scale, out=None):
    """The inverse of quantize_fp8 for the trainer: e4m3 values [..., D] (torch float8_e4m3fn) and
    float32 scales [...] -> bf16, value * scale in float32 and rounded once; written into `out`
    (a bf16 tensor) when given, else returned."""
    import torch

    if out is None:
        return (q.float() * scale.unsqueeze(-1)).to(torch.bfloat16)
    return torch.mul(q.float(), scale.unsqueeze(-1), out=out)


def decode_hidden_states(values, scale: np.ndarray | None, num_tokens: int,
                         num_layers: int, hidden_size: int, hs_dtype: str) -> np.ndarray:
    """Stored value (bytes, a pyarrow binary scalar/buffer, or a flat numpy array) -> [T, L, D].
    bf16 stays as uint16 bits (a zero-copy view: torch.from_numpy(x).view(torch.bfloat16));
    fp8 is dequantised to float32."""
    shape = (num_tokens, num_layers, hidden_size)
    if isinstance(values, pa.Scalar):
        values = values.as_buffer()
    if not isinstance(values, np.ndarray):
        values = np.frombuffer(values, dtype=np.uint16 if hs_dtype == "bfloat16" else np.uint8)
    if values.size != num_tokens * num_layers * hidden_size:
        raise ValueError(f"hidden_states holds {values.size} values, expected {shape} = "
                         f"{num_tokens * num_layers * hidden_size}")
    if hs_dtype == "bfloat16":
        return values.reshape(shape)
    import torch

    q = torch.from_numpy(np.ascontiguousarray(values)).view(torch.float8_e4m3fn).float().numpy().reshape(shape)
    return q * scale.reshape(num_tokens, num_layers, 1)
