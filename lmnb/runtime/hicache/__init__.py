"""The radix cache's lower tiers (`enable_hierarchical_cache`): KV evicted from the device kept in
host memory (`host_pool`), pages of KV on disk across restarts (`disk`), the model identity that
names those pages (`identity`), and the factory of the tiered cache (`factory`). The tree that
knows where each node's KV lives is `radix/tiered.py`."""
