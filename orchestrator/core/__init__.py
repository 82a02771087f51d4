"""The pure domain of the daemon: no I/O, no event loop.

Turns, rollouts and samples; scoring and the train sink with its discards; reference
counts of payload files; the staleness rule; the toy environments. Everything here is
decided from values alone, so it is tested without files, sockets or trio.
"""
