"""The daemon's own work on payload files: deleting discarded ones (through payload_gc),
measuring the root when asked, and the running account of the bytes on disk (`account`,
kept in the run's `ledger`)."""
