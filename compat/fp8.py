"""Not a seam: the fp8 encoding of hidden states (one scale per token and layer, amax / 448).

It lives here because the hidden-states connector (compat/hidden_states_connector.py) runs it on
the device inside vLLM, and compat/ imports nothing of the pipeline above it (tests/
test_layering.py). eagle3.extract.codec, which owns the stored format, imports `quantize_fp8` from here
(so `eagle3.extract.codec.quantize_fp8` still names it) and holds the inverse (`dequantize_fp8`); read the
format there.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0


def quantize_fp8(hs_TLD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [T, L, D] torch tensor (any float dtype, any device) -> (e4m3 bytes as uint8 [T, L, D],
    float32 scales [T, L]): one scale per token and layer, amax / 448. The one definition of the
    fp8 encoding, used on the host by eagle3.extract.codec and on the device by the hidden-states connector."""
    x = hs_TLD.float()
    scale = x.abs().amax(dim=-1) / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8), scale
