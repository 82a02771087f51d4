"""What the daemon tells people while it runs: the stall warning, the progress line, the
run snapshot both read, and `progress.json`."""
