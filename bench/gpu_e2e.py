"""End-to-end decode on a CUDA GPU: the localllm engine on its Triton kernels, with and without
CUDA graphs, against transformers on the same checkpoint (step 3 of bench/gpu_check.sh).

The checkpoints are random-weight Llama models of real shapes (SmolLM2-135M and a 1B Llama-3.2
shape) written on the spot with a word-level tokenizer, so nothing has to be downloaded; speed
does not depend on the weights' values. Checks first, each a failure (exit 1) if it does not hold:
  - our fp32 greedy tokens equal transformers' fp32 greedy tokens (135M shape, 32 tokens);
  - for every timed run, CUDA-graph replay gives exactly the eager run's tokens.
Then decode tok/s at batch 1/8/32 for bf16 and int4 (RTN on load), eager vs graphs, next to
transformers' bf16 `generate` at the same batch, and the weight bandwidth reached at batch 1.

  python bench/gpu_e2e.py [--models smollm2-135m,llama-1b] [--tokens 128] [--json FILE]
  python bench/gpu_e2e.py --dry-run   # CPU: tiny shapes, kernels in Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}


def write_checkpoint(out: Path, shape: dict, device: str, seed: int = 0) -> Path:
    """config.json + model.safetensors (bf16, random) + a word-level tokenizer.json."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    V, H, F, L = shape["vocab_size"], shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kvh, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator(device=device).manual_seed(seed)
    dims = {"q_proj": (heads * hd, H), "k_proj": (kvh * hd, H), "v_proj": (kvh * hd, H), "o_proj": (H, heads * hd),
            "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
    # unit-gain projections keep the residual stream O(sqrt(layers)); std-1 embeddings through the
    # tied head give peaked logits, so greedy comparisons are not decided by near-ties
    tensors = {"model.embed_tokens.weight": torch.randn(V, H, generator=g, device=device),
               "model.norm.weight": torch.ones(H, device=device)}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(H, device=device)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(H, device=device)
        for name, (n, k) in dims.items():
            part = "self_attn." if name[0] in "qkvo" else "mlp."
            tensors[p + part + name + ".weight"] = torch.randn(n, k, generator=g, device=device) / k ** 0.5
    save_file({k: v.to(torch.bfloat16).cpu().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2",
                                                           "add_bos_token": False}))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct weight tensors (a tied embedding/head counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def ours_decode(engine, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    """(decode tok/s, output ids): all prompts prefilled in the first step(s), then timed decode."""
    from localllm.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    sync(device)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    sync(device)
    dt = time.perf_counter() - t0
    return len(prompts) * (new_tokens - 1) / dt, [done[i] for i in ids]


def hf_decode(hf, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    """transformers generate (greedy, KV cache): decode tok/s from two runs' difference."""
    x = torch.tensor(prompts, device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def gen(n):
        sync(device)
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t, out

    t1, _ = gen(1)
    tn, out = gen(new_tokens)
    return len(prompts) * (new_tokens - 1) / max(tn - t1, 1e-9), out[:, x.shape[1]:].tolist()


def engine_smoke(loaded, greedy: list[int], prompt: list[int], n: int, engine) -> list[str]:
    """The rest of the engine on the device: seeded sampling with penalties and logprobs (same
    seed, same tokens), and n-gram speculation (verify extends, rollback) equal to plain greedy."""
    from localllm.sampling import SamplingParams

    bad = []
    sp = SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1, seed=7,
                        logprobs=2, ignore_eos=True)
    runs = []
    for _ in range(2):
        eng, _ = engine(loaded, True)
        runs.append(list(eng.generate(prompt, sp))[-1].token_ids)
    print(f"seeded sampling twice: {'same' if runs[0] == runs[1] else 'DIFFERENT'} ({len(runs[0])} tokens)", flush=True)
    if runs[0] != runs[1] or len(runs[0]) != n:
        bad.append("seeded sampling is not reproducible")
    # a prompt that repeats itself gives the n-gram proposer something to propose
    rep = (prompt[:16] * 4)[:len(prompt)]
    plain_eng, _ = engine(loaded, True)
    plain = list(plain_eng.generate(rep, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))[-1].token_ids
    eng, _ = engine(loaded, True, speculative="ngram")
    spec = list(eng.generate(rep, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))[-1].token_ids
    st = eng.cache_stats().get("speculative", {})
    print(f"n-gram speculation vs plain greedy: {'equal' if spec == plain else 'DIFFER'} ({st})", flush=True)
    if spec != plain:
        bad.append("n-gram speculative greedy differs from plain greedy")
    if eng.block_manager.num_used_blocks:
        bad.append("KV blocks leaked after speculation")
    return bad


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,llama-1b")
    ap.add_argument("--precisions", default="bfloat16,int4")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per figure (median)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--json", default=None, help="write all figures here")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny model, interpreter, graphs not captured")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    if args.dry_run:
        if not cuda:
            os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        args.models, args.batches, args.tokens, args.prompt_len, args.runs = "tiny", "1,3", 6, 20, 1
        args.precisions = "float32"
    device = "cuda" if cuda else "cpu"
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.model.loader import load_model

    batches = [int(b) for b in args.batches.split(",")]
    failures: list[str] = []
    rows: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="localllm-e2e-"))

    def load(ckpt: Path, precision: str):
        loaded = load_model(ckpt, precision, device)
        loaded.model.use_attention("triton")  # already so on CUDA; the dry run interprets the kernels
        return loaded

    def engine(loaded, graphs: bool, **kw):
        cfg = EngineConfig(max_model_len=min(1024, args.prompt_len + args.tokens + 64), max_num_seqs=max(batches),
                           max_num_batched_tokens=max(2048, max(batches) * args.prompt_len), compile=graphs,
                           enable_prefix_caching=False, **kw)
        t = time.perf_counter()
        eng = LLMEngine(loaded, cfg)
        return eng, time.perf_counter() - t

    for name in args.models.split(","):
        shape = SHAPES[name]
        t = time.perf_counter()
        ckpt = write_checkpoint(tmp / name, shape, device)
        print(f"== {name}: checkpoint written in {time.perf_counter() - t:.1f} s", flush=True)
        V = shape["vocab_size"]

        hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).eval()
        if name in ("smollm2-135m", "tiny") and hf is not None:
            # correctness: fp32 greedy tokens, ours (kernels, graphs) vs transformers
            loaded = load(ckpt, "float32")
            eng, _ = engine(loaded, True)
            prompt = random_prompts(1, args.prompt_len, V, seed=1)
            n = min(32, args.tokens)
            _, (ours,) = ours_decode(eng, prompt, n, device)
            _, (ref,) = hf_decode(hf, prompt, n, device)
            first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
            msg = f"fp32 greedy vs transformers fp32 ({n} tokens): " + ("equal" if first is None
                                                                          else f"DIFFER from token {first}")
            print(msg, flush=True)
            if first is not None:
                failures.append(f"{name}: {msg}")
            failures += engine_smoke(loaded, ours, prompt[0], n, engine)
            del eng, loaded
        if hf is not None:
            hf = hf.to(torch.bfloat16)

        for precision in args.precisions.split(","):
            loaded = load(ckpt, precision)
            wbytes = weight_bytes(loaded.model)
            engines = {}
            for graphs in (False, True):
                engines[graphs], secs = engine(loaded, graphs)
                if graphs:
                    print(f"   {name} {precision}: graphs captured in {secs:.1f} s "
                          f"(buckets {engines[True].runner.captured.buckets if engines[True].runner.captured else '-'})",
                          flush=True)
            for B in batches:
                row = {"model": name, "precision": precision, "batch": B, "weight_bytes": wbytes}
                outs = {}
                for graphs in (False, True):
                    speeds = []
                    for r in range(args.runs):
                        prompts = random_prompts(B, args.prompt_len, V, seed=100 * B + r)
                        tps, toks = ours_decode(engines[graphs], prompts, args.tokens, device)
                        speeds.append(tps)
                        outs.setdefault(r, {})[graphs] = toks
                    row["graphs" if graphs else "eager"] = statistics.median(speeds)
                same = all(o[False] == o[True] for o in outs.values())
                row["graphs_equal_eager"] = same
                if not same:
                    failures.append(f"{name} {precision} batch {B}: graph replay tokens differ from eager")
                if hf is not None and precision == "bfloat16":
                    prompts = random_prompts(B, args.prompt_len, V, seed=100 * B)
                    row["transformers"] = statistics.median(hf_decode(hf, prompts, args.tokens, device)[0]
                                                            for _ in range(max(1, args.runs - 1)))
                step_s = B / row["graphs"]
                row["gbps_b1"] = wbytes / step_s / 1e9 if B == 1 else None
                rows.append(row)
                print(f"   {name} {precision} B={B}: eager {row['eager']:.0f}, graphs {row['graphs']:.0f} tok/s"
                      + (f", transformers {row['transformers']:.0f}" if "transformers" in row else "")
                      + ("" if same else "  TOKENS DIFFER"), flush=True)
            del engines, loaded
            if cuda:
                torch.cuda.empty_cache()
        del hf

    title = torch.cuda.get_device_name() if cuda else "CPU interpreter (dry run)"
    print(f"\n## GPU end-to-end decode, {title}\n")
    print(f"{args.tokens} new tokens after a {args.prompt_len}-token prompt per sequence; decode tok/s summed over the "
          f"batch, median of {args.runs}; transformers = bf16 `generate` on the same checkpoint.\n")
    print("| model | precision | batch | eager tok/s | CUDA graphs tok/s | graphs/eager | transformers tok/s "
          "| ours/transformers | weights GB/s (B=1) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf_col = f"{r['transformers']:.0f}" if "transformers" in r else "-"
        ratio = f"{r['graphs'] / r['transformers']:.2f}x" if "transformers" in r else "-"
        bw = f"{r['gbps_b1']:.0f}" if r["gbps_b1"] else "-"
        print(f"| {r['model']} | {r['precision']} | {r['batch']} | {r['eager']:.0f} | {r['graphs']:.0f} | "
              f"{r['graphs'] / r['eager']:.2f}x | {hf_col} | {ratio} | {bw} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": title, "rows": rows, "failures": failures}, indent=1))
    if failures:
        print("\nFAILED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
