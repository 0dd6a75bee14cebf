"""The distribution layer: contexts, clusters, partitioners, placement and the strategy."""
