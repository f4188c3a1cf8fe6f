"""Transport: how workers' tensors and scalars are combined, and what that costs on the wire.

``base`` is the Communicator protocol, ``local`` the in-process world, ``distributed`` torch.distributed and
``replicas`` torchft's Manager; ``launcher`` reads what torchrun says without importing torch (the package imports
nothing itself, so the command line can check a job's world before torch loads)."""
