"""Training on CPU: the demo model's corpora and tokenizer, router balancing, MXFP4 QAT, `openk3 train`, and multi-teacher distillation (`openk3 distill`)."""
