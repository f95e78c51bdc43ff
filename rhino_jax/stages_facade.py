"""What rhino_jax's compiled steps answer as `jax.stages.Compiled` does, read from the jax object
that knows it: the executable of a step run as one program, the lowered step of one run as
several."""
from __future__ import annotations


class CompiledTrees:
    """`in_tree`, `out_tree` and `out_info` of a compiled step, from `_trees_from`."""

    _trees_from: object

    @property
    def in_tree(self):
        """The structure of the dynamic arguments, ((args...), {kwargs}), as jax gives it."""
        return self._trees_from.in_tree

    @property
    def out_tree(self):
        return self._trees_from.out_tree

    @property
    def out_info(self):
        """The result's shapes, dtypes and shardings, in the result's structure."""
        return self._trees_from.out_info
