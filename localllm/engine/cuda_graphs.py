"""Decode steps replayed from captured CUDA graphs.

Once its inputs sit in fixed buffers, a decode step's GPU work depends only on the batch size:
the Triton kernels' grids are fixed per shape and read context lengths and block tables from
device memory. So each batch-size bucket (1, 2, 4, 8, ... up to the largest batch) is captured
once at start, largest first into one shared memory pool (as vLLM does). A step copies its inputs
into the static buffers, pads the rest of its bucket with slot -1 and context length 0 (the
kernels write and read nothing for those rows) and replays. Prefill, extend and speculative
verify steps run eagerly.

Without `capture` (CPU, where the Triton kernels run in the interpreter) the same static buffers
and padding are used and the model is simply called on them: tests check the padding logic there.
"""

from __future__ import annotations

import torch

from ..model.attention import AttnMeta


def buckets_for(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_batch: int,
                 max_blocks: int, capture: bool = True):
        dev = model.device
        self.model, self.kv_caches = model, kv_caches
        self.buckets = buckets_for(max_batch)
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=dev)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = 0  # decode steps served from the static buffers
        if capture:
            self._capture_all()

    def _meta(self, bs: int) -> AttnMeta:
        return AttnMeta(self.slots[:bs], self.block_tables[:bs], self.cu_seqlens[:bs + 1], self.context_lens[:bs],
                        decode_only=True)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.ids[:bs], self.positions[:bs], self._meta(bs), self.kv_caches)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # all slots are -1 and all context lengths 0 here: the warm-up and capture runs (which
        # compile the Triton kernels and create cuBLAS handles) leave the KV cache untouched
        for bs in reversed(self.buckets):
            self._forward(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(bs)
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()

    def busy(self, busy: bool) -> None:
        """Nothing is built in the background here (graphs are captured at start)."""

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode step, or None when it is not a decode
        step or does not fit a bucket (too many sequences or a block table wider than the static
        one): run it eagerly."""
        B, width = ids.shape[0], meta.block_tables.shape[1]
        bs = next((b for b in self.buckets if b >= B), None)
        if not meta.decode_only or bs is None or width > self.block_tables.shape[1]:
            return None
        self.ids[:B].copy_(ids)
        self.positions[:B].copy_(positions)
        self.slots[:B].copy_(meta.slot_mapping)
        self.slots[B:bs].fill_(-1)
        self.context_lens[:B].copy_(meta.context_lens)
        self.context_lens[B:bs].zero_()
        # entries past `width` are stale but never read: a row reads only ceil(ctx / block) blocks
        self.block_tables[:B, :width].copy_(meta.block_tables)
        self.steps += 1
        if bs in self.graphs:
            graph, out = self.graphs[bs]
            graph.replay()
        else:
            out = self._forward(bs)
        return out[:B]
