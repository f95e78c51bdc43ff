"""The ground floor: plain types every stage reads and writes (sharding specs, the kinds of ops,
the Plan with what the search measured, what it was made for and its JSON form), importing
nothing of rhino_jax's stages above."""
