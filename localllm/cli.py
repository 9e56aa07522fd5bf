"""The `localllm` command line (typer). Front ends only build requests and print what comes back."""

from __future__ import annotations

import gc
import math
import os
import re
import sys
import time
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="localllm", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Run large language models locally: one-shot (run), interactive (chat), or as an OpenAI-compatible "
         "server (serve).",
)

# ---- options shared by the commands that load a model ------------------------------------------
ModelArg = Annotated[Optional[str], typer.Argument(help="Alias from models.toml, hub repo org/name, model "
                                                         "directory or .gguf file (default: the embedded model).")]
QuantOpt = Annotated[str, typer.Option("--quant", "--precision", help="auto|bf16|fp16|fp32|int8|int4|awq|gptq "
                                                                      "(auto: the planner picks what fits).")]
MaxMemOpt = Annotated[Optional[str], typer.Option("--max-memory", help="Memory the model may use (weights + KV + "
                                                                       "runtime): GiB, or with a unit (8GiB, 512MiB, "
                                                                       "8G); default: 90% of free memory.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto|cpu|cuda")]
CtxOpt = Annotated[Optional[int], typer.Option("--ctx", help="Context length (default: the model's).")]
KvMemOpt = Annotated[Optional[str], typer.Option("--kv-memory", help="Memory for the KV cache: GiB, or with a "
                                                                     "unit (512MiB, 2GiB).")]
KvTypeOpt = Annotated[str, typer.Option("--kv-type", help="KV cache type: auto|f32|f16|bf16|q8_0 (llama.cpp's "
                                        "-ctk/-ctv names; q8_0: 8-bit, about half the memory and bytes per token "
                                        "of f16; auto: f16 for quantized or 16-bit weights on CPU, f32 for fp32 "
                                        "weights).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: all cores).")]
ActBitsOpt = Annotated[int, typer.Option("--act-bits", help="Activations inside the CPU int4 / int8 weight kernels: "
                                         "16 (default, about bf16's error squared) or 8 (llama.cpp's way: ~1.7x "
                                         "faster prompt processing, slightly different numbers; see BENCHMARKS.md "
                                         "for its perplexity cost).")]
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
DraftOpt = Annotated[Optional[str], typer.Option("--draft", help="Speculative decoding: a draft MODEL, 'ngram' "
                                                                 "(prompt lookup) or 'auto' (the registry's pairing).")]
SpecTokensOpt = Annotated[int, typer.Option("--spec-tokens", help="Initial speculative tokens per step (k).")]
EagerOpt = Annotated[bool, typer.Option("--eager", "--enforce-eager", help="Run every step eagerly: no compiled "
                                        "CPU step (built once per model in the background at idle priority, then "
                                        "loaded in ~10 ms) and no CUDA graphs.")]
MmprojOpt = Annotated[Optional[str], typer.Option(
    "--mmproj", help="llama.cpp's mmproj GGUF (the vision tower) for a GGUF model: images in. Default: the "
                     "mmproj*.gguf beside the model file, when there is one.", show_default=False)]
AllowImageURLsOpt = Annotated[bool, typer.Option(
    "--allow-image-urls", help="Fetch http(s) image URLs (OpenAI image_url parts, --image URL) for a vision model: "
                               "off by default, since the URLs may name any address this machine reaches.")]
# the compiled step is the default now; --compile stays accepted so old scripts keep working
CompileOpt = Annotated[bool, typer.Option("--compile", hidden=True, help="No-op (compiled is the default).")]


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print a clear one-line error on stderr and exit (never a traceback for user mistakes)."""
    typer.echo(f"Error: {message}", err=True)
    return typer.Exit(code)


_UNITS = {"": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def parse_memory(text: str | None, flag: str) -> int | None:
    """'8' (GiB), '8GiB', '512MiB', '8G' (binary), '8GB' (decimal) -> bytes; a clear error for
    anything else, including 0, negative, nan and inf."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in _UNITS:
        raise fail(f"invalid value for {flag}: {text!r} is not a size (a number of GiB, or with a unit: "
                   "512MiB, 8GiB, 8G, 8GB)", 2)
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(value) or value < 1:
        raise fail(f"invalid value for {flag}: must be a positive size, got {text!r}", 2)
    return int(value)


def check_memory(device: str, **asked: int | None) -> None:
    """Refuse up front any memory request beyond what the device has free (the kernel's OOM
    killer would end the process later, silently)."""
    from .hardware import available_memory, pick_device
    from .planner import gib

    asked = {k: v for k, v in asked.items() if v}
    if not asked:
        return
    try:
        dev = pick_device(device)
    except ValueError as e:
        raise fail(str(e), 2) from None
    free = available_memory(dev)
    for flag, n in asked.items():
        if n > free:
            where = "free RAM" if dev == "cpu" else f"free memory on {dev}"
            raise fail(f"{flag} {gib(n)} is more than the {gib(free)} of {where}; lower it or leave it out", 1)


def check_kv_type(kv_type: str) -> None:
    from .config import KV_TYPE_BYTES

    if kv_type != "auto" and kv_type not in KV_TYPE_BYTES:
        raise fail(f"invalid value for --kv-type: {kv_type!r}; choose from auto, {', '.join(KV_TYPE_BYTES)}", 2)


def engine_config(ctx: int | None = None, kv_memory: str | None = None, kv_type: str = "auto",
                  threads: int | None = None,
                  draft: str | None = None, spec_tokens: int = 4, enforce_eager: bool = False, device: str = "auto",
                  act_bits: int = 16, **kw):
    from .config import EngineConfig

    check_kv_type(kv_type)
    if act_bits not in (8, 16):
        raise fail(f"invalid value for --act-bits: 8 or 16, got {act_bits}", 2)
    if not 1 <= spec_tokens <= 16:
        raise fail(f"invalid value for --spec-tokens: must be in 1..16, got {spec_tokens}", 2)
    if threads is not None and threads < 1:
        raise fail(f"invalid value for --threads: must be >= 1 (leave it out for all cores), got {threads}", 2)
    if ctx is not None and ctx < 1:
        raise fail(f"invalid value for --ctx: must be >= 1 (leave it out for the model's), got {ctx}", 2)
    kv_bytes = parse_memory(kv_memory, "--kv-memory")
    check_memory(device, **{"--kv-memory": kv_bytes})
    return EngineConfig(max_model_len=ctx, kv_memory_bytes=kv_bytes, kv_type=kv_type, num_threads=threads,
                        speculative=draft, act_bits=act_bits,
                        num_speculative_tokens=spec_tokens, compile=not enforce_eager, **kw)


def max_memory_gib(max_memory: str | None, device: str) -> float | None:
    """--max-memory -> GiB (what the planner takes), checked against the machine."""
    n = parse_memory(max_memory, "--max-memory")
    check_memory(device, **{"--max-memory": n})
    return None if n is None else n / (1 << 30)


