"""Training the demo model on CPU: its corpus and tokenizer, router balancing, MXFP4 quantisation-aware training, `openk3 train`."""
