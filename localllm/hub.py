"""Hugging Face hub downloads into the standard HF cache (via huggingface_hub)."""

from __future__ import annotations

from pathlib import Path

from .registry import ModelRef

# just what a safetensors checkpoint needs: never *.bin / *.pth pickles
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "quant_config.json", "quantize_config.json"]


class HubError(RuntimeError):
    """A download failed for a reason the user can act on."""


def cached_snapshot(repo: str, revision: str = "main") -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                      local_files_only=True))
    except Exception:
        return None


def download(repo: str, revision: str = "main") -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise HubError(f"{repo} is gated: accept its license on https://huggingface.co/{repo} "
                       "and set HF_TOKEN to a token with access") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo} was not found on the Hugging Face hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo}: revision {revision!r} not found") from None
    except LocalEntryNotFoundError:
        raise HubError(f"{repo} is not in the local cache and the hub cannot be reached "
                       "(offline, or HF_HUB_OFFLINE=1)") from None
    if not any(path.glob("*.safetensors")):
        raise HubError(f"{repo} has no safetensors weights (supported: safetensors checkpoints, "
                       "AWQ/GPTQ safetensors, or a local .gguf file)")
    return path


def ensure_local(ref: ModelRef) -> Path:
    """Local path of a model, downloading it first if needed."""
    if ref.local_path is not None:
        return ref.local_path
    assert ref.repo is not None
    return cached_snapshot(ref.repo, ref.revision) or download(ref.repo, ref.revision)
