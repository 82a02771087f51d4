"""payload_gc: delete versioned payload directories below a staleness bound, safely."""
