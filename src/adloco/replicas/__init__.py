"""``adloco train`` as fault-tolerant replicas over torchft: one replica process (or a sharded one) and the
Lighthouse."""
