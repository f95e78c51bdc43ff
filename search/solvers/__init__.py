"""The solvers: the ILP over cones (`ilp`, solved in a process of its own, `solver_process`),
by windows where it is too large to solve whole (`windows`), and O2/O3's levels of tying with the
search's deadline (`levels`)."""
