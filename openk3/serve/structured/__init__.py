"""Structured output (docs/serving.md "Structured output"): spec.py (what a request asks, and its compiled Grammar),
vocab.py (a tokenizer's vocabulary for the grammar engine), compiler.py (compiling specs once, cached), matchers.py (the
per-request masks the sampler applies). The grammar of an enforced tool call is built by api/tool_choice.py."""
