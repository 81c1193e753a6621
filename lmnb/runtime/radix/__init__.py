"""RadixAttention: the radix-tree prefix cache over KV slots."""