def open_engine(model: str | None, quant: str, device: str, config, max_memory: float | None = None):
    """build_engine with every user-facing failure turned into a one-line error."""
    from .hub import HubError
    from .llm import build_engine
    from .model.loader import ModelLoadError
    from .planner import PlanError
    from .registry import UnknownModelError

    try:
        return build_engine(model, quant, device, config, max_memory=max_memory)
    except (UnknownModelError, ModelLoadError, HubError, FileNotFoundError, PlanError) as e:
        raise fail(str(e)) from None
    except ValueError as e:
        raise fail(str(e), 2) from None
    finally:
        _startup_done()


def sampling_params(**kw):
    from .sampling import SamplingError, SamplingParams

    try:
        return SamplingParams(**kw)
    except SamplingError as e:
        raise fail(f"invalid value for --{e.param.replace('_', '-')}: {e}", 2) from None


def format_constraint(value: str | None):
    """--format: 'json', an inline JSON schema, or a path to one -> a checked Constraint (exit 2
    with llguidance's message when the schema does not compile)."""
    import json
    from pathlib import Path

    from .structured import Constraint, ConstraintError

    if value is None:
        return None
    try:
        if value.strip() == "json":
            return Constraint.make("json")
        text = value
        if not value.lstrip().startswith("{"):
            path = Path(value).expanduser()
            if not path.is_file():
                raise fail(f"invalid value for --format: {value!r} is not 'json', an inline JSON schema or a "
                           "schema file", 2)
            text = path.read_text(encoding="utf-8")
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise fail(f"invalid value for --format: not JSON ({e})", 2) from None
        return Constraint.make("json_schema", schema)
    except ConstraintError as e:
        raise fail(f"invalid value for --format: {e}", 2) from None
    except (OSError, UnicodeDecodeError) as e:
        raise fail(f"invalid value for --format: cannot read {value}: {e}", 2) from None


def read_stdin() -> str:
    """Piped stdin as text; input that is not UTF-8 is refused with where it goes wrong (decoding
    it with replacements would send the model something the user never wrote)."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # already text (an embedding program's or a test's stand-in)
        return sys.stdin.read()
    data = stream.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it first, "
                   "e.g. with iconv -t UTF-8", 2) from None


def _looks_like_path(word: str) -> bool:
    return word.startswith(("/", "./", "../", "~")) or os.path.exists(word)


# ---- run ------------------------------------------------------------------------------------------
@app.command()
def run(
    args: Annotated[Optional[list[str]], typer.Argument(help="[MODEL] PROMPT... (piped stdin goes before the prompt)",
                                                        show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model (instead of the first argument).")] = None,
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", "-n", help="Max new tokens (default: until "
                                                                                 "the model stops).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.95,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = 0,
    min_p: Annotated[float, typer.Option("--min-p")] = 0.0,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Same seed, same output.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    raw_output: Annotated[bool, typer.Option("--raw-output", help="Write the answer to a terminal as is: by default "
                                             "control characters (escape sequences) are shown as ^[ and the like "
                                             "there; piped output is always as is.")] = False,
    format: Annotated[Optional[str], typer.Option(
        "--format", help="Hold the answer to JSON: 'json' (any JSON object), or a JSON schema given inline "
                         "or as the path of a .json file.", show_default=False)] = None,
    think: Annotated[Optional[bool], typer.Option(
        "--think/--no-think", help="Reasoning models (Qwen3, ...): --think prints the reasoning before the answer; "
                                   "--no-think asks the model not to reason. Default: it reasons, only the answer "
                                   "is printed.", show_default=False)] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Token counts, TTFT and speed on stderr.")] = False,
    quant: QuantOpt = "auto",
    device: DeviceOpt = "auto",
    ctx: CtxOpt = None,
    kv_memory: KvMemOpt = None,
    kv_type: KvTypeOpt = "auto",
    act_bits: ActBitsOpt = 16,
    threads: ThreadsOpt = None,
    draft: DraftOpt = None,
    spec_tokens: SpecTokensOpt = 4,
    enforce_eager: EagerOpt = False,
    max_memory: MaxMemOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the precision/context plan and exit "
                                                            "(nothing is loaded or downloaded).")] = False,
    build: Annotated[bool, typer.Option("--build", help="Queue the compiled step's build for this model when it "
                                        "has none yet (a background process at idle priority that outlives "
                                        "this command; see `localllm ps`). chat and serve do it by "
                                        "themselves.")] = False,
    compile: CompileOpt = False,
    image: Annotated[Optional[list[str]], typer.Option(
        "--image", help="An image file for a vision model (repeatable); a path of an image file in the prompt "
                        "is attached too, as Ollama does; an http(s) URL with --allow-image-urls.",
        show_default=False)] = None,
    allow_image_urls: AllowImageURLsOpt = False,
    mmproj: MmprojOpt = None,
):
    """Answer one prompt and exit: `localllm run [MODEL] PROMPT` or `echo PROMPT | localllm run`."""
    from .registry import load_registry, looks_like_model

    words = list(args or [])
    if model is None and words and (looks_like_model(words[0], load_registry()) or _looks_like_path(words[0])):
        model = words.pop(0)  # a path that is no model is an error (resolve_model says why), never prompt text
    elif model is None and len(words) > 1 and " " not in words[0]:
        from .registry import resolve_model

        try:  # a mistyped model name should not silently become part of the prompt
            resolve_model(words[0])
        except ValueError as e:
            if getattr(e, "suggestions", None):
                raise fail(str(e)) from None
    max_gib = max_memory_gib(max_memory, device)
    if dry_run:
        check_kv_type(kv_type)  # the memory flags are the plan's to weigh: it refuses with its figures
        print_plan(model, quant, device, ctx, max_gib, parse_memory(kv_memory, "--kv-memory"), kv_type)
        return
    piped = "" if sys.stdin.isatty() else read_stdin()
    parts = [p for p in (piped.strip("\n"), " ".join(words)) if p.strip()]
    if not parts:
        raise fail("no prompt: pass it as arguments or pipe it on stdin (e.g. echo hi | localllm run)", 2)
    prompt = "\n\n".join(parts)
    constraint = format_constraint(format)
    params = sampling_params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             min_p=min_p, repetition_penalty=repeat_penalty, seed=seed, stop=stop or [],
                             constraint=constraint)
    # a one-shot run exits long before a build could pay off: it queues one only when asked
    config = engine_config(ctx, kv_memory, kv_type, threads, draft, spec_tokens, enforce_eager, device, act_bits,
                           parallel=1, background_build=build, mmproj=mmproj)
    engine = open_engine(model, quant, device, config, max_gib)
    content = _with_images(engine, prompt, list(image or []), raw, allow_image_urls)
    if raw:
        request = prompt
    else:
        request = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    _stream_answer(engine, request, params, verbose, think, raw_output)


def _with_images(engine, prompt: str, files: list[str], raw: bool, allow_urls: bool = False) -> str | list[dict]:
    """The user turn's content: the prompt, with the --image files (or URLs, with `allow_urls`) and
    (for a vision model) the image paths written in it as image parts. One-line errors: a text-only
    model given --image, an unreadable file or URL, a URL without --allow-image-urls, --raw with images."""
    from .model.vision.fetch import ImageURLPolicy, fetch_image_sync, is_http_url
    from .model.vision.images import ImageInputError, images_in_prompt, read_image_file

    if engine.vision is not None:
        prompt, found = images_in_prompt(prompt)
        files += found
    if not files:
        return prompt
    name = engine.loaded.name or os.path.basename(engine.loaded.source)
    if engine.vision is None:
        raise fail(f"--image: model {name} takes no images (a text-only model); use a vision model such as gemma3")
    if raw:
        raise fail("--image needs the chat template: not with --raw", 2)
    urls = [f for f in files if is_http_url(f)]
    if urls and not allow_urls:
        raise fail(f"--image {urls[0]}: fetching images from http(s) URLs is off; pass --allow-image-urls to "
                   "fetch it", 2)
    policy = ImageURLPolicy(allow=True)
    try:
        images = [{"type": "image", "image": fetch_image_sync(f, policy, f"--image {f}") if is_http_url(f)
                   else read_image_file(f)} for f in files]
    except ImageInputError as e:
        raise fail(str(e)) from None
    return [*images, {"type": "text", "text": prompt}]


def print_plan(model: str | None, quant: str, device: str, ctx: int | None, max_memory: float | None,
               kv_memory: int | None = None, kv_type: str = "auto") -> None:
    """`--dry-run`: the planner's choice and why (with the KV cache --kv-memory asks for); exit 1
    when the model does not fit."""
    from .model.loader import ModelLoadError
    from .planner import PlanError, plan_for

    try:
        plan = plan_for(model, quant, max_memory, ctx, device, kv_memory, kv_type)
    except (PlanError, ModelLoadError, FileNotFoundError) as e:
        raise fail(str(e)) from None
    except ValueError as e:
        raise fail(str(e), 2) from None
    if not plan.fits:
        raise fail(plan.reason)
    typer.echo(plan.describe())


@app.command()
def plan(
    model: ModelArg = None,
    gpus: Annotated[str, typer.Option("--gpus", help="GPUs per node: COUNT or COUNTxKIND (8xh100, 4xl40s, "
                                                     "2x80GiB); COUNT alone: this machine's GPU.")] = "1",
    nodes: Annotated[int, typer.Option("--nodes", help="Nodes of that many GPUs (pipeline parallel across "
                                                       "them, over Ray).")] = 1,
    ctx: Annotated[Optional[int], typer.Option("--ctx", help="Context length (default: the model's).")] = None,
    quant: QuantOpt = "auto",
):
    """How many GPUs a model needs at each precision and context, the tensor/pipeline split, and the exact
    `vllm serve` command (nothing is loaded or downloaded): for models beyond one machine (README: Scaling out)."""
    from .model.loader import ModelLoadError
    from .planner import PlanError, describe_gpu_plan, facts_for, parse_gpus, plan_gpus
    from .registry import resolve_model
    from .vllm_args import VLLMArgsError, VLLMSettings, command, shell_line

    try:
        ref = resolve_model(model)
        fleet = parse_gpus(gpus, nodes, _local_gpu())
        p = plan_gpus(facts_for(ref), fleet, quant, ctx)
    except (PlanError, ModelLoadError, FileNotFoundError) as e:
        raise fail(str(e)) from None
    except ValueError as e:
        raise fail(str(e), 2) from None
    typer.echo(describe_gpu_plan(p))
    s = p.chosen
    if s is None:
        raise typer.Exit(1)
    name = ref.spec.name if ref.spec else ref.name
    settings = VLLMSettings(model=s.variant or ref.repo or str(ref.local_path), served_names=[name],
                            tensor_parallel=s.tp, pipeline_parallel=s.pp, data_parallel=s.dp, max_model_len=p.ctx,
                            precision=s.precision, ray=s.pp > 1)
    try:
        line = shell_line(command(settings))
    except VLLMArgsError as e:
        raise fail(str(e), 2) from None
    ours = ["localllm", "serve", model or name, "--engine", "vllm", "--ctx", str(p.ctx)]
    ours += ["--tensor-parallel", str(s.tp)] if s.tp > 1 else []
    ours += ["--pipeline-parallel", str(s.pp), "--ray-address", "HEAD:6379"] if s.pp > 1 else []
    ours += ["--data-parallel", str(s.dp)] if s.dp > 1 else []
    ours += ["--quant", s.precision] if s.precision not in ("bfloat16", "float16") else []
    lines = ["  command (vLLM alone):", f"    {line}",
             "  with our front (the OpenAI and Ollama APIs on one port, vLLM as its child):",
             f"    {shell_line(ours)}"]
    if s.pp > 1:
        lines += [f"  first, the Ray cluster ({s.pp} nodes): on the head node `ray start --head --port 6379`, on each "
                  "other node `ray start --address HEAD:6379`; run the command on the head node"]
    if s.dp > 1:
        lines.append(f"  (data parallel {s.dp}: {s.dp} replicas of {s.gpus} GPU{'s' if s.gpus > 1 else ''} behind one "
                     "API, vLLM balancing the requests)")
    typer.echo("\n".join(lines))


def _local_gpu() -> tuple[str, int] | None:
    """(name, bytes) of this machine's first GPU, for `plan --gpus N` without a kind."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory


