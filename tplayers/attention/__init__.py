"""Full attention over domain- or sequence-sharded tokens (exported as :mod:`tplayers.functional`).

* :mod:`~tplayers.attention.sdpa` - ``scaled_dot_product_attention`` and ``token_positions``;
* :mod:`~tplayers.attention.mha` - ``multi_head_attention_forward`` with the sequence sharded;
* :mod:`~tplayers.attention.plan`, :mod:`~tplayers.attention.ring`, :mod:`~tplayers.attention.blocks`,
  :mod:`~tplayers.attention.weights` - the plan (ring or all-gather), the ring, the blockwise
  online-softmax forward / backward, and attention weights when they are asked for.

Below the layers (``ContextParallelAttention`` and ``DistributedMultiheadAttention`` wrap it). See
``docs/full-attention.md``.
"""
