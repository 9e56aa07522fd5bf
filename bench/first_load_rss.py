"""Peak RSS of one process that loads a GGUF and decodes after a 2,000-token prompt: localllm
(eager, as a first contact runs) or llama.cpp (llama-cpp-python, n_ctx 4096 as bench/compare.py),
with how many bytes our decoder layers hold against the file's matrices.

    LOCALLLM_HOME=<empty> python bench/first_load_rss.py {localllm|llama.cpp} FILE [--threads 1]

Give a fresh copy of the file and an empty LOCALLLM_HOME for a first contact (the conversion
included). One line of JSON: peak RSS after the load and after the decode (MB, ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import resource


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", choices=("localllm", "llama.cpp"))
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    ids = (list(range(100, 600)) * 4)[:2000]
    out: dict = {"engine": args.engine}
    if args.engine == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(args.model, n_ctx=4096, n_batch=2048, n_ubatch=512, n_threads=args.threads,
                    n_threads_batch=args.threads, verbose=False)
        out["load_peak_mb"] = peak_mb()
        llm.eval(ids)
        for _ in range(8):
            llm.eval([5])
    else:
        import torch

        torch.set_num_threads(args.threads)
        from localllm.config import EngineConfig
        from localllm.engine.engine import LLMEngine
        from localllm.model.gguf import read_gguf
        from localllm.model.loader import load_model
        from localllm.sampling import SamplingParams

        loaded = load_model(args.model, "auto")
        out["load_peak_mb"] = peak_mb()
        out["layers_mb"] = sum(t.numel() * t.element_size() for layer in loaded.model.layers
                               for t in (*layer.parameters(), *layer.buffers())) / 1e6
        out["file_matrices_mb"] = sum(t.nbytes for n, t in read_gguf(args.model).tensors.items()
                                      if n.startswith("blk.") and len(t.shape) == 2) / 1e6
        eng = LLMEngine(loaded, EngineConfig(max_model_len=4096, enable_prefix_caching=False, parallel=1,
                                             num_threads=args.threads, compile=False))
        for _ in eng.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)):
            pass
    out["peak_mb"] = peak_mb()
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
