"""The Arrow contracts between stages, declared once and versioned.

Owns: the prepared-token schema (prepare -> extract) and the hidden-states schema
(extract -> train), their metadata, and the reader check that refuses a version mismatch.
Does not own: how hidden states are encoded in the `hidden_states` / `hs_scale` columns
(eagle3.extract.codec, the one encoder and decoder, which imports torch; this module imports none,
so drivers can check a schema without it).

Layer order inside a token is the order of `layer_ids` in the schema metadata; the last
id is the target's final layer (before its final norm), the others are the EAGLE-3
auxiliary layers.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa

SCHEMA_VERSION = 1
HS_DTYPES = ("bfloat16", "float8_e4m3fn")

TOKENS_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
    ],
    metadata={"eagle3.kind": "tokens", "eagle3.schema_version": str(SCHEMA_VERSION)},
)


def ids_sha256(sample_ids) -> str:
    """The hash of an input's sample ids, in order, that the regenerated and hidden-states outputs'
    fingerprints hold (eagle3.extract.manifest): what tells a resume the same input, or one that grew."""
    h = hashlib.sha256()
    for s in sample_ids:
        h.update(s.encode())
        h.update(b"\0")
    return h.hexdigest()


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
