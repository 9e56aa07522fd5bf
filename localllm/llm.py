"""The Python API, in vLLM's shape: LLM(model).generate(prompts, params) / .chat(conversations, params)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import EngineConfig
from .engine.engine import LLMEngine, RequestOutput
from .hardware import pick_device
from .sampling import SamplingParams


def build_engine(model: str | None = None, precision: str = "auto", device: str = "auto",
                 config: EngineConfig | None = None, max_memory: float | None = None) -> LLMEngine:
    """Resolve a MODEL argument (alias, org/name, directory, .gguf), fetch it if needed, load it
    (and its draft model when `config.speculative` names one). With precision auto/awq/gptq or a
    `max_memory` (GiB) the planner picks precision, pre-quantized variant and context first."""
    config = config or EngineConfig()
    dev = pick_device(device)
    from .models_cli import local_path
    from .registry import resolve_model

    ref = resolve_model(model)
    _refuse_encoder(ref.name, local_path(ref))  # before the planner, which reads decoders' configs only
    base = model
    model, precision, config = _planned(model, precision, dev, config, max_memory)
    ref, loaded = _load(model, precision, dev, config.max_model_len, config.mmproj)
    draft = None
    spec = config.speculative
    if spec not in (None, "ngram"):
        if spec == "auto":
            if model != base:  # a pre-quantized variant: the pairing is the base model's
                from .registry import resolve_model

                ref = resolve_model(base)
            spec = ref.spec.draft if ref.spec is not None else None
            if spec is None:
                raise ValueError(f"no draft model is paired with {ref.name} in models.toml; "
                                 "pass --draft MODEL or --draft ngram")
        _, draft = _load(spec, "auto", dev, config.max_model_len)
    return LLMEngine(loaded, config, draft)


def build_embedder(model: str | None = None, device: str = "auto", precision: str = "auto"):
    """An Embedder (engine/embedder.py) on the encoder a MODEL argument names (default: the
    registry's default embedding model), fetched first if needed, at `precision`
    (encoder_loader.load_encoder's). ValueError for a model that is not an embedding model."""
    from .engine.embedder import Embedder
    from .hub import ensure_local
    from .model.encoder_loader import encoder_kind, load_encoder
    from .registry import load_registry, resolve_model

    registry = load_registry()
    ref = resolve_model(model or registry.default_embedding, registry)
    path = ensure_local(ref)
    kind = encoder_kind(path)
    if kind != "embedding":
        what = "a reranker" if kind == "rerank" else "a text generation model"
        raise ValueError(f"{ref.name} is not an embedding model (it is {what}); embedding models run by localllm: "
                         f"BERT-family checkpoints such as {registry.default_embedding}")
    return Embedder(load_encoder(path, pick_device(device), precision=precision))


def _refuse_encoder(name: str, path) -> None:
    """An embedding model or reranker named where a chat model is needed: say what it is for,
    rather than that its architecture is unknown."""
    from .model.encoder_loader import encoder_kind

    kind = encoder_kind(path)
    if kind is not None:
        use = "`localllm embed`, or /v1/embeddings and /api/embed" if kind == "embedding" else "/v1/rerank"
        raise ValueError(f"{name} is {'an embedding model' if kind == 'embedding' else 'a reranker'}, not a "
                         f"text generation model: use {use} of `localllm serve`")


def _planned(model: str | None, precision: str, device: str, config: EngineConfig, max_memory: float | None):
    """-> (model to load, loader precision, config): the planner's choice for auto/awq/gptq."""
    import dataclasses
    import logging

    from .config import kv_blocks
    from .planner import GiB, PlanError, device_facts, facts_for, normalize_quant, plan

    quant = normalize_quant(precision)
    kv = config.kv_memory_bytes
    if quant not in ("auto", "awq", "gptq") and not max_memory and not kv:
        return model, quant, config
    try:
        facts = facts_for(model, config.mmproj)
    except PlanError:
        if not max_memory and quant not in ("awq", "gptq"):  # size unknown before the download: load it as it comes
            return model, quant, config
        raise
    # with --kv-memory the plan counts the KV the engine will allocate: weights + it must fit
    p = plan(facts, device_facts(device), quant, config.max_model_len,
             int(max_memory * GiB) if max_memory else None, kv, config.kv_type)
    if not p.fits:
        raise PlanError(p.reason)
    for w in p.warnings:
        logging.getLogger("localllm").warning("warning: %s", w)
    changes = {"max_model_len": config.max_model_len or p.ctx}  # with --kv-memory: the context it holds
    if max_memory and not config.kv_memory_bytes:  # the KV blocks the plan counted within --max-memory
        changes["num_kv_blocks"] = kv_blocks(changes["max_model_len"], config.block_size)
    return p.variant or model, p.precision, dataclasses.replace(config, **changes)


def _load(model: str | None, precision: str, device: str, max_model_len: int | None, mmproj: str | None = None):
    from .hub import ensure_local
    from .model.loader import load_model
    from .registry import resolve_model

    ref = resolve_model(model)
    path = ensure_local(ref)
    _refuse_encoder(ref.name, path)
    loaded = load_model(path, precision, device, max_model_len, mmproj=mmproj)
    loaded.name = ref.name
    return ref, loaded


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)


class LLM:
    def __init__(self, model: str | None = None, precision: str = "auto", device: str = "auto",
                 draft: str | None = None, spec_tokens: int = 4, eager: bool = False, **engine_kwargs):
        """`draft`: a draft model (alias, path, repo), "ngram" for prompt lookup, or "auto" for
        the registry's pairing; `spec_tokens`: the initial number of speculative tokens; `eager`:
        no compiled step (on CPU it is built in the background the first time) or CUDA graphs."""
        engine_kwargs.setdefault("compile", not eager)
        config = EngineConfig(speculative=draft, num_speculative_tokens=spec_tokens, **engine_kwargs)
        self.engine = build_engine(model, precision, device, config)
        self.tokenizer = self.engine.tokenizer

    def _run(self, prompts: list, params: SamplingParams | list[SamplingParams] | None) -> list[CompletionOutput]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("params list must have one entry per prompt")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        finally:
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
        return [CompletionOutput(done[r].text, done[r].token_ids, done[r].finish_reason, done[r].prompt_token_ids,
                                 done[r].num_cached_tokens, done[r].logprobs) for r in ids]

    def generate(self, prompts: str | list[str] | list[list[int]], params=None) -> list[CompletionOutput]:
        """Raw completion of each prompt (no chat template)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), params)

    def chat(self, conversations: list[dict] | list[list[dict]], params=None) -> list[CompletionOutput]:
        """Each conversation (a list of {"role", "content"}) rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run(list(conversations), params)
