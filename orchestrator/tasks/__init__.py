"""Real tasks: the user's datasets, tokenizer and chat template, reward functions, and the
environments built from them."""
