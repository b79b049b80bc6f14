"""A checkpoint directory's bookkeeping: committed steps, retention, the lease, the tiers."""
