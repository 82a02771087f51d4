"""Environments written for verifiers (`[[env]] verifiers = "ID"`), run unmodified.

verifiers (the `verifiers` extra, pinned) is asyncio and slow to import, so it never runs
in the daemon: `worker.py` is a process of its own that loads the environment once and
serves its tasks and episodes over a Unix socket (newline-delimited JSON), and
`environment.py` is the daemon's side of it, an `Environment` whose episodes drive
themselves (`DrivenEpisode`): the environment calls the model at the daemon's loopback
endpoint for the rollout and reports the reward and the tokens it sampled. `traces.py`
reads what the daemon needs off a verifiers episode; `protocol.py` holds what both
sides share. docs/operations.md § "Verifiers environments" says how to use it.

Importing this package imports nothing of verifiers, trio or the daemon.
"""