def _stream_answer(engine, request, params, verbose: bool, think: bool | None = None,
                   raw_output: bool = False) -> None:
    """Stream the reply to stdout. A reasoning model's reasoning is left out of it unless `think`
    (then it comes first, between "Thinking..." and "...done thinking." as Ollama prints it). On a
    terminal its control characters are shown, not obeyed, unless `raw_output` (terminal.py)."""
    from .chat import ChatTemplateError
    from .engine.engine import ContextLengthError
    from .model.vision import ImageInputError
    from .reasoning import chat_prompt, reasons
    from .reply_stream import ReplyDelta, ReplyStream
    from .structured import ConstraintError
    from .terminal import output_filter

    out = sys.stdout
    shown_as = output_filter(out, raw_output)
    t0 = time.perf_counter()
    first = last = None
    reply, shown = ReplyStream(), False  # a plain model: the text is the answer as written
    try:
        kind = reasons(engine.tokenizer.chat_template)
        if isinstance(request, list) and kind:
            request, inside = chat_prompt(engine, request, think)
            reply = ReplyStream(reasoning=kind, inside=inside)
        elif think:
            typer.echo("note: this model does not reason (its chat template has no <think> tags); --think "
                       "changes nothing", err=True)

        def write(part: ReplyDelta) -> None:
            nonlocal shown
            if part.reasoning and think:
                out.write(shown_as(part.reasoning if shown else "Thinking...\n" + part.reasoning.lstrip("\n")))
                shown = True
            if part.content:
                if shown:
                    out.write("\n...done thinking.\n\n")
                    shown = False
                out.write(shown_as(part.content))
            out.flush()

        for o in engine.generate(request, params):
            if first is None:
                first = time.perf_counter()
            if o.delta:
                write(reply.feed(o.delta))
            last = o
            if o.finish_reason == "error":  # the --format constraint could not be kept: no answer
                out.write("\n")
                raise fail(f"--format: {o.error}")
        write(reply.finish())
        out.write("\n")
        out.flush()
    except (ContextLengthError, ChatTemplateError, ImageInputError) as e:
        raise fail(str(e)) from None
    except ConstraintError as e:  # found when the schema is compiled for the model's tokenizer
        raise fail(f"invalid value for --format: {e}", 2) from None
    except KeyboardInterrupt:
        out.write("\n")
        raise typer.Exit(130) from None
    except BrokenPipeError:  # `localllm run ... | head -c 20`: the reader is gone
        raise _broken_pipe() from None
    if verbose and last is not None:
        end = time.perf_counter()
        n = len(last.token_ids)
        decode = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        typer.echo(
            f"prompt tokens: {last.num_prompt_tokens} ({last.num_cached_tokens} from prefix cache) | "
            f"completion tokens: {n} | TTFT: {(first - t0) * 1000:.0f} ms | decode: {decode:.1f} tok/s | "
            f"finish: {last.finish_reason}", err=True)
        spec = engine.cache_stats()["speculative"]
        if spec is not None:
            typer.echo(f"speculative: {spec['accepted']}/{spec['proposed']} proposals accepted "
                       f"({spec['acceptance_rate']:.0%}), {spec['mean_accepted_length']:.2f} tokens per verify step",
                       err=True)


