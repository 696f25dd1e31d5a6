"""Functional twins for hand-written code: ``torch.nn.functional`` calls on domain-sharded data.

Each function takes local tensors (this rank's slice along the sharded dims) plus the mesh and the
sharded dims, and returns exactly this rank's slice of what the serial function returns on the
gathered input, values and gradients. Inside a domain region the region guard routes the plain
``torch`` / ``F`` calls here by itself.
"""

__all__: list = []
