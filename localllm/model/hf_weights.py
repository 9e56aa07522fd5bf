"""A Hugging Face checkpoint directory's weights (config.json + safetensors shards)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import ModelConfig
from ..paths import safe_relative_name
from ..tokenizer import LLMTokenizer
from . import gguf_blocks, quant_formats  # AWQ / GPTQ / MXFP4
from .errors import ModelLoadError
from .int4 import Int4Weight
from .moe import EXPERT_NAME, EXPERT_PART

# gpt-oss's own names of what the loader asks for under the common ones (router, sinks)
_GPT_OSS_NAMES = {"mlp.router.weight": "mlp.gate.weight", "mlp.router.bias": "mlp.gate.bias",
                  "self_attn.sinks": "self_attn.sinks.weight"}


class HFWeights:
    """A Hugging Face model directory's safetensors weights (pickles are never read), AWQ / GPTQ
    packed modules included (quant_formats)."""

    def __init__(self, path: Path):
        self.path = path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)")
        try:
            self.raw_config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_file}: invalid JSON ({e})") from None
        try:
            self.config = ModelConfig.from_hf(self.raw_config)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{cfg_file}: {e}") from None
        self.quant = quant_formats.read_quant_config(path, self.raw_config)
        self.files = self._weight_files()
        self.index = self._index()

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index}: invalid index ({e})") from None
            bad = [n for n in names if not safe_relative_name(n)]
            if bad:  # the index comes from the hub too: a shard is a file in this folder, never ../x
                raise ModelLoadError(f"{index}: shard name {bad[0]!r} is not a file name inside {self.path}")
            files = [self.path / n for n in names]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"{self.path}: shard(s) listed in the index are missing: {', '.join(missing)}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pth")]
            hint = f" (found {', '.join(pickles)}: pickle checkpoints are never loaded)" if pickles else ""
            raise ModelLoadError(f"{self.path}: no *.safetensors weights{hint}")
        return files

    def _index(self) -> dict:
        from safetensors import safe_open

        index = {}
        self.headers: dict[str, tuple[str, tuple[int, ...]]] = {}  # stored name -> (dtype, shape)
        for f in self.files:
            try:
                end = _safetensors_data_end(f)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{f}: corrupt safetensors header ({e})") from None
            if end > f.stat().st_size:
                raise ModelLoadError(f"{f}: truncated safetensors file (needs {end} bytes, has {f.stat().st_size})")
            try:
                with safe_open(str(f), framework="pt") as h:
                    index.update(dict.fromkeys(h.keys(), f))
                    for k in h.keys():  # (the header's: no tensor read)
                        t = h.get_slice(k)
                        self.headers[k] = (t.get_dtype(), tuple(t.get_shape()))
            except Exception as e:
                raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
        # a multimodal checkpoint (Gemma 3 4B+, SmolVLM) holds the text model under a prefix: older
        # transformers wrote language_model.model.*, newer model.language_model.*, Idefics3
        # model.text_model.*; a bare decoder (Qwen3-Embedding, saved as Qwen3Model by
        # sentence-transformers) under none
        self.stored = {}
        for prefix in ("model.language_model.", "language_model.model.", "model.text_model.", ""):
            if "model.embed_tokens.weight" not in index and prefix + "embed_tokens.weight" in index:
                self.stored = {"model." + k[len(prefix):]: k for k in index if k.startswith(prefix)}
                index.update({ours: index[k] for ours, k in self.stored.items()})
        if self.stored and "lm_head.weight" not in index and "language_model.lm_head.weight" in index:
            self.stored["lm_head.weight"] = "language_model.lm_head.weight"  # an untied head, older layout
            index["lm_head.weight"] = index["language_model.lm_head.weight"]
        for k in list(index):
            m = re.fullmatch(r"(model\.layers\.\d+\.)(.+)", k)
            if m and m[2] in _GPT_OSS_NAMES:
                ours = m[1] + _GPT_OSS_NAMES[m[2]]
                self.stored[ours] = self.stored.get(k, k)
                index[ours] = index[k]
        return index

    def has(self, name: str) -> bool:
        if name in self.index:
            return True
        oss = self._gpt_oss_expert(name)
        return oss is not None and (oss[0] in self.index or oss[0] + "_blocks" in self.index)

    def kind(self, name: str) -> str | None:
        """How `name` is stored: "MXFP4" (gpt-oss's experts as published), else its safetensors
        dtype ("BF16", "F16", "F32", ...; an expert of a fused stack: the stack's); None where the
        checkpoint has no such tensor (an AWQ / GPTQ module, held as qweight, scales, ...)."""
        oss = self._gpt_oss_expert(name)
        stored = name if oss is None else oss[0]
        if oss is not None and self.mxfp4 and stored + "_blocks" in self.index:
            return "MXFP4"
        if stored not in self.index:
            return None
        return self.headers[self.stored.get(stored, stored)][0]

    def shape(self, name: str) -> tuple[int, ...]:
        """`name`'s shape as the loader holds it ([N, K] for a matrix)."""
        if self.kind(name) == "MXFP4":
            stem, _, rows = self._gpt_oss_expert(name)
            _, n, g, _ = self.headers[self.stored.get(stem + "_blocks", stem + "_blocks")][1]
            return len(range(n)[rows]), g * 32
        if name not in self.index:  # an expert of a fused stack
            return tuple(self.dense(name).shape)
        return self.headers[self.stored.get(name, name)][1]

    def stacked_blocks(self, names: list[str], kinds: tuple[str, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """The parts `names` (experts' matrices of one layer's stack: an expert's gate and up, or every
        expert's) where all are MXFP4 and MXFP4 is one of `kinds` (else None), as the checkpoint keeps
        them: (blocks uint8 [rows read, K / 32, 16] in its nibble order, the rows of the parts in
        order over them (None: all, as read), their E8M0 scales uint8 [rows read, K / 32]) for
        cpu_repack.block32, which reads this layout itself."""
        if "MXFP4" not in kinds or any(self.kind(n) != "MXFP4" for n in names):
            return None
        where = [self._gpt_oss_expert(n) for n in names]
        stems = {stem for stem, _, _ in where}
        if len(stems) != 1:
            return None
        # the experts' stack read once, from the first to the last expert named; the rows the names
        # take (an expert's gate: its even rows, interleaved with up's) picked by the repack
        stem = stems.pop()
        _, n, g, _ = self.headers[self.stored.get(stem + "_blocks", stem + "_blocks")][1]
        first, last = min(e for _, e, _ in where), max(e for _, e, _ in where)
        span = slice(first, last + 1)
        blocks = self._slice(stem + "_blocks", span).reshape(-1, g, 16)
        scales = self._slice(stem + "_scales", span).reshape(-1, g)
        order = torch.cat([(e - first) * n + torch.arange(n)[rows] for _, e, rows in where])
        return blocks, None if torch.equal(order, torch.arange(len(blocks))) else order, scales

    def blocks(self, name: str) -> gguf_blocks.Blocks:
        """An MXFP4 matrix's values as integers and scales (gguf_blocks); ValueError for others."""
        if self.kind(name) != "MXFP4":
            raise ValueError(f"{name} is not stored in blocks")
        return gguf_blocks.decode("MXFP4", self._mxfp4_blocks(name))

    def _slice(self, stored: str, index) -> torch.Tensor:
        """Part of the stored tensor `stored`, read alone (an expert's rows of a layer's stack)."""
        from safetensors import safe_open

        with safe_open(str(self.index[stored]), framework="pt") as h:
            return h.get_slice(self.stored.get(stored, stored))[index]

    def _gpt_oss_expert(self, name: str) -> tuple[str, int, slice] | None:
        """(stored tensor, expert, rows) of gpt-oss expert matrix `name` as its checkpoints fuse them
        per layer: gate_up_proj [E, H, 2I] (gate the even columns, up the odd) and down_proj [E, I, H]
        as transformers writes them (stored transposed, [in, out]); the published files' MXFP4 blocks
        gate_up_proj_blocks [E, 2I, H / 32, 16] and down_proj_blocks [E, H, I / 32, 16] with their
        E8M0 scales (gate the even rows); the biases gate_up_proj_bias [E, 2I], down_proj_bias [E, H].
        For a weight the stored name lacks the suffix (_blocks / _scales are added by the reader)."""
        ex = EXPERT_NAME.fullmatch(name)
        if self.config.architecture != "GptOssForCausalLM" or not ex:
            return None
        part = EXPERT_PART[ex[3]]
        stem = f"model.layers.{ex[1]}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}"
        rows = slice(None) if part == "down" else slice(0 if part == "gate" else 1, None, 2)
        return stem + ("_bias" if ex[4] == "bias" else ""), int(ex[2]), rows

    @property
    def mxfp4(self) -> bool:
        """The published gpt-oss layout: MXFP4 experts (quant_method mxfp4)."""
        return self.quant is not None and self.quant["quant_method"] == "mxfp4"

    def _mxfp4_blocks(self, name: str) -> torch.Tensor:
        """gpt-oss expert matrix `name`'s MXFP4 blocks in GGUF's layout, uint8 [rows, K / 32, 17]: the
        E8M0 byte, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31 (the
        checkpoint's bytes hold values 2j and 2j + 1). The same codes and scale: exact."""
        stem, e, rows = self._gpt_oss_expert(name)
        return _gguf_mxfp4(self._slice(stem + "_blocks", e)[rows], self._slice(stem + "_scales", e)[rows])

    def _fused_expert(self, name: str) -> torch.Tensor | None:
        """Expert layouts as transformers 5 holds them in memory (and writes them when its
        conversion is off): the experts fused per layer under mlp.experts, gate_up_proj
        [E, 2I, H] (gate rows, then up) and down_proj [E, H, I]; the router as mlp.gate.
        gpt-oss's own layouts: _gpt_oss_expert."""
        from safetensors import safe_open

        oss = self._gpt_oss_expert(name)
        if oss is not None:
            stem, e, rows = oss
            if stem.endswith("_bias"):
                return self._slice(stem, e)[rows] if stem in self.index else None
            if self.mxfp4 and stem + "_blocks" in self.index:
                return self.blocks(name).values()
            return self._slice(stem, e)[:, rows].t().contiguous() if stem in self.index else None
        ex = EXPERT_NAME.fullmatch(name)
        router = re.fullmatch(r"(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight", name)
        if router:
            return self.dense(f"{router[1]}.mlp.gate.weight") if self.has(f"{router[1]}.mlp.gate.weight") else None
        if not ex or ex[4] != "weight":
            return None
        part = EXPERT_PART[ex[3]]
        fused = f"model.layers.{ex[1]}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}"
        if fused not in self.index:
            return None
        with safe_open(str(self.index[fused]), framework="pt") as h:
            w = h.get_slice(fused)[int(ex[2])]  # this expert's rows only
        half = w.shape[0] // 2
        return w if part == "down" else w[:half] if part == "gate" else w[half:]

    def dense(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.index.get(name)
        if f is None:
            fused = self._fused_expert(name)
            if fused is not None:
                return fused
        if f is None and self.quant is not None and name.endswith(".weight") and \
                self.has(name[: -len("weight")] + "qweight"):
            return quant_formats.load_dense(self, name)  # a packed int4 module, dequantized
        if f is None:
            raise ModelLoadError(f"{self.path}: tensor {name} is missing")
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(self.stored.get(name, name))

    def int4(self, name: str) -> Int4Weight | None:
        if self.quant is None:
            return None
        return quant_formats.load_int4(self, name)

    def tokenizer(self) -> LLMTokenizer:
        try:
            return LLMTokenizer.from_dir(self.path, self.extra_eos_ids())
        except (FileNotFoundError, ValueError) as e:
            raise ModelLoadError(str(e)) from None

    def extra_eos_ids(self) -> set[int]:
        gen = self.path / "generation_config.json"
        ids = set()
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos = self.raw_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return {int(i) for i in ids}


def _gguf_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The checkpoint's MXFP4 (blocks uint8 [..., 16], byte m holding values 2m and 2m + 1 in its low
    and high nibbles; scales uint8 [...]) in GGUF's blocks, uint8 [..., 17]: the scale byte, then qs
    with value j in the low nibble of qs[j] and value j + 16 in its high one. So qs[2m] takes the low
    nibbles of bytes m and m + 8, qs[2m + 1] their high nibbles. The same codes and scale: exact."""
    lo, hi = blocks[..., :8], blocks[..., 8:]
    out = torch.empty(*scales.shape, 17, dtype=torch.uint8)
    out[..., 0] = scales
    out[..., 1::2] = (lo & 15) | (hi << 4)
    out[..., 2::2] = (lo >> 4) | (hi & 0xF0)
    return out


def _safetensors_data_end(f: Path) -> int:
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > f.stat().st_size:
            raise ValueError(f"header length {n} exceeds the file")
        header = json.loads(fh.read(n))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + (max(ends) if ends else 0)