def _broken_pipe() -> typer.Exit:
    """Stdout's reader went away: exit quietly with 141 (128 + SIGPIPE), as `yes | head` does.
    Stdout now points at /dev/null so that flushing it at exit cannot fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return typer.Exit(141)


def check_api_key(key: str | None) -> None:
    """An empty key would turn authentication off and a key with spaces around it could never be
    sent (HTTP strips them from header values): both are refused, as is anything but printable
    ASCII (a header carries nothing else reliably)."""
    if key is None:
        return
    if not key:
        raise fail("--api-key is empty: pass a key, or leave the option out to run without authentication", 2)
    if key != key.strip():
        raise fail("--api-key has leading or trailing whitespace, which clients cannot send; remove it", 2)
    if not all(33 <= ord(c) <= 126 or c == " " for c in key):
        raise fail("--api-key must be printable ASCII (letters, digits, punctuation)", 2)


def check_allow_hosts(values: list[str] | None) -> list[str]:
    """--allow-host values: host names or addresses (a port is ignored), or '*'."""
    from .server.host_guard import host_name

    out = []
    for v in values or []:
        if v != "*" and host_name(v) is None:
            raise fail(f"invalid value for --allow-host: {v!r} is not a host name (e.g. mybox.lan, "
                       "llm.example.com, or '*' for any)", 2)
        out.append(v)
    return out


def _keep_alive_seconds(value: str) -> float:
    from .server.ollama import parse_keep_alive
    from .server.openai_schema import APIError

    try:
        return parse_keep_alive(value)
    except APIError as e:
        raise fail(f"invalid value for --keep-alive: {e.message.partition(': ')[2]}", 2) from None


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A loud warning when the server listens beyond loopback without a key."""
    import ipaddress

    if api_key:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"WARNING: listening on {host} without an API key: anyone who can reach this machine can use the "
            "model. Pass --api-key KEY (or set LOCALLLM_API_KEY), or listen on 127.0.0.1.")


def image_url_policy(allow: bool, max_mb: float, timeout_s: float):
    """--allow-image-urls, --image-url-max-mb, --image-url-timeout -> the server's ImageURLPolicy."""
    from .model.vision.fetch import ImageURLPolicy

    if not (math.isfinite(max_mb) and max_mb > 0):
        raise fail(f"invalid value for --image-url-max-mb: must be a positive number of MiB, got {max_mb}", 2)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise fail(f"invalid value for --image-url-timeout: must be a positive number of seconds, got {timeout_s}", 2)
    return ImageURLPolicy(allow=allow, max_bytes=int(max_mb * (1 << 20)), timeout_s=timeout_s)


