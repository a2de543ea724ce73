"""Training the project's models: the task suite, its tokenizer, cache-conditioned fine-tuning and evaluation."""
