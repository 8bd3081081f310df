"""Routed experts stored as packed MXFP4, decoded one expert at a time (the ExpertBank seam of ops/moe/bank.py).

Legend: E experts, I expert intermediate width, D expert input width (the latent width in a LatentMoE).
w1, w3: packed uint8 [E, I, D/2] + scales uint8 E8M0 [E, I, D/32]; w2: packed [E, D, I/2] + scales [E, D, I/32].
These are the K3 checkpoint's `experts.{e}.{w1,w3,w2}.weight_packed` / `.weight_scale` stacked over e; gpt-oss-style
`*_blocks` / `*_scales` convert by reshapes and a row split (from_gpt_oss).

`expert(e, dtype)` decodes only expert e, so a layer's full-precision weights never exist at once; the MoE ops ask only
for experts that received tokens. Resident bytes are 4.25 bits per weight, 4.25 / 16 of bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from openk3.ops.moe.bank import DenseExpertBank, ExpertWeights
from openk3.ops.mxfp4 import MX_BLOCK, DecodeTables, MXFP4Tensor, ScaleMode, decode_tables, dequantize, from_gpt_oss, mxfp4_nbytes, quantize

PROJECTIONS = ("w1", "w3", "w2")
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.dtype, DecodeTables], torch.Tensor]  # mxfp4.dequantize's signature


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dense_bank_nbytes(bank: DenseExpertBank) -> int:
    """Resident bytes of a full-precision bank, the baseline PackedMXFP4ExpertBank.nbytes is compared with."""
    return sum(_tensor_nbytes(t) for t in (bank.w1_EID, bank.w3_EID, bank.w2_EDI))


class PackedMXFP4ExpertBank:
    """Holds the packed tensors as given (no copies); the caller owns their device placement."""

    def __init__(self, w1: MXFP4Tensor, w3: MXFP4Tensor, w2: MXFP4Tensor, *, decode: DecodeFn = dequantize) -> None:
        for name, t in zip(PROJECTIONS, (w1, w3, w2), strict=True):
            if t.packed.dtype != torch.uint8 or t.scales.dtype != torch.uint8 or t.packed.dim() != 3:
                raise ValueError(
                    f"packed expert bank: {name} packed {t.packed.dtype} {tuple(t.packed.shape)}, scales {t.scales.dtype}, "
                    "expected uint8 [E, rows, cols/2] and uint8 E8M0 [E, rows, cols/32]"
                )
        e, i, half_d = w1.packed.shape
        d = 2 * half_d
        want = {"w1": ((e, i, d // 2), (e, i, d // MX_BLOCK)), "w3": ((e, i, d // 2), (e, i, d // MX_BLOCK))}
        want["w2"] = ((e, d, i // 2), (e, d, i // MX_BLOCK))
        for name, t in zip(PROJECTIONS, (w1, w3, w2), strict=True):
            if d % MX_BLOCK or i % MX_BLOCK or (tuple(t.packed.shape), tuple(t.scales.shape)) != want[name]:
                raise ValueError(
                    f"packed expert bank: {name} packed {tuple(t.packed.shape)}, scales {tuple(t.scales.shape)}, "
                    f"expected {want[name][0]} and {want[name][1]} (E={e}, I={i}, D={d}; I and D multiples of {MX_BLOCK})"
                )
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.decode = decode  # the "mxfp4_decode" form the caller chose (ops/registry.py); mxfp4.dequantize by default

    @property
    def num_experts(self) -> int:
        return self.w1.packed.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w1.packed.shape[1]

    @property
    def width(self) -> int:
        return 2 * self.w1.packed.shape[2]

    def expert(self, e: int, dtype: torch.dtype) -> ExpertWeights:
        tables = decode_tables(dtype, self.w1.packed.device)
        return ExpertWeights(*(self.decode(t.packed[e], t.scales[e], dtype, tables) for t in (self.w1, self.w3, self.w2)))

    def decoded(self, ids: torch.Tensor, dtype: torch.dtype) -> DenseExpertBank:
        """Experts `ids` (int64 [n]) decoded at once into a dense bank of n experts, in that order: one decode call per
        projection (the same bits as expert())."""
        tables = decode_tables(dtype, self.w1.packed.device)
        return DenseExpertBank(*(self.decode(t.packed.index_select(0, ids), t.scales.index_select(0, ids), dtype, tables) for t in (self.w1, self.w3, self.w2)))

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed experts (codes and scales)."""
        return sum(mxfp4_nbytes(t) for t in (self.w1, self.w3, self.w2))

    def dense_nbytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes the same experts take as a DenseExpertBank in `dtype`."""
        elements = self.num_experts * 3 * self.intermediate_size * self.width
        return elements * dtype.itemsize

    def materialize(self, dtype: torch.dtype) -> DenseExpertBank:
        """Every expert decoded at once: for tests and offline comparison only; serving goes through expert()."""
        experts = [self.expert(e, dtype) for e in range(self.num_experts)]
        return DenseExpertBank(*(torch.stack(ws) for ws in zip(*experts, strict=True)))

    @classmethod
    def from_dense(cls, w1_EID: torch.Tensor, w3_EID: torch.Tensor, w2_EDI: torch.Tensor, scale_mode: str | ScaleMode = "floor") -> PackedMXFP4ExpertBank:
        """Quantise full-precision experts one expert at a time, so the working memory is one expert's, not the layer's."""
        DenseExpertBank(w1_EID, w3_EID, w2_EDI)  # validates the three shapes agree
        out = []
        for w in (w1_EID, w3_EID, w2_EDI):
            e, rows, cols = w.shape
            if cols % MX_BLOCK:
                raise ValueError(f"packed expert bank: input width {cols} of shape {tuple(w.shape)} is not a multiple of {MX_BLOCK}")
            packed = torch.empty(e, rows, cols // 2, dtype=torch.uint8, device=w.device)
            scales = torch.empty(e, rows, cols // MX_BLOCK, dtype=torch.uint8, device=w.device)
            for i in range(e):
                packed[i], scales[i] = quantize(w[i].detach(), scale_mode=scale_mode)
            out.append(MXFP4Tensor(packed, scales))
        return cls(*out)

    @classmethod
    def from_checkpoint(cls, tensors: Mapping[str, torch.Tensor], num_experts: int, prefix: str = "") -> PackedMXFP4ExpertBank:
        """Stack per-expert K3 tensors `{prefix}experts.{e}.{w1,w3,w2}.weight_packed` / `.weight_scale`.

        Packed codes may arrive as int8 and scales as float8_e8m0fnu (safetensors F8_E8M0); both are read as raw bytes.
        Missing tensors and shape mismatches name the tensor and the expected shape.
        """
        stacked = []
        for name in PROJECTIONS:
            parts: dict[str, list[torch.Tensor]] = {"weight_packed": [], "weight_scale": []}
            for e in range(num_experts):
                for suffix, bucket in parts.items():
                    key = f"{prefix}experts.{e}.{name}.{suffix}"
                    if key not in tensors:
                        raise KeyError(f"checkpoint is missing {key} (expected for {num_experts} MXFP4 experts)")
                    bucket.append(_as_bytes(key, tensors[key], bucket[0].shape if bucket else None))
            stacked.append(MXFP4Tensor(torch.stack(parts["weight_packed"]), torch.stack(parts["weight_scale"])))
        return cls(*stacked)

    @classmethod
    def from_gpt_oss(
        cls, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor
    ) -> PackedMXFP4ExpertBank:
        """gpt-oss-style stacked experts: `gate_up_proj_blocks` [E, 2I, D/32, 16] + `_scales` [E, 2I, D/32] and
        `down_proj_blocks` [E, D, I/32, 16] + `_scales` [E, D, I/32].

        gpt-oss interleaves the fused projection's rows: even rows are the gate (w1), odd rows the up projection (w3).
        Blocks run along each row's input features, so picking rows keeps every block whole; no value is re-encoded.
        """
        gate_up = from_gpt_oss(gate_up_blocks, gate_up_scales)
        if gate_up.packed.dim() != 3 or gate_up.packed.shape[1] % 2:
            raise ValueError(f"gpt-oss experts: gate_up_proj_blocks {tuple(gate_up_blocks.shape)}, expected [E, 2I, D/32, 16]")
        w1, w3 = (MXFP4Tensor(gate_up.packed[:, r::2].contiguous(), gate_up.scales[:, r::2].contiguous()) for r in (0, 1))
        return cls(w1, w3, from_gpt_oss(down_blocks, down_scales))

    def state_dict_entries(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The K3 checkpoint entries (views into this bank), inverse of from_checkpoint."""
        out = {}
        for name, t in zip(PROJECTIONS, (self.w1, self.w3, self.w2), strict=True):
            for e in range(self.num_experts):
                out[f"{prefix}experts.{e}.{name}.weight_packed"] = t.packed[e]
                out[f"{prefix}experts.{e}.{name}.weight_scale"] = t.scales[e]
        return out


def _as_bytes(key: str, t: torch.Tensor, expected_shape: torch.Size | None) -> torch.Tensor:
    if t.dtype in (torch.int8, torch.float8_e8m0fnu):
        t = t.view(torch.uint8)
    if t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"checkpoint tensor {key}: {t.dtype} {tuple(t.shape)}, expected uint8 [rows, cols]")
    if expected_shape is not None and t.shape != expected_shape:
        raise ValueError(f"checkpoint tensor {key}: shape {tuple(t.shape)}, expected {tuple(expected_shape)} like expert 0")
    return t