# ---- serve ----------------------------------------------------------------------------------------
@app.command()
def serve(
    model: ModelArg = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 exposes it to the network).")]
        = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LOCALLLM_API_KEY",
                                                   help="Require 'Authorization: Bearer KEY' (not on /health).")]
        = None,
    cors_origin: Annotated[Optional[list[str]], typer.Option("--cors-origin",
                                                             help="Allowed CORS origin (repeatable; '*' = any).")]
        = None,
    allow_host: Annotated[Optional[list[str]], typer.Option(
        "--allow-host", help="Another Host name to answer to besides localhost and this machine's names "
                             "(repeatable; '*' = any; DNS rebinding protection, see README Security).")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait beyond the running batch; "
                                                               "more get 429.")] = 256,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="Most sequences in one batch.")] = 64,
    parallel: Annotated[int, typer.Option("--parallel", help="Full-length contexts the KV cache holds at once "
                                                             "(shorter requests share them; more wait).")] = 4,
    quant: QuantOpt = "auto",
    device: DeviceOpt = "auto",
    ctx: CtxOpt = None,
    kv_memory: KvMemOpt = None,
    kv_type: KvTypeOpt = "auto",
    act_bits: ActBitsOpt = 16,
    threads: ThreadsOpt = None,
    draft: DraftOpt = None,
    spec_tokens: SpecTokensOpt = 4,
    enforce_eager: EagerOpt = False,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level: "
                                                               + "|".join(LOG_LEVELS))] = "warning",
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", help="Largest request body in MiB; larger ones "
                                                                     "get a 413.")] = 8.0,
    max_memory: MaxMemOpt = None,
    keep_alive: Annotated[str, typer.Option("--keep-alive", help="Without MODEL: how long an idle model stays "
                                                                 "loaded (seconds or 5m, 1h; -1 = forever).")]
        = "5m",
    engine: Annotated[str, typer.Option("--engine", help="localllm (ours) or vllm: vLLM's OpenAI server as a child "
                                                         "process behind our front (README: Scaling out).")]
        = "localllm",
    tensor_parallel: Annotated[int, typer.Option("--tensor-parallel", help="--engine vllm: GPUs per model "
                                                                           "replica within a node.")] = 1,
    pipeline_parallel: Annotated[int, typer.Option("--pipeline-parallel", help="--engine vllm: pipeline stages "
                                                                               "(one per node, with Ray).")] = 1,
    data_parallel: Annotated[int, typer.Option("--data-parallel", help="--engine vllm: replicas of the model "
                                                                       "(each tensor x pipeline GPUs).")] = 1,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", help="--engine vllm: the Ray cluster's "
                                                                             "head (HOST:6379) for several nodes.")]
        = None,
    engine_url: Annotated[Optional[str], typer.Option("--engine-url", help="--engine vllm: attach to a vLLM server "
                                                                           "running there instead of starting one.")]
        = None,
    vllm_bin: Annotated[Optional[str], typer.Option("--vllm-bin", envvar="LOCALLLM_VLLM_BIN",
                                                    help="--engine vllm: the `vllm` executable (default: on PATH).")]
        = None,
    mmproj: MmprojOpt = None,
    allow_image_urls: AllowImageURLsOpt = False,
    image_url_max_mb: Annotated[float, typer.Option("--image-url-max-mb", help="With --allow-image-urls: the "
                                                    "largest image fetched, in MiB (reading stops past it).")]
        = 20.0,
    image_url_timeout: Annotated[float, typer.Option("--image-url-timeout", help="With --allow-image-urls: seconds "
                                                     "one image's fetch may take in all (redirects included).")]
        = 10.0,
):
    """OpenAI- and Ollama-compatible server: /v1/... and /api/... on one port. With MODEL it serves that
    model; without, every local model, loaded on demand (least recently used unloaded to fit --max-memory)."""
    from .registry import resolve_model

    if engine not in ("localllm", "vllm"):
        raise fail(f"invalid value for --engine: {engine!r} is not one of localllm, vllm", 2)
    vllm_flags = {"--tensor-parallel": tensor_parallel != 1, "--pipeline-parallel": pipeline_parallel != 1,
                  "--data-parallel": data_parallel != 1, "--ray-address": ray_address, "--engine-url": engine_url}
    if engine != "vllm" and any(vllm_flags.values()):
        raise fail(f"{next(k for k, v in vllm_flags.items() if v)} needs --engine vllm", 2)

    if not 0 < port < 65536:
        raise fail(f"--port must be in 1..65535, got {port}", 2)
    if max_queue < 0 or max_num_seqs < 1 or parallel < 1:
        raise fail("--max-queue must be >= 0, --max-num-seqs and --parallel >= 1", 2)
    if log_level.lower() not in LOG_LEVELS:
        raise fail(f"invalid value for --log-level: {log_level!r} is not one of {', '.join(LOG_LEVELS)}", 2)
    if not (math.isfinite(max_body_mb) and max_body_mb > 0):
        raise fail(f"invalid value for --max-body-mb: must be a positive number of MiB, got {max_body_mb}", 2)
    check_api_key(api_key)
    hosts = check_allow_hosts(allow_host)
    image_urls = image_url_policy(allow_image_urls, image_url_max_mb, image_url_timeout)
    keep = _keep_alive_seconds(keep_alive)
    mem = max_memory_gib(max_memory, device)
    from .server.app import create_app
    from .server.app import serve as run_server
    from .server.pool import ModelPool, Pinned, PoolConfig
    from .server.state import ServerConfig

    if model is None and engine == "vllm":
        raise fail("--engine vllm needs a MODEL (vLLM serves one model per server)", 2)
    if model is None:
        _serve_all(host, port, api_key, cors_origin, max_queue, max_num_seqs, parallel, quant, device, ctx,
                   kv_memory, threads, draft, spec_tokens, enforce_eager, log_level, max_body_mb, mem, keep, hosts,
                   kv_type, image_urls, act_bits)
    try:  # name mistakes fail now, not after the server started
        ref = resolve_model(model)
    except ValueError as e:
        raise fail(str(e)) from None

    spec = ref.spec
    model_id = spec.name if spec else ref.name
    aliases = [ref.name, *(spec.aliases if spec else []), *([ref.repo] if ref.repo else [])]
    if ref.local_path is not None and spec is None:
        from pathlib import Path

        aliases += [Path(ref.name).name, Path(ref.name).stem]
    if mmproj and model is None:
        raise fail("--mmproj goes with a MODEL (the GGUF whose vision tower it holds)", 2)
    config = engine_config(ctx, kv_memory, kv_type, threads, draft, spec_tokens, enforce_eager, device, act_bits,
                           max_num_seqs=max_num_seqs, parallel=parallel, mmproj=mmproj)
    if engine == "vllm" and act_bits != 16:
        raise fail("--act-bits sets our CPU kernels; --engine vllm runs vLLM's", 2)
    cfg = ServerConfig(api_key, list(cors_origin or []), max_queue, int(max_body_mb * (1 << 20)),
                       bind_host=host, allowed_hosts=hosts, image_urls=image_urls)
    if engine == "vllm":
        from .vllm_args import VLLMArgsError

        try:
            pinned, backend = _vllm_pinned(ref, model_id, aliases, config, quant, device, api_key,
                                           (tensor_parallel, pipeline_parallel, data_parallel), ray_address,
                                           engine_url, vllm_bin, port)
        except VLLMArgsError as e:
            raise fail(str(e), 2) from None
        pool = ModelPool(PoolConfig(config, quant, device, pinned=pinned), lambda message: typer.echo(message, err=True))
        typer.echo(f"localllm serve: {model_id} on http://{host}:{port}/v1 and /api (Ollama), run by vLLM "
                   f"({engine_url or 'starting it'}; /health is 503 until it is ready)"
                   f"{' - API key required' if api_key else ''}", err=True)
        try:
            code = run_server(create_app(cfg, pool), host, port, log_level.lower())
        finally:
            backend.stop()  # whatever ended the server (a failed bind too): the child goes with it
        raise typer.Exit(code)

    def load():
        from .llm import build_engine

        try:
            return build_engine(model, quant, device, config, max_memory=mem)
        finally:
            _startup_done()

    pool = ModelPool(PoolConfig(config, quant, device, pinned=Pinned(model_id, aliases, load)),
                     lambda message: typer.echo(message, err=True))
    typer.echo(f"localllm serve: {model_id} on http://{host}:{port}/v1 (loading the model; /health is 503 "
               f"until it is ready){' - API key required' if api_key else ''}", err=True)
    warning = exposure_warning(host, api_key)
    if warning:
        typer.echo(warning, err=True)
    code = run_server(create_app(cfg, pool), host, port, log_level.lower())
    raise typer.Exit(code)


