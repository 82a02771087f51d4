"""Talking to the inference servers: the HTTP clients, the generate and weight-update
requests, and which servers are usable."""
