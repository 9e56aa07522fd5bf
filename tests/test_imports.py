"""The package's import graph: no module imports itself back through others (no cycles, counting the
imports inside functions too), and the layers point one way: the quantizer command (localllm.quant)
sits above the model and the engine, which never import it."""

import ast
from pathlib import Path

import localllm

ROOT = Path(localllm.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its body, functions included)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                # `from pkg import name`: name may be a submodule
                targets = [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in files else base_name
                           for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:  # `import a.b.c` of a name inside a module -> the module
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("localllm"):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_relative_and_function_level_imports():
    g = import_graph()
    assert "localllm.model.llama" in g["localllm.model.loader"]  # from .llama import ... (top level)
    assert "localllm.engine.engine" in g["localllm.quant.quantize"]  # inside perplexity()
    assert "localllm.model.loader" in g["localllm.cli"]  # inside the commands


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_model_and_engine_never_import_the_quantizer():
    bad = {m: sorted(t for t in ts if t.startswith("localllm.quant")) for m, ts in import_graph().items()
           if m.startswith(("localllm.model", "localllm.engine"))}
    assert {m: ts for m, ts in bad.items() if ts} == {}
    assert sorted(p.name for p in (ROOT / "quant").glob("*.py")) == ["__init__.py", "calib_text.py", "quantize.py"]


FRONT_ENDS = ("localllm.cli", "localllm.repl", "localllm.server", "localllm.models_cli", "localllm.bench")


def test_engine_and_model_never_import_a_front_end():
    """Data flows one way: request -> engine -> model. The engine and the model know nothing of the
    CLI, the REPL or the HTTP server that call them."""
    bad = {m: sorted(t for t in ts if t.startswith(FRONT_ENDS)) for m, ts in import_graph().items()
           if m.startswith(("localllm.model", "localllm.engine"))}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_only_the_cli_imports_the_server_wing():
    users = {m for m, ts in import_graph().items() if not m.startswith("localllm.server")
             and any(t.startswith("localllm.server") for t in ts)}
    assert users == {"localllm.cli"}


def test_kernels_import_nothing_from_localllm():
    kernels = Path(__file__).resolve().parent.parent / "localllm_kernels"
    bad = []
    for path in kernels.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.name}: {n}" for n in names if n == "localllm" or n.startswith("localllm.")]
    assert bad == []


def test_model_never_imports_the_engine():
    """The engine drives the model; the model knows nothing of the engine above it."""
    bad = {m: sorted(t for t in ts if t.startswith("localllm.engine")) for m, ts in import_graph().items()
           if m.startswith("localllm.model")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_config_imports_nothing_it_configures():
    """The config objects are passed down to the engine and the model, never the other way."""
    assert {t for t in import_graph()["localllm.config"] if t.startswith(("localllm.model", "localllm.engine"))} == set()


def test_loading_is_split_by_responsibility():
    """The engine takes the loaded model's handle, not the loader; the weights readers and the
    conversion cache sit below the loading policy (loader) that uses them."""
    g = import_graph()
    engine_imports = set().union(*(ts for m, ts in g.items() if m.startswith("localllm.engine")))
    assert "localllm.model.handle" in g["localllm.engine.engine"] and "localllm.model.loader" not in engine_imports
    below = ("localllm.model.gguf_weights", "localllm.model.hf_weights", "localllm.model.weights",
             "localllm.model.convert_cache", "localllm.model.handle")
    assert {m: "localllm.model.loader" for m in below if "localllm.model.loader" in g[m]} == {}
    assert set(below[:4]) <= g["localllm.model.loader"]


def test_the_runtime_step_asks_the_package_cache_never_the_builder():
    """The engine's compiled step (engine/compiled_step) loads packages through the package cache
    (model/compiled), which queues missing ones; the background builder (model/build_queue)
    stays stdlib-only, so `localllm ps`, `rm` and the builder process never import torch."""
    g = import_graph()
    assert "localllm.model.compiled" in g["localllm.engine.compiled_step"]
    assert "localllm.model.build_queue" not in g["localllm.engine.compiled_step"]
    assert g["localllm.model.build_queue"] == {"localllm.paths"}


def imported_names(name: str) -> set[str]:
    """The package modules that import `name` by name (`from x import name`), anywhere in their body."""
    out = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
                out.add(module_name(path))
    return out


def test_replies_are_split_in_one_place():
    """Every front end reads a reply through reply_stream.ReplyStream, which sits below them all: the
    reasoning and tool-call splitters it composes are imported nowhere else."""
    assert imported_names("ThinkSplitter") | imported_names("ToolCallStream") == {"localllm.reply_stream"}
    g = import_graph()
    for low in ("localllm.reply_stream", "localllm.tool_calls", "localllm.generic_calls", "localllm.reasoning"):
        assert sorted(t for t in g[low] if t.startswith(FRONT_ENDS)) == [], low
    users = {m for m, ts in g.items() if "localllm.reply_stream" in ts}
    assert {"localllm.cli", "localllm.repl", "localllm.server.ollama"} <= users
    assert any(m.startswith("localllm.server.") and m != "localllm.server.ollama" for m in users)  # OpenAI's


def test_every_package_and_kernel_source_is_in_the_distribution():
    """pyproject's explicit package list names every folder with an __init__.py (a wheel install
    lacked localllm.model.vision while the editable one hid it), and its package data covers every
    C++ source and header the kernels compile from and every template."""
    import fnmatch

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib

    repo = ROOT.parent
    conf = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(repo).parts) for top in ("localllm", "localllm_kernels")
             for p in (repo / top).rglob("__init__.py")}
    assert set(conf["packages"]) == found
    for pkg, globs in conf["package-data"].items():
        base = repo / pkg
        data = {str(p.relative_to(base)) for sub in {g.split("/")[0] for g in globs}
                for p in (base / sub).iterdir() if p.suffix not in (".pyc",) and p.is_file()}
        assert data and {f for f in data if any(fnmatch.fnmatch(f, g) for g in globs)} == data, (pkg, data)