def _vllm_pinned(ref, model_id: str, aliases: list[str], config, quant: str, device: str, api_key: str | None,
                 parallel: tuple[int, int, int], ray_address: str | None, engine_url: str | None,
                 vllm_bin: str | None, port: int):
    """`serve MODEL --engine vllm`: the pinned model whose load fetches it (our downloader), starts
    vLLM's OpenAI server on a free loopback port (or attaches to --engine-url) and waits until it
    is healthy; and the backend, which the CLI stops whatever ends the server."""
    import shutil
    import socket

    from .paths import cache_home
    from .planner import normalize_quant
    from .server.pool import Pinned
    from .server.vllm_backend import VLLMBackend, VLLMChild
    from .vllm_args import VLLMArgsError, VLLMSettings, check, child_env, launch_argv

    precision = normalize_quant(quant) if quant in ("auto", "bf16", "fp16", "fp32", "int8", "int4", "awq",
                                                    "gptq") else quant
    cpu = device == "cpu" or (device == "auto" and not _has_cuda())
    names = list(dict.fromkeys([model_id, *[a for a in aliases if a and "/" not in a]]))
    settings = VLLMSettings(model=str(ref.local_path or ref.repo), served_names=names, tensor_parallel=parallel[0],
                            pipeline_parallel=parallel[1], data_parallel=parallel[2],
                            max_model_len=config.max_model_len,
                            precision=precision, max_num_seqs=config.max_num_seqs, ray=ray_address is not None,
                            enforce_eager=not config.compile, kv_memory=config.kv_memory_bytes, cpu=cpu,
                            threads=config.num_threads, spec_tokens=config.num_speculative_tokens,
                            draft="ngram" if config.speculative == "ngram" else None)
    check(settings)  # flag mistakes now, before anything is fetched
    child, found = None, None
    if engine_url is None:
        found = vllm_bin or shutil.which("vllm")
        if not found or not os.access(found, os.X_OK):
            raise fail(f"vLLM is not installed here ({vllm_bin or 'no `vllm` on PATH'}): `make setup-vllm` makes "
                       "one (.venv-vllm), then pass --vllm-bin .venv-vllm/bin/vllm; on a GPU machine "
                       "`pip install 'localllm[vllm]'`")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            settings.port = s.getsockname()[1]
        url = f"http://127.0.0.1:{settings.port}"
        log_path = cache_home() / "logs" / f"vllm-{port}.log"
        child = VLLMChild([], child_env(settings, api_key, ray_address), log_path)
    else:
        url = engine_url
    backend = VLLMBackend(url, names[0], api_key, child, lambda m: typer.echo(m, err=True))

    def load():
        from .hub import ensure_local
        from .registry import resolve_model

        try:
            precision = _vllm_precision(ref, settings)
            variant = {"awq": ref.spec.awq, "gptq": ref.spec.gptq}.get(precision) if ref.spec else None
            if precision in ("awq", "gptq") and not variant:
                raise VLLMArgsError(f"{model_id} has no {precision.upper()} variant in models.toml")
            path = ensure_local(resolve_model(variant) if variant else ref)
            if path.is_file():
                path = _vllm_checkpoint(path)
            settings.model = str(path)
            if precision in ("awq", "gptq"):
                settings.precision = "auto"  # the variant's config says how it is quantized
            if config.speculative not in (None, "ngram"):
                draft = ref.spec.draft if config.speculative == "auto" and ref.spec else config.speculative
                if draft is None:
                    raise VLLMArgsError(f"no draft model is paired with {model_id} in models.toml; pass --draft "
                                        "MODEL or --draft ngram")
                settings.draft = str(ensure_local(resolve_model(draft)))
            if child is not None:
                if settings.cpu and not settings.kv_memory:
                    settings.kv_memory = _vllm_cpu_kv(path, settings)
                    child.env = child_env(settings, api_key, ray_address)
                child.argv = launch_argv(settings, found)
            return backend.start(path)
        finally:
            _startup_done()
    return Pinned(model_id, aliases, load, backend=backend), backend


def _vllm_checkpoint(gguf):
    """vLLM serves Hugging Face checkpoints: a GGUF (the embedded model, a download) is written as one
    once (bf16, the file's dequantized weights) under the home's cache, and that is what vLLM loads."""
    from .model.export import hf_checkpoint_of
    from .paths import cache_home
    from .vllm_args import VLLMArgsError

    cache = cache_home() / "vllm-checkpoints"
    typer.echo(f"{gguf.name}: vLLM serves Hugging Face checkpoints; using one written from this GGUF "
               f"(bf16, once) in {cache}", err=True)
    try:
        path, _ = hf_checkpoint_of(gguf, cache)
    except ValueError as e:  # an architecture we cannot write back (Gemma 3, Qwen-VL)
        raise VLLMArgsError(f"{e}; name the model's Hugging Face repo or directory for --engine vllm") from None
    return path


def _vllm_cpu_kv(path, s) -> int | None:
    """The KV budget vLLM's CPU backend gets when --kv-memory is not given: room for a few full-length
    sequences (bf16, at most 4 or --max-num-seqs), as our engine sizes its own. Left to itself it
    reserves 92% of the machine's memory and refuses to start where other programs hold more than 8%.
    None where we cannot read the model's shape: vLLM reads the checkpoint itself and says what is wrong."""
    from .planner import facts_for_path

    try:
        f = facts_for_path(path)
    except Exception:  # noqa: BLE001 - any config we cannot read is vLLM's to judge
        return None
    return f.kv_bytes_per_token * (s.max_model_len or f.max_context) * min(4, s.max_num_seqs or 4)


def _vllm_precision(ref, s) -> str:
    """--quant auto on GPUs: the planner's choice for this node's GPUs at the split asked for (bf16,
    fp8 or the registry's AWQ/GPTQ variant); elsewhere the precision as asked."""
    from .planner import Fleet, PlanError, facts_for, plan_gpus

    local = None if s.cpu or s.precision != "auto" else _local_gpu()
    if local is None:
        return s.precision
    try:
        p = plan_gpus(facts_for(ref), Fleet(s.tensor_parallel * s.data_parallel, local[0], local[1],
                                            s.pipeline_parallel), "auto", s.max_model_len)
    except PlanError:  # size unknown before the download: vLLM takes the checkpoint as it is
        return s.precision
    if p.chosen is None:
        raise PlanError(p.reason)
    s.precision = p.chosen.precision if p.chosen.precision not in ("awq", "gptq") else "auto"
    return p.chosen.precision


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _serve_all(host, port, api_key, cors_origin, max_queue, max_num_seqs, parallel, quant, device, ctx, kv_memory,
               threads, draft, spec_tokens, enforce_eager, log_level, max_body_mb, mem, keep, hosts,
               kv_type, image_urls, act_bits) -> None:
    """`serve` without MODEL: every local model, loaded on demand (server/pool.py)."""
    from .planner import normalize_quant
    from .server.app import create_app
    from .server.app import serve as run_server
    from .server.pool import ModelPool, PoolConfig
    from .server.state import ServerConfig

    try:
        normalize_quant(quant)
    except ValueError as e:
        raise fail(str(e), 2) from None
    if draft is not None:
        raise fail("--draft needs a MODEL: the draft pairing is per model", 2)
    config = engine_config(ctx, kv_memory, kv_type, threads, None, spec_tokens, enforce_eager, device, act_bits,
                           max_num_seqs=max_num_seqs, parallel=parallel)
    def log(message: str) -> None:
        typer.echo(message, err=True)
    pool = ModelPool(PoolConfig(config, quant, device, int(mem * (1 << 30)) if mem else None, keep), log)
    cfg = ServerConfig(api_key, list(cors_origin or []), max_queue, int(max_body_mb * (1 << 20)),
                       bind_host=host, allowed_hosts=hosts, image_urls=image_urls)
    _startup_done()
    typer.echo(f"localllm serve: every local model, on demand, on http://{host}:{port}/v1 and /api (Ollama)"
               f"{' - API key required' if api_key else ''}", err=True)
    warning = exposure_warning(host, api_key)
    if warning:
        typer.echo(warning, err=True)
    raise typer.Exit(run_server(create_app(cfg, pool, log), host, port, log_level.lower()))


