"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..model.vision import ImageSpan
from ..sampling import SamplingParams, generator_seed


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never past the context
    token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    num_preemptions: int = 0
    counted: bool = False  # prompt counted in the engine's cache statistics
    logprobs: list[dict] = field(default_factory=list)
    matcher: object | None = None  # llguidance matcher of a constrained request (localllm.structured)
    images: tuple[ImageSpan, ...] = ()  # the prompt's images (localllm.model.vision), by position

    def images_in(self, start: int, end: int) -> list[ImageSpan]:
        """The images whose spans overlap positions [start, end)."""
        return [im for im in self.images if im.offset < end and im.end > start]

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(generator_seed(self.params.seed))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
