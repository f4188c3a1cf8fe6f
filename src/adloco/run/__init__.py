"""A whole ``adloco train`` run: the round loop as named parts, its directory, lock, records, preflight checks,
stopping on a scheduler's signal, and the ``adloco runs`` listing."""
