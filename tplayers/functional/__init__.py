"""Functional twins for hand-written code: ``torch.nn.functional`` calls on domain-sharded data.

Each function takes local tensors (this rank's slice along the sharded dims) plus the mesh and the
sharded dims, and returns exactly this rank's slice of what the serial function returns on the
gathered input, values and gradients. Inside a domain region the region guard routes the plain
``torch`` / ``F`` calls here by itself.

- :func:`scaled_dot_product_attention`: ``F.scaled_dot_product_attention`` over tokens sharded on
  all ranks of a mesh (ring or all-gather of K/V, online-softmax merge); :func:`token_positions`
  gives the global indices of the local tokens of a sharded image for causal / masked attention.
- :func:`multi_head_attention_forward`: ``F.multi_head_attention_forward`` with the sequence sharded.
"""

from tplayers.functional.attention import scaled_dot_product_attention, token_positions
from tplayers.functional.attention_mha import multi_head_attention_forward

__all__ = ["scaled_dot_product_attention", "token_positions", "multi_head_attention_forward"]
