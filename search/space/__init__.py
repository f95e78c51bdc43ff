"""The strategy space: each op's sharding strategies (`rules`, `strides`, `strategies`, a loop's
carried values in `carried`), the search's units of choice (`units`), what the user's constraints
and co-shards leave of it (`constraints`, `coshard`), and the mesh shapes tried (`meshes`)."""
