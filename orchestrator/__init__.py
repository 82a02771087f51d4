"""rollout-orchestrator: the asynchronous RL rollout daemon."""
