"""How hidden states are encoded in the `hidden_states` and `hs_scale` columns of a shard, both
ways, and the fp8 maths; the one decoder of the stored format.

Owns: encoding a [T, L, D] tensor into the stored bytes (`encode_hidden_states`) and samples
into the Arrow columns (`hidden_states_columns`, which the extract stage builds its tables with), fp8
quantisation and dequantisation in torch on any device (`quantize_fp8`, defined in compat.fp8 so
that the hidden-states connector can run it on the GPU without importing the pipeline, and
re-exported here, where it runs on the host; `dequantize_fp8` on the host in packing and on the
device in the trainer's staging), and decoding a stored row back (`decode_row`, `decode_rows`),
which training, the doctor, the tests and the benchmarks all read through.
Does not own: the Arrow schema and its version check (eagle3.schema, which imports no torch),
writing or reading files (eagle3.extract.shards), what a training batch is (eagle3.train.data.packing).

Arrow has no bfloat16. A sample's hidden states are one `large_binary` value holding the raw
little-endian bytes of a row-major [num_tokens, num_layers, hidden_size] tensor. (A
list<uint16> would be the typed spelling, but Parquet has no 16-bit physical type and widens
it to INT32: twice the bytes on disk.)
- hs_dtype "bfloat16": bf16 bit patterns, 2 bytes a value, lossless w.r.t. a bf16 engine.
- hs_dtype "float8_e4m3fn": e4m3 bytes, and `hs_scale` is list<float32> of
  [num_tokens, num_layers]: one scale per token and layer (amax / 448), so
  value = e4m3 * scale. Half the bytes of bf16, ~2-3 significant digits.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from compat.fp8 import quantize_fp8
from eagle3.schema import HS_DTYPES, hs_layout


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of quantize_fp8: e4m3 values [..., D] (torch float8_e4m3fn) and float32 scales
    [...] -> value * scale, computed in float32 and rounded once to `dtype`; written into `out`
    (a tensor of that dtype) when given, else returned."""
    if out is None:
        return (q.float() * scale.unsqueeze(-1)).to(dtype)
    return torch.mul(q.float(), scale.unsqueeze(-1), out=out)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns (what torch's .to(bfloat16) does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode_hidden_states(hs_TLD, hs_dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """[T, L, D] array (numpy float32, or numpy uint16 holding bf16 bits, or a torch tensor) ->
    (flat values, flat scales or None). The flat values' bytes (`values.tobytes()`, or the buffer
    itself) are what the `hidden_states` column stores, the scales what `hs_scale` stores.
    bf16 torch tensors are taken bit-exact via a uint16 view."""
    if hs_dtype not in HS_DTYPES:
        raise ValueError(f"hs_dtype={hs_dtype!r} is not one of {HS_DTYPES}")
    if isinstance(hs_TLD, torch.Tensor):
        if hs_TLD.dtype == torch.bfloat16:
            bits = hs_TLD.contiguous().view(torch.uint16).numpy()
            if hs_dtype == "bfloat16":
                return bits.reshape(-1), None
            hs_TLD = _bf16_bits_to_f32(bits)
        else:
            hs_TLD = hs_TLD.float().numpy()
    if hs_dtype == "bfloat16":
        if hs_TLD.dtype == np.uint16:
            return hs_TLD.reshape(-1), None
        return _f32_to_bf16_bits(hs_TLD).reshape(-1), None
    q, scale = quantize_fp8(torch.from_numpy(np.ascontiguousarray(hs_TLD, dtype=np.float32)))
    return q.numpy().reshape(-1), scale.numpy().reshape(-1)


def binary_value(values: np.ndarray) -> pa.Array:
    """One sample's encoded values as a length-1 large_binary array over the same memory (no copy):
    the object store put (or the shard writer) is the only copy the bytes see on the host."""
    data = pa.py_buffer(values.view(np.uint8).reshape(-1))
    offsets = pa.py_buffer(np.array([0, data.size], dtype=np.int64))
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, data])


def hidden_states_columns(values: list[np.ndarray], scales: list[np.ndarray | None],
                          hs_dtype: str) -> tuple[pa.ChunkedArray, pa.Array]:
    """The `hidden_states` and `hs_scale` columns of encoded samples (encode_hidden_states's
    outputs, in row order): the values without a copy (binary_value), the scales as
    list<float32> (all null in bf16)."""
    hs_col = pa.chunked_array([binary_value(v) for v in values], type=pa.large_binary())
    if hs_dtype == "bfloat16":
        return hs_col, pa.nulls(len(values), type=pa.list_(pa.float32()))
    offsets = np.zeros(len(scales) + 1, dtype=np.int32)
    np.cumsum([len(s) for s in scales], out=offsets[1:])
    flat = np.concatenate(scales) if scales else np.zeros(0, np.float32)
    return hs_col, pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.float32()))


def decode_hidden_states(values, scale, num_tokens: int, num_layers: int, hidden_size: int, hs_dtype: str, *,
                         own: bool = False, where: str = "hidden_states") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stored values (bytes, a buffer, a pyarrow binary scalar or a flat numpy array) and scales
    (flat, fp8 only) -> (hidden states [T, L, D], scales [T, L] or None) as torch views of the
    stored memory, which the views keep alive: bf16, or e4m3 with float32 scales (dequantised where
    they are copied out: `dequantize_fp8`, `StoredRow.hidden_states_as`). `own`: copy instead, for
    memory that a view should not keep alive whole (a decoded Parquet row group). `where` names the
    row in errors."""
    if hs_dtype not in HS_DTYPES:
        raise ValueError(f"hs_dtype={hs_dtype!r} is not one of {HS_DTYPES}")
    fp8 = hs_dtype == "float8_e4m3fn"
    if isinstance(values, pa.Scalar):
        values = values.as_buffer()
    if not isinstance(values, np.ndarray):
        values = np.frombuffer(values, dtype=np.uint8 if fp8 else np.uint16)
    shape = (num_tokens, num_layers, hidden_size)
    if fp8 and scale is None:
        raise ValueError(f"{where}: fp8 hidden states without hs_scale; the shard is corrupt")
    scale = np.asarray(scale, dtype=np.float32) if fp8 else None
    if values.size != num_tokens * num_layers * hidden_size or (fp8 and scale.size != num_tokens * num_layers):
        raise ValueError(f"{where}: hidden_states holds {values.size} values"
                         + (f" and hs_scale {scale.size}" if fp8 else "")
                         + f", expected {shape}; the shard is corrupt")
    # Arrow buffers are read-only and torch warns on wrapping them. Nothing writes to these
    # views: they are only copied out of.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        hs = torch.from_numpy(values.reshape(shape))
        hs = hs.clone() if own else hs
        if not fp8:
            return hs.view(torch.bfloat16), None
        return hs.view(torch.float8_e4m3fn), torch.from_numpy(scale.reshape(num_tokens, num_layers))