# ---- embed ----------------------------------------------------------------------------------------
@app.command()
def embed(
    args: Annotated[Optional[list[str]], typer.Argument(help="[MODEL] TEXT... (no TEXT: one text per line of stdin)",
                                                        show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Embedding model (instead of the first "
                                                                       "argument; default: all-minilm).")] = None,
    dimensions: Annotated[Optional[int], typer.Option("--dimensions", help="Keep the first N components, scaled to "
                                                      "unit length again (Matryoshka).")] = None,
    truncate: Annotated[bool, typer.Option("--truncate/--no-truncate", help="Cut texts longer than the model "
                                           "takes (default), or refuse them.")] = True,
    quant: Annotated[str, typer.Option("--quant", "--precision", help="auto|fp32|bf16 (auto: BERT-family linears in "
                                       "bf16 where the CPU has bf16 dot products, fp32 elsewhere).")] = "auto",
    device: DeviceOpt = "auto",
    threads: ThreadsOpt = None,
):
    """Print one JSON line per text, {"index", "tokens", "embedding"}: `localllm embed "some text"`,
    `localllm embed all-minilm "a" "b"`, or texts piped one per line (blank lines skipped)."""
    import json

    from .engine.embedder import InputTooLong
    from .registry import load_registry, looks_like_model

    words = list(args or [])
    if model is None and words and (looks_like_model(words[0], load_registry()) or _looks_like_path(words[0])):
        model = words.pop(0)
    if threads is not None and threads < 1:
        raise fail(f"invalid value for --threads: must be >= 1 (leave it out for all cores), got {threads}", 2)
    if dimensions is not None and dimensions < 1:
        raise fail(f"invalid value for --dimensions: must be >= 1, got {dimensions}", 2)
    texts = words or ([line for line in read_stdin().splitlines() if line.strip()] if not sys.stdin.isatty() else [])
    if not texts:
        raise fail("no text: pass texts as arguments or pipe them on stdin, one per line "
                   "(e.g. echo hello | localllm embed)", 2)
    if threads:
        import torch

        torch.set_num_threads(threads)
    from .hub import HubError
    from .llm import build_embedder
    from .planner import QUANT_ALIASES

    precision = QUANT_ALIASES.get(quant.lower())
    if precision not in ("auto", "float32", "bfloat16"):
        raise fail(f"invalid value for --quant: an embedding model takes auto, fp32 or bf16, got {quant!r}", 2)
    try:
        embedder = build_embedder(model, device, precision)
    except (ValueError, HubError, OSError) as e:
        raise fail(str(e)) from None
    if dimensions is not None and dimensions > embedder.dimensions:
        raise fail(f"invalid value for --dimensions: the model's vectors have {embedder.dimensions}, got "
                   f"{dimensions}", 2)
    try:
        enc = embedder.tokenize(texts, truncate)
    except InputTooLong as e:
        raise fail(f"text {e.index + 1} is {e.n} tokens; the model takes at most {e.limit} (leave out "
                   "--no-truncate to cut it)") from None
    vectors = embedder.embed(enc, dimensions)
    try:
        for i, (ids, v) in enumerate(zip(enc.ids, vectors)):
            sys.stdout.write(json.dumps({"index": i, "tokens": len(ids), "embedding": v.tolist()}) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise _broken_pipe() from None


# ---- pull / list / show / rm ----------------------------------------------------------------------
def _ref(model: str | None):
    from .registry import resolve_model

    try:
        return resolve_model(model)
    except ValueError as e:
        raise fail(str(e)) from None


@app.command()
def pull(
    model: Annotated[str, typer.Argument(help="Alias from models.toml or hub repo org/name.")],
    quant: Annotated[str, typer.Option("--quant", help="Variant: auto|bf16|awq|gptq|gguf (repos from models.toml).")]
        = "auto",
    revision: Annotated[Optional[str], typer.Option("--revision", help="Branch, tag or commit.")] = None,
):
    """Download a model into the Hugging Face cache (resumable; only what is missing)."""
    from .hub import HubError, variant_for
    from .hub import pull as hub_pull

    ref = _ref(model)
    try:
        v = variant_for(ref, quant, revision)
        result = hub_pull(v.repo, v.revision, v.filename, mmproj=v.mmproj)
    except HubError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        typer.echo("\nError: interrupted; run the same command again to resume the download", err=True)
        raise typer.Exit(130) from None
    typer.echo(result.summary())


@app.command("list")
def list_(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False):
    """Models from models.toml and what is downloaded (embedded, HF cache)."""
    import json

    from .models_cli import format_table, list_models

    rows = list_models()
    typer.echo(json.dumps(rows, indent=2) if as_json else format_table(rows))


@app.command()
def show(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Show this message rendered with the chat "
                                                                   "template, and its token ids.")] = None,
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt for --prompt.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
):
    """What a model is: architecture, size, quantization, chat template, stop tokens (no weights loaded)."""
    import json

    from .chat import ChatTemplateError
    from .hub import HubError
    from .model.loader import ModelLoadError
    from .models_cli import describe, format_show

    try:
        info = describe(model, prompt, system)
    except (HubError, ModelLoadError, ChatTemplateError, ValueError) as e:
        raise fail(str(e)) from None
    typer.echo(json.dumps(info, indent=2, ensure_ascii=False) if as_json else format_show(info))


@app.command()
def rm(model: Annotated[str, typer.Argument(help="Alias, hub repo org/name, or a local model file/directory "
                                                 "(then only what localllm derived from it).")]):
    """Delete a downloaded model (all its variants and revisions) from the Hugging Face cache, with its
    compiled packages and queued builds; for a local file, only those."""
    from .hub import HubError
    from .models_cli import remove

    if not model.strip():  # '' would otherwise resolve to the default model, or read " is not downloaded"
        raise fail("the model name is empty: name a downloaded model (see `localllm list`)", 2)
    try:
        lines = remove(model)
    except (HubError, ValueError) as e:
        raise fail(str(e)) from None
    typer.echo("\n".join(lines))


@app.command()
def ps(
    stop: Annotated[bool, typer.Option("--stop", help="End the background build and drop the queued ones.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
):
    """Background work: the compiled-step builder (one per localllm home) and its queued builds."""
    import json

    from .model import build_queue

    if stop:
        rows = build_queue.status()
        dropped = build_queue.stop_all()
        running = [r for r in rows if r["pid"]]
        typer.echo(f"stopped the builder (pid {running[0]['pid']}); " if running else "no builder was running; ",
                   nl=False)
        typer.echo(f"dropped {dropped} queued build{'s' * (dropped != 1)}")
        return
    rows = build_queue.status()
    typer.echo(json.dumps(rows, indent=2) if as_json else format_ps(rows))


def format_ps(rows: list[dict]) -> str:
    """`localllm ps`'s table: one line per build, running first."""
    if not rows:
        return "no background builds (the compiled step is built by chat, serve and `run --build`)"

    def age(s: float) -> str:
        s = int(s)
        return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"

    head = ("STATE", "PID", "RSS", "AGE", "MODEL")
    body = [(r["state"], str(r["pid"] or "-"), f"{r['rss'] / 2**20:.0f} MiB" if r["rss"] else "-", age(r["age"]),
             r["model"] or "-") for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line[:4], widths)) + "  " + line[4] for line in (head, *body)]
    return "\n".join(lines) + "\n(`localllm ps --stop` ends the build and drops the queue; `localllm rm MODEL` one model's)"


