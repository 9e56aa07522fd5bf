"""The HTTP wing of `localllm serve`: one FastAPI app (app.py) answering OpenAI's /v1 routes (chat
completions, and the Responses API in responses.py), Anthropic's /v1/messages (anthropic.py) and
Ollama's /api routes (ollama.py) on one port, over the model pool (pool.py: every local model on
demand, or one pinned model). generation.py turns a request into engine requests and streams
their outputs; openai_schema.py and output_format.py are the wire formats and constraint fields,
tool_calls.py the calls parsed out of replies (generic_tools.py: the format of models whose
template takes no tools), metrics.py the Prometheus text, host_guard.py the
Host/Origin check. Nothing outside this package imports it but the CLI's `serve`."""
