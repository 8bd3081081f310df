"""The OpenAI/vLLM-compatible HTTP API: routes, request validation, chat formats and tool calls, streamed replies (HTTP only; openk3/launch builds the server)."""
