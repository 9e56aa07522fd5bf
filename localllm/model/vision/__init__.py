"""Images in, text out: what the engine needs from a vision-language model, for every family.

The interface (Gemma 3 and Idefics3/SmolVLM here; Qwen2.5-VL/Qwen3-VL plug in the same way):

* A family is a `VisionModel` (duck-typed; `ModelHandle.vision`, None for a text-only model):
    - `family: str`, `image_token_id: int`: the LM token id of one image row (the embedding rows
      replace the embeddings of the prompt positions whose id is this one, in order);
    - `placeholder: str`: what the model's chat template writes for one `{"type": "image"}` part;
    - `prepare(image: PIL.Image.Image) -> PixelInputs`: preprocessing, equal to transformers'
      image processor for the family (resize, rescale, normalise, tiles / patches);
    - `expand(pixels: PixelInputs) -> str`: the text that replaces one placeholder in the
      rendered prompt (the image's tokens: Gemma 3's 256 soft tokens between <start_of_image> and
      <end_of_image>, Idefics3's tile grid); the number of `image_token_id` tokens in it must be
      `pixels.n_tokens`;
    - `encode(batch: list[PixelInputs]) -> list[torch.Tensor]`: one [n_tokens, lm_hidden] tensor per
      image, in the LM's activation dtype on its device (the tower + projector/connector forward,
      batched across requests by the runner);
    - `bidirectional: bool`: an image's tokens attend to every token of its own span (Gemma 3's
      token_type_ids mask), not only causally;
    - `mrope: bool = False` (optional attribute): reserved for Qwen's M-RoPE (3-D positions). Not
      read anywhere yet: M-RoPE positions belong in `ModelRunner.inputs` (runner.py), which has
      each sequence's spans (`seq.images_in(start, end)`) and their `PixelInputs.extra` (the
      grid sizes), beside the 1-D positions `describe_batch` gives.
  A family is chosen by architecture in `load.py` (VISION_ARCHS: the tensor that says the
  checkpoint holds the vision side); the text model's tensors are found under the checkpoint's
  prefix by hf_weights.HFWeights, its config by config.ModelConfig.from_hf.
* The engine's side: `engine.encode_prompt(messages)` renders the chat template with the image
  parts (`{"type": "image", "image": bytes | PIL.Image}` in a message's content list; bytes are
  decoded and checked by `images.decode_image` there, in the worker thread that tokenizes), expands each placeholder, tokenizes and returns an
  `ImagePrompt` (ids + one `ImageSpan` per image); `add_request` takes it. A `Sequence` carries its
  spans (`seq.images`). The runner encodes each image once (`ModelRunner.image_embeddings`: cached
  by `ImageSpan.hash`, the count of encoded images in `vision_encodes`) and hands the rows to the
  model's one forward (`LlamaModel.forward(..., embeds=(flat row index, rows))`, which puts them
  in place of the embedding rows in `embed_tokens`). The prefix cache keys every block that holds
  part of a span with the image's hash (block_manager), and the scheduler never splits a span
  across prefill chunks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the front ends import this module's errors and types: no torch at import
    import torch


class ImageInputError(ValueError):
    """An image the model cannot take (not an image, too large, truncated, or a text-only model)."""


@dataclass(frozen=True, eq=False)
class PixelInputs:
    """One image as its family's vision tower takes it."""

    pixel_values: torch.Tensor  # the family's layout (Gemma 3: [1, 3, S, S]; Idefics3: [tiles, 3, S, S])
    n_tokens: int  # rows `encode` returns for it (= image_token_id tokens in `expand`)
    extra: dict[str, Any] = field(default_factory=dict)  # the family's other inputs (grid sizes, masks)

    def digest(self, family: str) -> str:
        """The image's identity for the caches: the exact pixel inputs (and the family)."""
        import torch

        h = hashlib.sha256(family.encode())
        for t in (self.pixel_values, *(v for _, v in sorted(self.extra.items()) if isinstance(v, torch.Tensor))):
            t = t.detach().contiguous().cpu()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        h.update(repr(sorted((k, v) for k, v in self.extra.items() if not isinstance(v, torch.Tensor))).encode())
        return h.hexdigest()


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a prompt: the prompt positions [offset, offset + length) it occupies (its
    first to its last image token; Idefics3's tile markers between rows lie inside), its hash and
    its pixel inputs. The embedding rows go to the positions inside whose id is image_token_id."""

    offset: int
    length: int
    hash: str
    pixels: PixelInputs

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ImagePrompt:
    """Prompt token ids with the images they hold."""

    ids: list[int]
    images: tuple[ImageSpan, ...]


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages)


def image_spans(ids: list[int], pixels: list[PixelInputs], image_token_id: int, family: str) -> tuple[ImageSpan, ...]:
    """The spans of the images in a tokenized, expanded prompt: image i owns the next
    pixels[i].n_tokens positions whose id is image_token_id."""
    where = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(where) != sum(p.n_tokens for p in pixels):
        raise ImageInputError(f"the prompt holds {len(where)} image tokens where its {len(pixels)} image(s) need "
                              f"{sum(p.n_tokens for p in pixels)} (image tokens typed into the text?)")
    spans, k = [], 0
    for p in pixels:
        first, last = where[k], where[k + p.n_tokens - 1]
        spans.append(ImageSpan(first, last - first + 1, p.digest(family), p))
        k += p.n_tokens
    return tuple(spans)
