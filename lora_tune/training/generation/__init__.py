"""What generates GRPO's completions: transformers' `generate` on the training engine, or vLLM (a
server the adapter is handed to each generation batch, or an engine in this process). `registry`
picks one from the options; each module is one way, behind the `Generator` protocol."""