class StoredRow(NamedTuple):
    """One sample as stored, unshifted: input_ids [T] and loss_mask [T] (numpy views of the
    Arrow columns), hidden_states [T, L, D] (torch: bf16, or e4m3 with `scale` [T, L] float32)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    hidden_states: torch.Tensor
    scale: torch.Tensor | None

    def hidden_states_as(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The hidden states' values in `dtype` (a new tensor): fp8 dequantised, bf16 cast."""
        if self.scale is None:
            return self.hidden_states.to(dtype, copy=True)
        return dequantize_fp8(self.hidden_states, self.scale, dtype=dtype)


def decode_row(batch: pa.RecordBatch, j: int, num_layers: int, hidden_size: int, hs_dtype: str, *,
               own: bool = False, where: str = "") -> StoredRow:
    """Row j of a record batch of hidden-states columns (at least input_ids, loss_mask, num_tokens,
    hidden_states, hs_scale), as views of its memory (decode_hidden_states; `own` copies the hidden
    states). `where` names the file and row in errors."""
    where = where or f"row {j}"
    T = int(batch.column("num_tokens")[j].as_py())

    def list_values(name):
        col = batch.column(name)
        offsets = col.offsets.to_numpy()
        return col.values.to_numpy(zero_copy_only=True)[offsets[j]:offsets[j + 1]]

    input_ids, loss_mask = list_values("input_ids"), list_values("loss_mask")
    if len(input_ids) != T or len(loss_mask) != T:
        raise ValueError(f"{where}: num_tokens={T} but input_ids has {len(input_ids)} and loss_mask "
                         f"{len(loss_mask)} values; the shard is corrupt")
    scale = list_values("hs_scale") if hs_dtype == "float8_e4m3fn" else None
    hs, scale = decode_hidden_states(batch.column("hidden_states")[j], scale, T, num_layers, hidden_size, hs_dtype,
                                     own=own, where=where)
    return StoredRow(input_ids, loss_mask, hs, scale)


def decode_rows(data: pa.Table | pa.RecordBatch) -> Iterator[StoredRow]:
    """Every row of a hidden-states table or record batch, in order, with the layout its schema
    declares (eagle3.schema.hs_layout, which refuses another schema version)."""
    layer_ids, hidden_size, hs_dtype = hs_layout(data.schema)
    batches = data.to_batches() if isinstance(data, pa.Table) else [data]
    for batch in batches:
        for j in range(batch.num_rows):
            yield decode_row(batch, j, len(layer_ids), hidden_size, hs_dtype)
