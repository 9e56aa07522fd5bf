"""A decoder (localllm.model.llama.LlamaModel) run as an encoder: the hidden states of a packed
batch of whole inputs, for decoder embedders (Qwen3-Embedding: last-token pooling), embeddings of
a chat model (as Ollama's llama.cpp engine returns them) and yes/no rerankers (Qwen3-Reranker).

No second copy of the math: the batch runs LlamaModel.forward itself, each input as a fresh
prompt of a throwaway paged KV cache sized to the batch (causal attention confined to each
input, exactly what a prefill of the same tokens computes). The cache is allocated per forward
and dropped after it, so a loaded embedder holds no KV memory between requests.
"""

from __future__ import annotations

import torch

from .attention import describe_batch
from .bert import Packed
from .llama import LlamaModel

BLOCK_SIZE = 16


class YesNoHead:
    """A reranker's relevance from a decoder's next-token logits at the last position: the logits
    of the answer tokens `no` and `yes` (Qwen3-Reranker: softmax over the two, p(yes))."""

    def __init__(self, no_id: int, yes_id: int):
        self.ids = [no_id, yes_id]


class DecoderEncoder:
    """The BertEncoder interface (forward(input_ids, packed) -> [T, hidden], head, classify) on a
    LlamaModel."""

    def __init__(self, model: LlamaModel, kv_dtype: torch.dtype, head: YesNoHead | None = None):
        self.model, self.kv_dtype, self.head = model, kv_dtype, head
        self.device = model.device

    def parameters(self):
        return self.model.parameters()

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, packed: Packed) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (what llama.cpp's embedding output is)."""
        lengths = packed.lengths
        blocks = [-(-n // BLOCK_SIZE) for n in lengths]
        width = max(blocks)
        tables = torch.zeros(len(lengths), width, dtype=torch.int64)  # 0: the null block
        start = 1
        for i, b in enumerate(blocks):
            tables[i, :b] = torch.arange(start, start + b)
            start += b
        kv = self.model.new_kv_cache(start, BLOCK_SIZE, self.kv_dtype)
        positions, meta = describe_batch(tables, lengths, lengths, BLOCK_SIZE, self.model.attention_backend,
                                         self.device)
        return self.model(input_ids, positions, meta, kv)

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, packed: Packed) -> torch.Tensor:
        """[B, 2]: the (no, yes) logits at each input's last token."""
        if self.head is None:
            raise ValueError("this model has no yes/no head (not a reranker)")
        last = torch.tensor(packed.starts, device=hidden.device) + torch.tensor(packed.lengths, device=hidden.device) - 1
        return self.model.logits(hidden[last])[:, self.head.ids]
