"""Beyond one device: tensor-parallel process groups and workers (`group`, `step`,
`tp_worker`), data-parallel replicas behind a cache-aware router (meta radix tree), Ray for
several machines."""
