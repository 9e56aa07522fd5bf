"""The HTTP wing of `localllm serve`: one FastAPI app on one port, over the model pool. Nothing
outside this package imports it but the CLI's `serve`.

- app.py: the app (middlewares, error shapes, /health and /metrics) and `serve`; it mounts one
  APIRouter per API, each made by its module's `router(state)`.
- state.py: ServerConfig and ServerState, the context every router is made with.
- openai_routes.py: OpenAI's /v1 routes (+ vLLM's /tokenize, /detokenize) and start_chat, the one
  way every chat-shaped API reaches the engine; openai_schema.py their wire format,
  output_format.py the structured-output fields, tools.py the tools fields, generic_tools.py the
  tools told to models whose template takes none (the generic JSON format).
- responses.py: OpenAI's Responses API (/v1/responses); anthropic.py: Anthropic's Messages API
  (/v1/messages, count_tokens, its error shape): both translate to a chat request for start_chat.
- ollama.py: Ollama's /api routes and wire format.
- infill.py: fill-in-the-middle (llama.cpp's /infill, and the `suffix` hook of /v1/completions and
  /api/generate).
- pool.py: the models served (every local model on demand, or a pool of one pinned model: both
  run the same code); generation.py: ServedModel (a loaded model as requests use it), the engine
  loop thread, the admission count and one request's engine requests (Generation).
- metrics.py: the Prometheus text; host_guard.py: the Host/Origin check.

Replies are split into reasoning, content and tool calls below the server (localllm/reply_stream.py);
the API modules only spell the parts in their wire formats.
"""