# ---- chat -----------------------------------------------------------------------------------------
@app.command()
def chat(
    model: ModelArg = None,
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", "-n", help="Max new tokens per reply.")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.95,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Same seed, same replies.")] = None,
    history: Annotated[bool, typer.Option("--history/--no-history", help="Keep input history in "
                                                                         "$LOCALLLM_HOME/history.")] = True,
    quant: QuantOpt = "auto",
    device: DeviceOpt = "auto",
    ctx: CtxOpt = None,
    kv_memory: KvMemOpt = None,
    kv_type: KvTypeOpt = "auto",
    act_bits: ActBitsOpt = 16,
    threads: ThreadsOpt = None,
    draft: DraftOpt = None,
    spec_tokens: SpecTokensOpt = 4,
    enforce_eager: EagerOpt = False,
    think: Annotated[Optional[bool], typer.Option(
        "--think/--no-think", help="Reasoning models: show the reasoning dimmed (--think, the default) or ask "
                                   "the model not to reason (--no-think); /set think on|hide|off in the chat.",
        show_default=False)] = None,
    raw_output: Annotated[bool, typer.Option("--raw-output", help="Write replies as is: by default their control "
                                             "characters (escape sequences) are shown as ^[ and the like.")] = False,
    mmproj: MmprojOpt = None,
):
    """Interactive chat (/? for commands). With stdin not a terminal, reads one message per line."""
    from .repl import ChatSession, history_path, run_pipe, run_repl

    sampling_params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    config = engine_config(ctx, kv_memory, kv_type, threads, draft, spec_tokens, enforce_eager, device, act_bits,
                           parallel=1, mmproj=mmproj)
    engine = open_engine(model, quant, device, config)
    name = engine.loaded.name or model or ""
    interactive = sys.stdin.isatty()

    def note(s: str) -> None:
        (sys.stdout if interactive else sys.stderr).write(s)
        (sys.stdout if interactive else sys.stderr).flush()

    session = ChatSession(engine, name, system, note=note, max_tokens=max_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k, seed=seed, think="off" if think is False else "on",
                          escape=not raw_output)
    try:
        if not interactive:
            # bytes: a line that is not UTF-8 costs that line only
            code = run_pipe(session, getattr(sys.stdin, "buffer", sys.stdin))
        else:
            banner = (f"localllm chat: {name} ({engine.loaded.precision}, context {engine.max_model_len}). "
                      '/? for help, """ for multi-line input, Ctrl+D or /bye to exit.')
            code = run_repl(session, history=history_path() if history else None, banner=banner)
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        raise _broken_pipe() from None
    raise typer.Exit(code)


@app.command()
def bench(
    model: ModelArg = None,
    quant: QuantOpt = "auto",
    runs: Annotated[int, typer.Option(help="Runs per figure (the median is reported).")] = 5,
    quick: Annotated[bool, typer.Option("--quick", help="CI-sized: short prompts, few runs.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    threads: ThreadsOpt = None,
    enforce_eager: EagerOpt = False,
    compile: CompileOpt = False,
):
    """Measure prefill, decode, batching, prefix-cache and speculative speed on this machine."""
    import json

    from .bench import BenchConfig, render, run_bench

    if runs < 1:
        raise fail("invalid value for --runs: must be >= 1", 2)
    if threads is not None and threads < 1:
        raise fail(f"invalid value for --threads: must be >= 1 (leave it out for all cores), got {threads}", 2)
    cfg = BenchConfig.quick() if quick else BenchConfig(runs=runs)
    if threads:
        import torch

        torch.set_num_threads(threads)
    result = run_bench(model, quant, cfg, threads, log=lambda m: typer.echo(m, err=True), eager=enforce_eager)
    typer.echo(json.dumps(result, indent=2) if as_json else render(result))


@app.command()
def quantize(
    model: ModelArg = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Directory to write the quantized "
                                                                         "checkpoint to.")] = None,
    method: Annotated[str, typer.Option("--method", help="awq | gptq | rtn (rtn writes the GPTQ format).")] = "awq",
    bits: Annotated[int, typer.Option("--bits", help="Only 4.")] = 4,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="32 | 64 | 128 (default: 128, or the "
                                                                          "largest that divides every input dim).")]
        = None,
    calib_file: Annotated[Optional[str], typer.Option("--calib-file", help="UTF-8 text file for calibration "
                                                                          "(default: built-in English paragraphs).")]
        = None,
    num_samples: Annotated[int, typer.Option("--num-samples", help="Calibration sequences (at most).")] = 128,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per calibration sequence.")] = 256,
    act_order: Annotated[Optional[bool], typer.Option("--act-order/--no-act-order", help="GPTQ: quantize columns "
                                                      "in order of decreasing activation (desc_act; default on).")]
        = None,
    sym: Annotated[Optional[bool], typer.Option("--sym/--asym", help="GPTQ/RTN: symmetric (zero point 8) or "
                                                                     "asymmetric (default).")] = None,
):
    """Quantize a float model to a standard 4-bit AWQ or GPTQ checkpoint (loadable by vLLM, transformers)."""
    from .hub import HubError, ensure_local
    from .model.loader import ModelLoadError
    from .quant.quantize import QuantizeError, quantize_model

    if output is None:
        raise fail("missing --output DIR (where to write the quantized checkpoint)", 2)
    if num_samples < 1 or seq_len < 16:
        raise fail("--num-samples must be >= 1 and --seq-len >= 16", 2)
    texts = None
    if calib_file is not None:
        try:
            texts = [t for t in open(calib_file, encoding="utf-8").read().split("\n\n") if t.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise fail(f"cannot read --calib-file {calib_file}: {e}") from None
    ref = _ref(model)
    try:
        src = ensure_local(ref)
        result = quantize_model(src, output, method.lower(), bits, group_size, texts, num_samples, seq_len,
                                act_order, sym, progress=lambda m: typer.echo(m, err=True))
    except QuantizeError as e:
        raise fail(str(e), 2) from None
    except (ModelLoadError, HubError) as e:
        raise fail(str(e)) from None
    calib = f", {result.calib_tokens} calibration tokens" if result.calib_tokens else ""
    typer.echo(f"wrote {result.path} ({method.upper()} 4-bit, group {result.group_size}{calib}, "
               f"{result.seconds:.0f} s)")


@app.callback()
def _root() -> None:
    """Run large language models locally."""


# Startup (importing torch, the tokenizer's 10^5 strings, the model) allocates much and frees
# little, yet the cyclic GC rescans all of it again and again: ~0.15 s of a cold start. The
# commands that load a model turn it off until their engine is built.
_LOADING_COMMANDS = ("run", "chat", "serve", "embed")


def _startup_done() -> None:
    """The startup objects go to the GC's permanent generation (never scanned again); collection
    resumes."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def main() -> None:
    for i, arg in enumerate(sys.argv[1:], 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:  # Python decodes argv with surrogateescape: raw bytes show up here
            typer.echo(f"Error: argument {i} is not UTF-8 text (byte 0x{ord(arg[e.start]) & 0xff:02x}): "
                       f"{arg.encode('utf-8', 'backslashreplace').decode()}", err=True)
            sys.exit(2)
    if len(sys.argv) > 1 and sys.argv[1] in _LOADING_COMMANDS:
        gc.disable()
    app()


if __name__ == "__main__":
    main()
