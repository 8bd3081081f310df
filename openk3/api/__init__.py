"""The OpenAI/vLLM-compatible HTTP API: routes, request checks, chat formats, tool calls and streamed replies (HTTP only).

openk3/launch builds the server and the engine behind it."""
