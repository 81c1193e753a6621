"""Beyond one device: tensor-parallel workers, data-parallel replicas behind a cache-aware
router (meta radix tree), Ray for several machines."""
