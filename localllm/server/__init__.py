"""The HTTP wing of `localllm serve`: one FastAPI app on one port, over the model pool. Nothing
outside this package imports it but the CLI's `serve`.

- app.py: the app (middlewares, error shapes, /health and /metrics) and `serve`; it mounts one
  APIRouter per API, each made by its module's `router(state)`.
- state.py: ServerConfig and ServerState, the context every router is made with.
- openai_routes.py: OpenAI's /v1 routes (+ vLLM's /tokenize, /detokenize); openai_schema.py their
  wire format, output_format.py the structured-output fields, tools.py the tools fields.
- ollama.py: Ollama's /api routes and wire format.
- pool.py: the models served (every local model on demand, or a pool of one pinned model: both
  run the same code); generation.py: ServedModel (a loaded model as requests use it), the engine
  loop thread, the admission count and one request's engine requests (Generation).
- metrics.py: the Prometheus text; host_guard.py: the Host/Origin check.

Replies are split into reasoning, content and tool calls below the server (localllm/reply_stream.py);
the API modules only spell the parts in their wire formats.
"""
