"""The ground floor: plain types every stage reads and writes (sharding specs, the kinds of ops),
importing nothing of rhino_jax's stages above."""
